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
from kvserve.kv.offload.stores import STALE_TMP_SECONDS, TMP_PREFIX, DiskStore

FP = KVFingerprint(
    weights="w", weight_quantization="none", activation_quantization="none", kernels="torch",
    attention_backend="cpu", device_type="cpu", dtype="float32", kv_cache_dtype="float32", tier_dtype="auto",
    static_kv_scales="",
    block_size=4, hash_algo="sha256", num_layers=2, num_kv_heads=1, head_dim=8, torch_version="t",
    kvserve_version="v",
)  # fmt: skip
BLOCK_BYTES = 256 * 1024  # big enough that writes take a while and overlap the reads


def block(i: int) -> tuple[bytes, BlockKey, torch.Tensor]:
    """Block i of one chain-free family: its hash, key, and a payload that encodes i (so a mix-up shows)."""
    tokens = (i, i + 1, i + 2, i + 3)
    key = BlockKey(None, tokens, b"")
    payload = torch.full((BLOCK_BYTES,), i % 251, dtype=torch.uint8)
    return BlockHasher().hash_block(None, tokens), key, payload


def test_a_record_round_trips_and_every_check_refuses():
    h, key, payload = block(7)
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
    version_bumped[8] = 2
    with pytest.raises(RecordError, match="format version 2"):
        decode_record(bytes(version_bumped), FP.digest, h, key)


def _writer(root: str, seed: int, n: int) -> None:
    store = DiskStore(Path(root), FP, capacity_bytes=1 << 30)
    order = list(range(n))
    if seed:
        order.reverse()
    for i in order:
        store.write(*block(i))


def _reader(root: str, n: int, ready, writers_done, out) -> None:
    """Read every block over and over while the writers write, and once more after they are done."""
    store = DiskStore(Path(root), FP, capacity_bytes=1 << 30)
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
    store = DiskStore(tmp_path, FP, capacity_bytes=1 << 30)
    assert store.usage().num_blocks == n
    assert not [p for p in tmp_path.rglob(f"{TMP_PREFIX}*") if "fingerprint" not in p.name]
    for i in range(n):
        h, key, payload = block(i)
        assert torch.equal(store.read(h, key), payload)


def test_the_budget_evicts_least_recently_used_first(tmp_path):
    record_bytes = len(encode_record(FP.digest, *block(0)[:2], bytes(BLOCK_BYTES)))
    store = DiskStore(tmp_path, FP, capacity_bytes=10 * record_bytes)
    for i in range(10):
        store.write(*block(i))
        os.utime(store.path_for(block(i)[0]), (1000 + i, 1000 + i))  # a clear LRU order
    store.read(*block(0)[:2])  # block 0 is used again: the newest
    store.write(*block(10))  # over budget: evicts down to 90% (9 records) from the oldest
    kept = [i for i in range(11) if store.contains(block(i)[0])]
    assert kept == [0, *range(3, 11)]
    assert store.usage().num_blocks == 9


def test_a_dead_writers_temporary_files_are_swept(tmp_path):
    store = DiskStore(tmp_path, FP, capacity_bytes=1 << 20)
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
        DiskStore(tmp_path / "link", FP, capacity_bytes=1 << 20)
