"""The disk tier's records and store without an engine: every check of a record refuses what it should, two
processes writing one directory at once never expose a partial record to a reader in a third, the budget holds under
the lock, and dead writers' temporary files are swept."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from kvserve.kv.hashing import BlockHasher, BlockKey
from kvserve.kv.offload.fingerprint import KVFingerprint
from kvserve.kv.offload.record import RecordError, decode_record, encode_record
from kvserve.kv.offload.store_dir import STALE_TMP_SECONDS, TMP_PREFIX
from kvserve.kv.offload.stores import DiskStore

FP = KVFingerprint(
    weights="w", weight_quantization="none", activation_quantization="none", kernels="torch",
    attention_backend="cpu", device_type="cpu", dtype="float32", kv_cache_dtype="float32", tier_dtype="auto",
    static_kv_scales="",
    block_size=4, hash_algo="sha256", num_layers=2, num_kv_heads=1, head_dim=8, kv_cache_groups="2|full",
    torch_version="t", kvserve_version="v",
)  # fmt: skip
BLOCK_BYTES = 256 * 1024  # big enough that writes take a while and overlap the reads


def block(i: int, group: int = 0) -> tuple[tuple[int, bytes], BlockKey, torch.Tensor]:
    """Block i of one chain-free family: its tier key (group, hash), content key, and a payload that encodes i (so a
    mix-up shows)."""
    tokens = (i, i + 1, i + 2, i + 3)
    key = BlockKey(None, tokens, b"")
    payload = torch.full((BLOCK_BYTES,), i % 251, dtype=torch.uint8)
    return (group, BlockHasher().hash_block(None, tokens)), key, payload


def test_a_record_round_trips_and_every_check_refuses():
    (_, h), key, payload = block(7)
    data = encode_record(FP.digest, h, key, payload.numpy().tobytes())
    assert bytes(decode_record(data, FP.digest, h, key)) == payload.numpy().tobytes()
    other_fp = b"\x01" * 16
    cases = {
        "truncated": data[:-1],
        "length": data + b"\x00",
        "checksum mismatch": data[:200] + bytes([data[200] ^ 1]) + data[201:],
        "bad magic": b"X" + data[1:],
    }
    for bad in cases.values():
        with pytest.raises(RecordError):
            decode_record(bad, FP.digest, h, key)
    with pytest.raises(RecordError, match="another fingerprint"):
        decode_record(data, other_fp, h, key)
    with pytest.raises(RecordError, match="another block"):
        decode_record(data, FP.digest, h, BlockKey(None, (0, 0, 0, 0), b""))
    with pytest.raises(RecordError, match="another block"):
        decode_record(data, FP.digest, h, BlockKey(None, key.token_ids, b"salt"))
    version_bumped = bytearray(data)
    version_bumped[8] = 3
    with pytest.raises(RecordError, match="format version 3"):
        decode_record(bytes(version_bumped), FP.digest, h, key)
    with pytest.raises(RecordError, match="group 0's block, not group 1's"):
        decode_record(data, FP.digest, h, key, group_id=1)


def test_a_version_1_record_is_refused():
    """A record an older kvserve wrote (format 1: a block of every layer, no KV cache group) is never read."""
    (_, h), key, payload = block(3)
    data = bytearray(encode_record(FP.digest, h, key, payload.numpy().tobytes()))
    data[8] = 1
    with pytest.raises(RecordError, match="format version 1"):
        decode_record(bytes(data), FP.digest, h, key)


def _writer(root: str, seed: int, n: int) -> None:
    store = DiskStore(Path(root), FP, capacity_bytes=1 << 30, payload_bytes=BLOCK_BYTES)
    order = list(range(n))
    if seed:
        order.reverse()
    for i in order:
        store.write(*block(i))


def _reader(root: str, n: int, ready, writers_done, out) -> None:
    """Read every block over and over while the writers write, and once more after they are done."""
    store = DiskStore(Path(root), FP, capacity_bytes=1 << 30, payload_bytes=BLOCK_BYTES)
    seen = refused = 0
    ready.set()
    last_pass = False
    while True:
        last_pass = writers_done.is_set()
        for i in range(n):
            h, key, payload = block(i)
            try:
                got = store.read(h, key)
            except KeyError:
                continue  # not written yet: a miss, never a partial record
            except RecordError:
                refused += 1
                continue
            if not torch.equal(got, payload):
                refused += 1
            seen += 1
        if last_pass:
            break
    out.put((seen, refused))


def test_two_processes_writing_at_once_never_expose_a_partial_record(tmp_path):
    n = 120
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ready, writers_done = ctx.Event(), ctx.Event()
    reader = ctx.Process(target=_reader, args=(str(tmp_path), n, ready, writers_done, results))
    reader.start()
    assert ready.wait(60)
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), seed, n)) for seed in (0, 1)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    writers_done.set()
    seen, refused = results.get(timeout=120)
    reader.join(30)
    assert reader.exitcode == 0
    assert refused == 0 and seen >= n  # the last pass alone reads all n
    store = DiskStore(tmp_path, FP, capacity_bytes=1 << 30, payload_bytes=BLOCK_BYTES)
    assert store.usage().num_blocks == n
    assert not [p for p in tmp_path.rglob(f"{TMP_PREFIX}*") if "fingerprint" not in p.name]
    for i in range(n):
        h, key, payload = block(i)
        assert torch.equal(store.read(h, key), payload)


def test_the_budget_evicts_least_recently_used_first(tmp_path):
    record_bytes = len(encode_record(FP.digest, block(0)[0][1], block(0)[1], bytes(BLOCK_BYTES)))
    store = DiskStore(tmp_path, FP, capacity_bytes=10 * record_bytes, payload_bytes=BLOCK_BYTES)
    for i in range(10):
        store.write(*block(i))
        os.utime(store.path_for(block(i)[0]), (1000 + i, 1000 + i))  # a clear LRU order
    store.read(*block(0)[:2])  # block 0 is used again: the newest
    store.write(*block(10))  # over budget: evicts down to 90% (9 records) from the oldest
    kept = [i for i in range(11) if store.contains(block(i)[0])]
    assert kept == [0, *range(3, 11)]
    assert store.usage().num_blocks == 9


def test_a_retained_record_outlives_the_budget_until_its_time(tmp_path):
    """prompt_cache_retention: a retained record (its mtime set in the future) is passed over by eviction, used or
    not, while unretained ones go, however recently used; a reopened store (a restart) keeps it; once its time has
    passed it is evicted as the oldest."""
    record_bytes = len(encode_record(FP.digest, block(0)[0][1], block(0)[1], bytes(BLOCK_BYTES)))
    store = DiskStore(tmp_path, FP, capacity_bytes=10 * record_bytes, payload_bytes=BLOCK_BYTES)
    for i in range(10):
        store.write(*block(i))
        os.utime(store.path_for(block(i)[0]), (1000 + i, 1000 + i))
    until = time.time() + 86400
    assert store.retain(block(0)[0], until) and not store.retain(block(99)[0], until)  # 99 was never written
    store.read(*block(0)[:2])  # a use never shortens a retention
    assert os.stat(store.path_for(block(0)[0])).st_mtime == pytest.approx(until)
    store.close()
    store = DiskStore(tmp_path, FP, capacity_bytes=10 * record_bytes, payload_bytes=BLOCK_BYTES)
    for i in range(10, 16):
        store.write(*block(i))
    assert store.contains(block(0)[0])  # six evictions later: every other old record is gone
    assert not any(store.contains(block(i)[0]) for i in range(1, 7))
    os.utime(store.path_for(block(0)[0]), (999, 999))  # its time has passed: an ordinary (old) record
    store.write(*block(16))
    assert not store.contains(block(0)[0])


def test_a_dead_writers_temporary_files_are_swept(tmp_path):
    store = DiskStore(tmp_path, FP, capacity_bytes=1 << 20, payload_bytes=BLOCK_BYTES)
    shard = store.blocks_dir / "ab"
    shard.mkdir()
    stale, fresh = shard / f"{TMP_PREFIX}1-2-3", shard / f"{TMP_PREFIX}4-5-6"
    stale.write_bytes(b"half a record")
    fresh.write_bytes(b"being written")
    old = time.time() - STALE_TMP_SECONDS - 10
    os.utime(stale, (old, old))
    store.scan()
    assert not stale.exists() and fresh.exists()


def test_a_symlinked_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError, match="symbolic link"):
        DiskStore(tmp_path / "link", FP, capacity_bytes=1 << 20, payload_bytes=BLOCK_BYTES)


def _parts(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


def test_read_into_fills_several_buffers_and_refuses_every_bad_record(tmp_path):
    """A disk restore reads a record straight into a block's slices of the cache (one buffer per layer tensor): the
    payload lands split across them in order, and every check still refuses a bad record, naming why, and removes it."""
    store = DiskStore(tmp_path, FP, capacity_bytes=1 << 30, payload_bytes=BLOCK_BYTES)
    h, key, payload = block(5)
    store.write(h, key, payload)
    sizes = [BLOCK_BYTES // 4, BLOCK_BYTES // 2, BLOCK_BYTES // 4]
    parts = _parts(sizes)
    store.read_into(h, key, parts)
    assert b"".join(bytes(p) for p in parts) == payload.numpy().tobytes()

    path = store.path_for(h)
    good = path.read_bytes()
    cases = {
        "checksum mismatch": good[:-100] + bytes([good[-100] ^ 1]) + good[-99:],  # a flipped payload byte
        "truncated": good[:10],
        "length": good[:-1],
        "bad magic": b"X" + good[1:],
        "another fingerprint": good[:12] + b"\x01" * 16 + good[28:],
    }
    for reason, bad in cases.items():
        path.write_bytes(bad)
        with pytest.raises(RecordError, match=reason):
            store.read_into(h, key, _parts(sizes))
        assert not path.exists()  # removed: it is recomputed and stored again
    path.write_bytes(good)
    with pytest.raises(RecordError, match="another block"):
        store.read_into(h, BlockKey(None, key.token_ids, b"salt"), _parts(sizes))
    path.write_bytes(good)
    with pytest.raises(RecordError, match="a block holds"):
        store.read_into(h, key, _parts([BLOCK_BYTES // 2]))
    with pytest.raises(KeyError):
        store.read_into(h, key, _parts(sizes))  # refused and removed above: a miss now


def _tier_on(tmp_path: Path, queued_blocks: int):
    """An OffloadTier on disk over a small two-layer float32 cache whose blocks hold distinct values, its writer's ring
    `queued_blocks` deep."""
    from kvserve.kv.cache import LayerKVCache
    from kvserve.kv.offload.config import KVOffloadConfig
    from kvserve.kv.offload.tier import OffloadTier

    shape = (16, 4, 1, 8)  # blocks, block size, KV heads, head dim: 128 bytes a tensor's block, 512 a block
    caches = [
        LayerKVCache(torch.randn(shape), torch.randn(shape)),
        LayerKVCache(torch.randn(shape), torch.randn(shape)),
    ]
    config = KVOffloadConfig(size_bytes=1 << 20, path=tmp_path, max_queued_bytes=queued_blocks * 512)
    snapshot = [(c.key.clone(), c.value.clone()) for c in caches]
    return OffloadTier.for_kv_caches(config, FP, caches, block_size=4), caches, snapshot


def test_the_disk_writers_ring_drops_what_finds_it_full_and_reuses_its_slots(tmp_path, monkeypatch):
    """Stores never wait for the writer: with the writer held and its ring (4 slots) full, further blocks are dropped
    and counted; once it runs, each written record holds its block's bytes and the slots serve new stores."""
    import threading

    from kvserve.kv.block import TierBlock

    gate = threading.Event()
    real_write = DiskStore.write

    def held_write(self, *args):
        gate.wait(30)
        return real_write(self, *args)

    monkeypatch.setattr(DiskStore, "write", held_write)
    tier, caches, snapshot = _tier_on(tmp_path, queued_blocks=4)
    blocks = [TierBlock(i, block(100 + i)[0][1], block(100 + i)[1]) for i in range(10)]
    # The pool's memory was touched at start (zeroed): give the blocks their values back.
    for cache, (k, v) in zip(caches, snapshot):
        cache.key.copy_(k)
        cache.value.copy_(v)
    tier.prepare_store(blocks[:7])
    assert tier.dropped_blocks == 3  # 4 queued in the ring, 3 found it full
    gate.set()
    tier.flush()
    tier.prepare_store(blocks[7:])  # the slots came back: all three are queued
    tier.flush()
    assert tier.stored_blocks == 7 and tier.dropped_blocks == 3
    stored = [b for b in blocks if tier.store is not None and tier.store.contains((0, b.block_hash))]
    assert [b.block_id for b in stored] == [0, 1, 2, 3, 7, 8, 9]
    assert tier.store is not None
    for b in stored:
        parts = [memoryview(bytearray(128)) for _ in range(4)]
        tier.store.read_into((0, b.block_hash), b.key, parts)
        want = [t[b.block_id].numpy().tobytes() for k, v in snapshot for t in (k, v)]
        assert [bytes(p) for p in parts] == want
    tier.close()


@pytest.mark.parametrize(
    "slots",
    [
        [3, 4, 5, 6],  # one run of consecutive slots: sliced copies
        [9, 10, 2, 3],  # two runs
        [11, 7, 5, 3, 1, 13, 0, 8, 6],  # more runs than the fast path takes: through the staging buffer
    ],
)
@pytest.mark.parametrize("targets", ["consecutive", "scattered"])
def test_the_layout_restores_slab_rows_into_their_blocks_whatever_their_order(slots, targets):
    """BlockLayout.scatter from the host tier's slab (rows `slots`) gives every target block exactly the bytes its
    source block had, whichever path the slots' order takes (runs of consecutive slots, or the staging gather)."""
    from kvserve.kv.cache import LayerKVCache
    from kvserve.kv.offload.layout import BlockLayout

    shape = (32, 4, 2, 8)
    caches = [LayerKVCache(torch.randn(shape), torch.randn(shape)) for _ in range(3)]
    layout = BlockLayout(caches)
    sources = list(range(1, 1 + len(slots)))
    slab = torch.zeros(16, layout.block_bytes, dtype=torch.uint8)
    layout.gather_into(sources, slab, slots)
    want = [[t[b].clone() for b in sources] for t in layout.tensors]
    dest = (
        list(range(20, 20 + len(slots)))
        if targets == "consecutive"
        else [31, 12, 18, 25, 14, 29, 16, 23, 27][: len(slots)]
    )
    layout.scatter(dest, slab, slots)
    for t, blocks in zip(layout.tensors, want):
        for d, block in zip(dest, blocks):
            assert torch.equal(t[d], block)


def test_every_counter_the_tier_updates_is_written_under_its_lock():
    """#43 item 15: the tier's counters are written by the engine thread, the writers and the loader; an update
    outside the lock (a read-modify-write) can lose another thread's. Every assignment to a counter (or to the last
    error) in the tier and its backends, outside __init__, sits inside `with <...>.lock:` (TierCounters.add takes
    it)."""
    import ast
    import dataclasses
    import inspect

    from kvserve.kv.offload import backend, disk_tier, host_tier, tier

    counters = {f.name for f in dataclasses.fields(tier.OffloadStats)} | {"error"}
    unlocked = []

    def visit(node: ast.AST, where: str, func: str, locked: bool) -> None:
        if isinstance(node, ast.FunctionDef):
            func = node.name
        if isinstance(node, ast.With):
            locked = locked or any(ast.unparse(item.context_expr).endswith("lock") for item in node.items)
        targets = (
            [node.target] if isinstance(node, ast.AugAssign) else node.targets if isinstance(node, ast.Assign) else []
        )
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and t.attr in counters and func != "__init__" and not locked:
                    unlocked.append(f"{where} {func}: {ast.unparse(node)} (line {node.lineno})")
        for child in ast.iter_child_nodes(node):
            visit(child, where, func, locked)

    for module in (tier, backend, host_tier, disk_tier):
        visit(ast.parse(inspect.getsource(module)), module.__name__, "", False)
    assert not unlocked, unlocked


def test_the_weights_identity_covers_every_byte_and_is_cached(tmp_path, monkeypatch):
    """#43 item 6: an edited GGUF with the same name and size whose first and last MiB are unchanged had the same
    identity (so the tier restored the other model's KV). The identity hashes the whole file; a restart finds it in
    the cache (keyed by device, inode, size, mtime and ctime) instead of reading the file again."""
    from kvserve.kv.offload import fingerprint

    model = tmp_path / "model.gguf"
    data = bytearray(os.urandom(3 << 20))
    model.write_bytes(data)
    cache = tmp_path / "cache"
    first = fingerprint.weights_identity(model, cache)
    data[len(data) // 2] ^= 1  # the middle MiB only: same name, same size, same ends
    model.write_bytes(data)
    edited = fingerprint.weights_identity(model, cache)
    assert edited != first

    def no_reading(*args, **kwargs):
        raise AssertionError("the file was read again")

    monkeypatch.setattr(fingerprint, "file_digest", no_reading)
    assert fingerprint.weights_identity(model, cache) == edited  # from the cache

    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    weights = bytearray(os.urandom(3 << 20))
    (checkpoint / "model.safetensors").write_bytes(weights)
    monkeypatch.undo()
    before = fingerprint.weights_identity(checkpoint, cache)
    weights[len(weights) // 2] ^= 1
    (checkpoint / "model.safetensors").write_bytes(weights)
    assert fingerprint.weights_identity(checkpoint, cache) != before


def test_a_failed_store_is_retried_with_backoff_and_counted(tmp_path, monkeypatch):
    """#43 item 7: after ENOSPC the tier stored nothing until a restart. Now a write error pauses stores (counted in
    io_errors, the blocks dropped), for a delay that doubles while errors go on, and the first write after the pause
    that succeeds turns stores on again. The clock is the test's: no waiting."""
    import errno

    from kvserve.kv.block import TierBlock

    real_write = DiskStore.write
    failing = [True]

    def write(self, *args):
        if failing[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args)

    monkeypatch.setattr(DiskStore, "write", write)
    tier, caches, snapshot = _tier_on(tmp_path, queued_blocks=8)
    now = [100.0]
    tier.backoff.clock = lambda: now[0]
    blocks = [TierBlock(i, block(200 + i)[0][1], block(200 + i)[1]) for i in range(8)]
    tier.prepare_store(blocks[:1])
    tier.flush()
    first = tier.backoff.delay
    assert not tier.available and tier.io_errors == 1 and tier.stored_blocks == 0 and first > 0
    tier.prepare_store(blocks[1:2])  # paused: not even copied
    assert tier.stats().io_errors == 1
    now[0] += first
    assert tier.available
    tier.prepare_store(blocks[2:3])
    tier.flush()
    assert tier.io_errors == 2 and tier.backoff.delay == 2 * first  # failed again: a longer pause
    failing[0] = False
    now[0] += 2 * first
    tier.prepare_store(blocks[3:5])
    tier.flush()
    assert tier.available and tier.stored_blocks == 2 and tier.io_errors == 2 and tier.backoff.delay == 0
    tier.close()


SMALL = 4096  # a small payload: many records, quickly


def small_block(i: int) -> tuple[tuple[int, bytes], BlockKey, torch.Tensor]:
    tokens = (i, i + 1, i + 2, i + 3)
    return (0, BlockHasher().hash_block(None, tokens)), BlockKey(None, tokens, b""), torch.full((SMALL,), i % 251)


def on_disk(root: Path) -> tuple[int, int]:
    """(records, bytes) of every fingerprint's records under `root`."""
    sizes = [p.stat().st_size for p in root.glob("*/blocks/*/*.kvb")]
    return len(sizes), sum(sizes)


def test_the_budget_holds_under_churn_and_the_count_is_the_directorys(tmp_path):
    """Two writer threads (the disk tier runs two) storing at once: the directory ended a record or two over its budget
    and the store's count of it below the truth (a scan set the count while a write landed: the write's bytes were
    lost, so the next scan came late). Room is now made before a record is written, under one lock with the scans."""
    import threading

    record_bytes = len(encode_record(FP.digest, small_block(0)[0][1], small_block(0)[1], bytes(SMALL)))
    capacity = 20 * record_bytes
    store = DiskStore(tmp_path, FP, capacity_bytes=capacity, payload_bytes=SMALL)
    worst = [0]

    def writer(start: int) -> None:
        for i in range(start, start + 300):
            key, content, payload = small_block(i)
            store.write(key, content, payload.to(torch.uint8))
            with store._mutex:
                worst[0] = max(worst[0], store._bytes_estimate)

    threads = [threading.Thread(target=writer, args=(n * 1000,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records, used = on_disk(tmp_path)
    assert used <= capacity and worst[0] <= capacity
    assert store.usage().num_blocks == records and store.usage().bytes_used == used


def test_other_fingerprints_records_count_against_the_budget_and_go_first(tmp_path):
    """D9: each upgrade or flag change (a new fingerprint) left a full budget of dead records; the directory grew to N
    budgets. Every fingerprint's records now count against the one budget, least recently used first: the old
    fingerprint's, untouched since, go before the new one's. The records a process keeps beside its blocks (a hybrid
    model's state snapshots: the same fingerprint but for what a record holds) have their own share and are never
    evicted by the blocks' store."""
    from dataclasses import replace

    record_bytes = len(encode_record(FP.digest, small_block(0)[0][1], small_block(0)[1], bytes(SMALL)))
    capacity = 10 * record_bytes
    old = DiskStore(tmp_path, replace(FP, kvserve_version="old"), capacity_bytes=capacity, payload_bytes=SMALL)
    for i in range(9):
        old.write(*small_block(i)[:2], small_block(i)[2].to(torch.uint8))
        os.utime(old.path_for(small_block(i)[0]), (1000 + i, 1000 + i))
    old.close()
    state = DiskStore(tmp_path, FP.for_state_snapshots("s"), capacity_bytes=capacity, payload_bytes=SMALL)
    for i in range(100, 103):
        state.write(*small_block(i)[:2], small_block(i)[2].to(torch.uint8))
    for i in range(100, 103):  # older than everything: still never the blocks' store's to evict
        os.utime(state.path_for(small_block(i)[0]), (500, 500))
    new = DiskStore(tmp_path, FP, capacity_bytes=capacity, payload_bytes=SMALL)
    for i in range(200, 209):
        new.write(*small_block(i)[:2], small_block(i)[2].to(torch.uint8))
    records, used = on_disk(tmp_path)
    assert used - 3 * record_bytes <= capacity  # the blocks' budget, beside the state snapshots' share
    assert all(new.contains(small_block(i)[0]) for i in range(200, 209))  # the new fingerprint's are all there
    assert all(state.contains(small_block(i)[0]) for i in range(100, 103))
    assert len(list(tmp_path.glob(f"{old.fingerprint.name}/blocks/*/*.kvb"))) < 9  # the dead ones went first
