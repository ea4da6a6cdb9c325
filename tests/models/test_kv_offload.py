"""The KV offload tier through the whole engine on tiny random checkpoints (docs/KV_OFFLOAD.md): a prefix the pool
evicted is restored (host memory and disk), a restarted engine restores what an earlier one stored, and whatever the
tier holds or fails to hold (another fingerprint, corrupt, truncated or deleted records, a directory that cannot be
written, a full disk, another tenant's salt, a request that leaves mid-restore) the greedy output equals a cold run's
and every pool block is back: free + referenced == usable, checked after every scenario."""

from __future__ import annotations

import errno
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_engine

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.kv.offload.store_dir import RECORD_SUFFIX
from kvserve.kv.offload.stores import DiskStore
from kvserve.outputs import RequestOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# The sliding variant has three KV cache groups of one layer each (kv/groups.py: one full-attention group, two
# sliding-window groups that keep 8 tokens): 95 usable one-layer blocks of 4 tokens, the memory of 31 blocks of the
# uniform layout. One 60-token prompt and its output take 17 full-attention blocks (and each sliding group all 15 of
# its blocks while the prompt's one step prefills), so the fillers evict it. A restore of its 14 full blocks brings
# the full group's 14 and each sliding group's last 2 (the 7 tokens before the hit point): 18 blocks.
POOL = dict(num_gpu_blocks_override=96, block_size=4, max_model_len=96)
UNIFORM_POOL = {**POOL, "num_gpu_blocks_override": 32}  # the llama variant: one group of every layer
RESTORED_BLOCKS = {"llama_gqa": 14, "gemma3_mqa_sliding": 14 + 2 * 2}
# What one run of PROMPT stores of the sliding variant (67 computed tokens: 16 full blocks): every full-attention
# block, and of each sliding group the 2-block windows a restore can use, before the prompt's hit point (block 14,
# where the same prompt hits again) and before the end of the computed blocks (16, where a next turn hits).
STORED = 16 + 2 * (2 + 2)


def prompt(seed: int, n: int = 60) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(4, 256, (n - 1,), generator=g).tolist()


PROMPT = prompt(0)
FILLERS = [prompt(s) for s in (1, 2, 3)]
MORE_FILLERS = [prompt(s) for s in (4, 5, 6)]


def run_to_end(engine: LLMEngine, ids: list[int], salt: str | None = None, request_id: str = "r") -> RequestOutput:
    """One request run to its end (the invariants checked after every step): its final output."""
    engine.add_request(request_id, ids, GREEDY, cache_salt=salt)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine.check_invariants()
            if out.finished:
                final = out
    assert final is not None
    return final


def run(
    engine: LLMEngine, ids: list[int], salt: str | None = None, request_id: str = "r"
) -> tuple[list[int], int, int]:
    """(greedy tokens, cached tokens, of them restored from the tier) of one request run to its end."""
    final = run_to_end(engine, ids, salt, request_id)
    return list(final.outputs[0].token_ids), final.num_cached_tokens, final.num_restored_tokens


def evict(engine: LLMEngine) -> None:
    """Run prompts that need the whole pool, so that nothing of an earlier prompt stays in it: six, as the pool
    reuses the fillers' own out-of-window blocks before an earlier prompt's cached ones (BlockPool's spent queue)."""
    for i, ids in enumerate(FILLERS + MORE_FILLERS):
        run(engine, ids, request_id=f"filler{i}")


def assert_pool_whole(engine: LLMEngine) -> None:
    engine.check_invariants()
    pool = engine.core.pool
    assert pool.num_free_blocks == pool.num_usable_blocks, "a block was not returned to the pool"
    connector = engine.core.scheduler.offload
    assert connector is None or not (connector.loads or connector.orphan_loads)


def flushed(engine: LLMEngine) -> LLMEngine:
    assert engine.core.offload is not None
    engine.core.offload.flush()
    return engine


@pytest.fixture(scope="module")
def model_dir(checkpoints) -> Path:
    return checkpoints["gemma3_mqa_sliding"]


@pytest.fixture(scope="module")
def cold(model_dir) -> list[int]:
    """The prompt's greedy output from an engine without a tier."""
    engine = tiny_engine(model_dir, **POOL)
    tokens, cached, restored = run(engine, PROMPT)
    assert (cached, restored) == (0, 0)
    return tokens


def disk_engine(model_dir: Path, path: Path, **overrides) -> LLMEngine:
    return tiny_engine(
        model_dir, **{**POOL, "kv_offloading_size": "8MiB", "kv_offloading_path": str(path), **overrides}
    )


def records(path: Path) -> list[Path]:
    return sorted(path.glob(f"*/blocks/*/*{RECORD_SUFFIX}"))


def chain(path: Path) -> list[Path]:
    """The full-attention group's records of a tier at `path` in chain order (first block first), read from their
    heads (hash and parent)."""
    from kvserve.kv.offload.record import _HEADER

    by_parent: dict[bytes | None, Path] = {}
    for record in records(path):
        if not record.name.endswith(f"-0{RECORD_SUFFIX}"):
            continue
        head = record.read_bytes()[: _HEADER.size + 128]
        *_, hash_len, parent_len, _, _ = _HEADER.unpack_from(head)
        at = _HEADER.size + hash_len
        by_parent[None if parent_len == 0xFFFF else head[at : at + parent_len]] = record
    ordered, parent = [], None
    while parent in by_parent:
        ordered.append(by_parent[parent])
        parent = bytes.fromhex(ordered[-1].name.split("-")[0])
    return ordered


@pytest.mark.parametrize("variant", ["llama_gqa", "gemma3_mqa_sliding"])
def test_host_memory_tier_restores_what_the_pool_evicted(checkpoints, variant):
    pool = POOL if variant == "gemma3_mqa_sliding" else UNIFORM_POOL
    plain = tiny_engine(checkpoints[variant], **pool)
    want, _, _ = run(plain, PROMPT)
    engine = tiny_engine(checkpoints[variant], **pool, kv_offloading_size="8MiB")
    assert run(engine, PROMPT)[0] == want
    evict(engine)
    tokens, cached, restored = run(engine, PROMPT, request_id="again")
    assert tokens == want
    assert restored == cached == 56  # every full block before the last prompt token's (60 // 4 - 1 blocks)
    stats = engine.core.stats()
    assert stats.offload is not None and stats.offload.medium == "CPU"
    assert stats.offload.restored_blocks == RESTORED_BLOCKS[variant]
    assert stats.external_prefix_cache_hits_tokens == 56
    # Evicting from the pool while the tier has room never drops a tier copy: the fillers' blocks are there too.
    assert stats.offload.stored_blocks >= 4 * 14
    assert_pool_whole(engine)


def test_host_memory_tier_keeps_to_its_budget(model_dir):
    engine = tiny_engine(model_dir, **POOL, kv_offloading_size="64KiB")
    tier = engine.core.offload
    assert tier is not None
    for i, ids in enumerate([PROMPT, *FILLERS]):
        run(engine, ids, request_id=str(i))
    stats = tier.stats()
    assert 0 < stats.bytes_used <= 64 * 1024 and stats.num_blocks == 64 * 1024 // stats.block_bytes
    assert_pool_whole(engine)


def test_disk_tier_survives_a_restart(model_dir, cold, tmp_path):
    first = disk_engine(model_dir, tmp_path)
    assert run(first, PROMPT)[0] == cold
    flushed(first).core.close()
    assert len(records(tmp_path)) == STORED  # the prompt and 7 outputs (the 8th is never computed)
    second = disk_engine(model_dir, tmp_path)
    tokens, cached, restored = run(second, PROMPT)  # its very first request
    assert tokens == cold and restored == cached == 56
    assert second.core.stats().offload.medium == "DISK"
    assert_pool_whole(second)
    second.core.close()


def test_disk_tier_directory_is_private_and_describes_its_fingerprint(model_dir, tmp_path):
    top = tmp_path / "tier"
    engine = disk_engine(model_dir, top)
    (sub,) = [p for p in top.iterdir() if p.is_dir()]
    assert top.stat().st_mode & 0o777 == 0o700 and sub.stat().st_mode & 0o777 == 0o700
    assert '"block_size": 4' in (sub / "fingerprint.json").read_text()
    run(engine, PROMPT)
    flushed(engine)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in records(top))
    engine.core.close()


@pytest.mark.parametrize("change", [dict(kv_cache_dtype="bfloat16"), dict(prefix_caching_hash_algo="xxhash")])
def test_a_changed_fingerprint_is_not_loaded(model_dir, cold, tmp_path, change):
    first = disk_engine(model_dir, tmp_path)
    run(first, PROMPT)
    flushed(first).core.close()
    other = disk_engine(model_dir, tmp_path, **change)
    _, cached, restored = run(other, PROMPT)
    assert (cached, restored) == (0, 0)
    flushed(other).core.close()
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2  # its own subdirectory; the first one's untouched
    assert len(records(tmp_path)) == 2 * STORED


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap"])
def test_damaged_records_are_recomputed(model_dir, cold, tmp_path, damage):
    first = disk_engine(model_dir, tmp_path)
    run(first, PROMPT)
    flushed(first).core.close()
    # The records in chain order are unknown from their names; damage one of the full-attention group's (every one a
    # restore of the prompt reads) in the middle of the directory's listing.
    files = [p for p in records(tmp_path) if p.name.endswith(f"-0{RECORD_SUFFIX}")]
    victim = files[len(files) // 2]
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif damage == "delete":
        victim.unlink()
    else:  # another block's (valid) record under this block's name
        victim.write_bytes(files[0].read_bytes() if victim != files[0] else files[1].read_bytes())
    second = disk_engine(model_dir, tmp_path)
    final = run_to_end(second, PROMPT)
    tokens, cached, restored = list(final.outputs[0].token_ids), final.num_cached_tokens, final.num_restored_tokens
    assert tokens == cold
    assert restored == cached < 56  # the chain stops at the damaged block; the rest is computed
    stats = second.core.stats().offload
    assert stats.restore_failures == (0 if damage == "delete" else 1)
    # Why the hit stopped, through the real restore: a record the restore refused is named where the hit stopped; a
    # deleted one, or a truncated one (the start-up scan removes a file of no record's size), is no record at all, and
    # this fresh process has seen nothing else.
    reason = "never_seen" if damage in ("delete", "truncate") else "tier_record_failed_check"
    assert final.prefix_miss is not None and (final.prefix_miss.reason, final.prefix_miss.at_token) == (reason, cached)
    counts = dict(second.core.kv_manager.miss_counts.snapshot())
    assert counts[reason] == 1 and sum(counts.values()) == 1
    assert_pool_whole(second)
    # The bad record was dropped and the recomputed block stored again: a third start restores everything.
    flushed(second).core.close()
    third = disk_engine(model_dir, tmp_path)
    assert run(third, PROMPT)[2] == 56
    third.core.close()


@pytest.mark.parametrize("when", ["before the start", "while running"])
def test_a_planted_terabyte_record_costs_only_its_own_block(checkpoints, tmp_path, when):
    """#43 item 3 through the engine: a 1 TiB sparse file in a record's place raised MemoryError in the loader, which
    turned the whole restore into 0 blocks with nothing counted, and at the next start the scan counted the terabyte
    against the budget and evicted every good record. Now the file is refused by its size (by the start-up scan, or
    by the restore that meets it), counted once, removed; the blocks before it are restored (the uniform layout: a
    sliding group's shorter chain would restore nothing), and the next start restores everything."""
    uniform = checkpoints["llama_gqa"]
    want = run(tiny_engine(uniform, **UNIFORM_POOL), PROMPT)[0]
    first = disk_engine(uniform, tmp_path, **UNIFORM_POOL)
    run(first, PROMPT)
    flushed(first).core.close()
    victim = chain(tmp_path)[7]  # the prompt's 8th block: the 7 before it are restored

    def plant() -> None:
        with open(victim, "r+b") as f:
            f.truncate(1 << 40)

    if when == "before the start":
        plant()
    second = disk_engine(uniform, tmp_path, **UNIFORM_POOL)
    if when == "while running":
        plant()
    tokens, cached, restored = run(second, PROMPT)
    assert tokens == want and restored == cached == 7 * 4
    assert_pool_whole(flushed(second))
    assert second.core.stats().offload.restore_failures == 1 and victim.stat().st_size < 1 << 20  # stored again
    second.core.close()
    third = disk_engine(uniform, tmp_path, **UNIFORM_POOL)
    assert run(third, PROMPT)[2] == 56
    third.core.close()


def test_an_unusable_directory_serves_without_a_tier(model_dir, cold, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    engine = disk_engine(model_dir, blocker / "tier")  # cannot be created, even as root
    assert "cannot be used" in caplog.text
    assert run(engine, PROMPT)[0] == cold
    evict(engine)
    assert run(engine, PROMPT, request_id="again")[0] == cold
    stats = engine.core.stats().offload
    assert stats is not None and not stats.available and stats.stored_blocks == 0
    assert_pool_whole(engine)


def test_a_directory_others_can_write_serves_without_a_tier_unless_allowed(model_dir, cold, tmp_path, caplog):
    """#43 item 2 through the engine: a tier directory writable by others is refused (logged, naming the flag) and the
    engine serves without it; --kv-offloading-allow-other-writers uses it."""
    top = tmp_path / "tier"
    top.mkdir()
    top.chmod(0o777)
    engine = disk_engine(model_dir, top)
    assert "cannot be used" in caplog.text and "--kv-offloading-allow-other-writers" in caplog.text
    assert run(engine, PROMPT)[0] == cold
    assert not engine.core.stats().offload.available and not list(top.iterdir())
    engine.core.close()
    allowed = disk_engine(model_dir, top, kv_offloading_allow_other_writers=True)
    assert run(allowed, PROMPT)[0] == cold
    flushed(allowed)
    assert len(records(top)) == STORED
    allowed.core.close()


def test_a_full_disk_stops_storing_and_keeps_serving(model_dir, cold, tmp_path, monkeypatch, caplog):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "write", full)
    engine = disk_engine(model_dir, tmp_path)
    engine.core.offload.backoff.clock = lambda: 0.0  # the retry never comes during this test
    assert run(engine, PROMPT)[0] == cold
    flushed(engine)
    evict(engine)
    assert run(engine, PROMPT, request_id="again")[0] == cold
    stats = engine.core.stats().offload
    assert not stats.available and stats.io_errors == 1 and stats.dropped_blocks >= 14 and stats.stored_blocks == 0
    assert "stops storing" in caplog.text
    assert_pool_whole(engine)
    engine.core.close()


def test_a_read_only_tier_of_earlier_runs_is_still_read(model_dir, cold, tmp_path, monkeypatch):
    first = disk_engine(model_dir, tmp_path)
    run(first, PROMPT)
    flushed(first).core.close()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(DiskStore, "write", read_only)
    second = disk_engine(model_dir, tmp_path)
    tokens, _, restored = run(second, PROMPT)
    assert tokens == cold and restored == 56
    run(second, FILLERS[0], request_id="f")
    assert_pool_whole(flushed(second))
    second.core.close()


def deny_writes_as_the_kernel_would(monkeypatch) -> None:
    """Make os.open and os.mkdir refuse (EACCES) what the kernel refuses a user who is not root: opening for writing a
    file without its owner's write bit, or creating an entry in a directory without it. Root ignores permission bits,
    so a test that made a directory read-only and runs as root injects the refusal itself."""
    import errno
    import os
    import stat

    real_open, real_mkdir = os.open, os.mkdir

    def writable(path, dir_fd) -> bool:
        try:
            return bool(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode & stat.S_IWUSR)
        except FileNotFoundError:
            parent = os.path.dirname(path) or "."
            if dir_fd is None:
                return bool(os.stat(parent).st_mode & stat.S_IWUSR)
            return bool(os.stat(parent, dir_fd=dir_fd).st_mode & stat.S_IWUSR)

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and not writable(path, dir_fd):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def mkdir_(path, mode=0o777, *, dir_fd=None):
        parent = os.path.dirname(path) or "."
        st = os.stat(parent, dir_fd=dir_fd) if dir_fd is not None else os.stat(parent)
        if not st.st_mode & stat.S_IWUSR:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir_)


def tree(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry below `path`: (mode, size, mtime in ns), to tell whether anything was written."""
    return {str(p): (p.lstat().st_mode, p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_a_read_only_directory_is_restored_from_and_never_written(model_dir, cold, tmp_path, monkeypatch, caplog):
    """#43 item 5: a directory of an earlier run made read-only was refused (the start-up scan opened the lock
    read-write), though the docs promised restores from it. Now it is opened read-only: the earlier run's blocks are
    restored, nothing is stored, and nothing in it changes (no lock, no removal, no mtime touched). As root, whose
    writes permission bits do not stop (os.access says so), the kernel's refusal is injected; the unchanged tree then
    shows that kvserve did not even try."""
    import os

    top = tmp_path / "tier"
    first = disk_engine(model_dir, top)
    run(first, PROMPT)
    flushed(first).core.close()
    paths = [top, *top.rglob("*")]
    for p in paths:
        p.chmod(0o500 if p.is_dir() else 0o400)
    try:
        if os.access(top, os.W_OK):  # root: make the refusal explicit
            deny_writes_as_the_kernel_would(monkeypatch)
        before = tree(top)
        second = disk_engine(model_dir, top)
        tokens, _, restored = run(second, PROMPT)
        assert tokens == cold and restored == 56
        evict(second)
        flushed(second)
        stats = second.core.stats().offload
        assert stats.stored_blocks == 0 and not stats.available and stats.io_errors == 0
        assert "read-only" in caplog.text
        second.core.close()
        assert tree(top) == before
    finally:
        monkeypatch.undo()
        for p in paths:
            p.chmod(0o700 if p.is_dir() else 0o600)


def test_cache_salts_never_restore_each_other(model_dir, tmp_path):
    engine = tiny_engine(model_dir, **POOL, kv_offloading_size="8MiB")
    want = run(engine, PROMPT, salt="tenant-a")[0]
    evict(engine)
    assert run(engine, PROMPT, salt="tenant-b", request_id="b")[2] == 0
    evict(engine)
    assert run(engine, PROMPT, request_id="unsalted")[2] == 0
    evict(engine)
    tokens, _, restored = run(engine, PROMPT, salt="tenant-a", request_id="a2")
    assert tokens == want and restored == 56
    assert_pool_whole(engine)


def test_a_request_aborted_while_its_restore_runs_releases_every_block(model_dir, cold, tmp_path, monkeypatch):
    first = disk_engine(model_dir, tmp_path)
    run(first, PROMPT)
    flushed(first).core.close()
    real_read = DiskStore.read_into

    def slow_read(self, *args):
        time.sleep(0.05)
        return real_read(self, *args)

    monkeypatch.setattr(DiskStore, "read_into", slow_read)
    second = disk_engine(model_dir, tmp_path)
    second.add_request("leaves", PROMPT, GREEDY)
    second.step()  # starts the restore from disk; the request waits for it
    kv = second.core.scheduler.offload
    assert kv is not None and len(kv.loads) == 1
    second.check_invariants()  # the restore's blocks are held, counted
    second.abort_request("leaves")
    assert kv.orphan_loads and not kv.loads
    # Its blocks are still held by the copy: the engine has work until a step gives them back, so a loop that steps
    # while it has unfinished requests (the server's) does not go idle holding them.
    assert second.has_unfinished_requests()
    deadline = time.monotonic() + 30
    while second.has_unfinished_requests() and time.monotonic() < deadline:
        second.step()
        time.sleep(0.01)
    assert not kv.orphan_loads
    assert_pool_whole(second)
    # What the cancelled restore did copy joined the prefix cache; the rest comes from the tier again.
    tokens, cached, _ = run(second, PROMPT, request_id="stays")
    assert tokens == cold and cached == 56
    assert_pool_whole(second)
    second.core.close()


def test_other_requests_step_while_one_waits_for_its_restore(model_dir, cold, tmp_path, monkeypatch):
    first = disk_engine(model_dir, tmp_path)
    run(first, PROMPT)
    flushed(first).core.close()
    gate = __import__("threading").Event()
    real_read = DiskStore.read_into

    def held_read(self, *args):
        gate.wait(30)
        return real_read(self, *args)

    monkeypatch.setattr(DiskStore, "read_into", held_read)
    second = disk_engine(model_dir, tmp_path)
    second.add_request("restoring", PROMPT, GREEDY)
    second.add_request("other", FILLERS[0][:20], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = {}
    for _ in range(40):
        for out in second.step():
            if out.finished:
                finished[out.request_id] = out
        if "other" in finished:
            break
    assert "other" in finished and "restoring" not in finished  # the other request ran to its end meanwhile
    gate.set()
    while second.has_unfinished_requests():
        for out in second.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished["restoring"].outputs[0].token_ids) == cold
    assert finished["restoring"].num_restored_tokens == 56
    assert_pool_whole(second)
    second.core.close()


def test_offloading_flags_are_checked():
    from kvserve.config import EngineConfig

    assert EngineConfig(kv_offloading_size=16).kv_offload.size_bytes == 16 << 30  # a bare number is GiB, as in vLLM
    assert EngineConfig(kv_offloading_size="512MiB").kv_offload.size_bytes == 512 << 20
    assert EngineConfig(kv_offloading_size=0.5, kv_offloading_backend="native").kv_offload.size_bytes == 1 << 29
    assert EngineConfig().kv_offload is None
    with pytest.raises(ValueError, match="lmcache is not available"):
        EngineConfig(kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="needs --kv-offloading-size"):
        EngineConfig(kv_offloading_path="/tmp/x")
    with pytest.raises(ValueError, match="invalid size"):
        EngineConfig(kv_offloading_size="lots")
    with pytest.raises(ValueError, match="must be positive"):
        EngineConfig(kv_offloading_size=0)
    with pytest.raises(ValueError, match="allow-other-writers needs --kv-offloading-path"):
        EngineConfig(kv_offloading_size=1, kv_offloading_allow_other_writers=True)


@pytest.mark.parametrize("size", ["inf", "-inf", "nan", "1e400", "1e12", 1e12, float("inf")])
def test_offloading_sizes_no_machine_has_are_one_line_errors(size):
    """#43 item 7: `inf` and `1e400` raised OverflowError (a traceback), `1e12` (GiB, as a bare number is in vLLM)
    went on to a tier of 2^70 bytes. Each is a ValueError now, which the CLI prints as one line."""
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match="--kv-offloading-size"):
        EngineConfig(kv_offloading_size=size)


def test_a_host_tier_larger_than_the_machines_memory_is_refused(model_dir):
    """A host tier of 1000 TiB ended in a RuntimeError from the allocator; now it is checked against available memory
    with the pool, as the pool is, and refused in one line that names both."""
    with pytest.raises(ValueError, match="available memory"):
        tiny_engine(model_dir, **POOL, kv_offloading_size="1000TiB")


@pytest.mark.parametrize("where", ["host memory", "disk"])
def test_a_tier_smaller_than_one_block_is_refused(model_dir, tmp_path, where):
    """`--kv-offloading-size 1KiB` with a path gave a tier of 0 blocks, silently. Now a tier that holds no block is an
    error that says what a block takes."""
    path = {"kv_offloading_path": str(tmp_path)} if where == "disk" else {}
    with pytest.raises(ValueError, match="holds no block"):
        tiny_engine(model_dir, **POOL, kv_offloading_size="100B", **path)


def test_hits_lost_to_eviction_are_counted_and_a_tier_keeps_them(model_dir):
    """The pool's ghost list of recent evictions: without a tier the re-sent prompt's blocks count as lost to
    eviction (doctor's evidence for a tier); with one they are restored and nothing is lost."""
    plain = tiny_engine(model_dir, **POOL)
    run(plain, PROMPT)
    evict(plain)
    assert run(plain, PROMPT, request_id="again")[1] == 0
    assert plain.core.stats().prefix_cache_evicted_misses_tokens == 56
    tiered = tiny_engine(model_dir, **POOL, kv_offloading_size="8MiB")
    run(tiered, PROMPT)
    evict(tiered)
    assert run(tiered, PROMPT, request_id="again")[2] == 56
    assert tiered.core.stats().prefix_cache_evicted_misses_tokens == 0


def test_an_int8_tier_holds_4x_the_blocks_and_restores_close_to_cold(model_dir, tmp_path):
    """--kv-offloading-dtype int8: about a quarter of a float32 block's bytes, restores dequantized, greedy output
    within vLLM's check_logprobs_close rule of a cold run (exactness is what the option gives up)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)

    def tops(out) -> list[dict]:
        return [dict.fromkeys(sorted(e, key=lambda t: e[t].rank)[:6]) for e in out.logprobs]

    plain = tiny_engine(model_dir, **POOL)
    cold = LLM(engine=plain).generate([PROMPT], params, use_tqdm=False)[0]
    exact = tiny_engine(model_dir, **POOL, kv_offloading_size="8MiB")
    packed = tiny_engine(model_dir, **POOL, kv_offloading_size="8MiB", kv_offloading_dtype="int8")
    full, small = exact.core.offload.layout.block_bytes, packed.core.offload.layout.block_bytes
    assert 3.5 < full / small < 4.0  # int8 values plus a float32 scale per head vector of head_dim values
    llm = LLM(engine=packed)
    llm.generate([PROMPT], params, use_tqdm=False)
    evict(packed)
    again = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert again.num_restored_tokens == 56
    c, a = cold.outputs[0], again.outputs[0]
    assert_logprobs_close(c.token_ids, tops(c), a.token_ids, tops(a), name="int8 tier")
    assert_pool_whole(packed)


def test_tier_kv_events_carry_their_medium(model_dir, tmp_path):
    """Blocks stored into and dropped from the tier are KV events marked with the tier's medium (vLLM's words), in
    kvserve's stream and in vLLM's wire batches, and the router's pool index ignores them."""
    from kvserve.cluster.router import PrefixIndex
    from kvserve.kv.events import BlockRemoved, BlockStored
    from kvserve.kv.vllm_events import event_batch

    engine = tiny_engine(model_dir, **POOL, kv_offloading_size="40KiB")  # about 60 blocks: the fillers evict some
    engine.core.kv_events.open_reader()
    run(engine, PROMPT)
    evict(engine)
    # (the last request's last windows were stored as it left: their events come with the next step, or here)
    events = [e for _, _, e in engine.core.kv_events.drain()] + engine.core.offload.take_events()
    tier_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    tier_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert len(tier_stored) == engine.core.offload.stored_blocks and tier_removed
    assert all(e.block_id == -1 for e in tier_stored + tier_removed)
    batch = event_batch(events, 0.0, "GPU", groups=[g.spec for g in engine.core.layout.groups])
    mediums = {(item["type"], item["medium"]) for item in batch[1] if item["type"] != "AllBlocksCleared"}
    assert mediums == {("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU")}
    index = PrefixIndex()
    for event in events:
        index.apply("r0", event)
    pool_hashes = {b.block_hash.hex() for b in engine.core.pool.cached[0].values()}
    assert set(index.holders) == pool_hashes  # exactly what the pool holds, not the tier

    disk = disk_engine(model_dir, tmp_path)
    disk.core.kv_events.open_reader()
    run(disk, PROMPT)
    events = [e for _, _, e in disk.core.kv_events.drain()] + flushed(disk).core.offload.take_events()
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert len(stored) == STORED
    disk.core.close()


_CHILD = """
import json, sys
from kvserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], kv_offloading_size="8MiB", kv_offloading_path=sys.argv[2], num_gpu_blocks_override=96,
          block_size=4, max_model_len=96)
out = llm.generate([json.loads(sys.argv[3])], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)[0]
# no close(): what the disk writer has queued is written at exit all the same
print(json.dumps({"tokens": list(out.outputs[0].token_ids), "restored": out.num_restored_tokens}))
"""


def test_a_second_process_restores_what_the_first_stored(model_dir, cold, tmp_path):
    import json
    import os
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def child() -> dict:
        cmd = [sys.executable, "-c", _CHILD, str(model_dir), str(tmp_path), json.dumps(PROMPT)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = child(), child()
    assert first == {"tokens": cold, "restored": 0}
    assert second == {"tokens": cold, "restored": 56}  # its first and only request


def test_the_inspector_shows_which_prefixes_the_tier_holds(model_dir, cold, tmp_path):
    """The KV inspector's snapshot lists the tier's prefixes: a prompt's full blocks as one prefix, whether the pool
    still holds them, its first tokens unless redacted; a restarted disk tier knows an earlier run's records once it
    has restored them; no tier, no section."""
    plain = tiny_engine(model_dir, **POOL)
    assert plain.kv_snapshot()["offload_tier"] is None
    engine = tiny_engine(model_dir, **POOL, kv_offloading_size="8MiB")
    run(engine, PROMPT)
    view = engine.kv_snapshot()["offload_tier"]
    # 60 + 8 tokens: 17 blocks, the last not full; the index holds group 0's (the full-attention group's) blocks
    assert view["medium"] == "CPU" and view["num_blocks"] == STORED and view["indexed_blocks"] == 16
    (prefix,) = view["prefixes"]
    assert prefix["blocks"] == 16 and prefix["tokens"] == 64 and prefix["in_pool"] == 16
    assert prefix["token_ids"] == PROMPT[:4]
    evict(engine)
    view = engine.kv_snapshot(include_tokens=False)["offload_tier"]
    ours = next(p for p in view["prefixes"] if p["blocks"] == 16)
    assert ours["in_pool"] == 0 and ours["token_ids"] is None
    assert len(view["prefixes"]) == 1 + len(FILLERS) + len(MORE_FILLERS)

    first = disk_engine(model_dir, tmp_path)
    run(first, PROMPT)
    flushed(first).core.close()
    second = disk_engine(model_dir, tmp_path)
    view = second.kv_snapshot()["offload_tier"]
    assert view["medium"] == "DISK" and view["num_blocks"] == STORED and view["indexed_blocks"] == 0
    assert run(second, PROMPT)[0] == cold
    view = second.kv_snapshot()["offload_tier"]
    assert view["indexed_blocks"] == 16 and [p["blocks"] for p in view["prefixes"]] == [16]  # 14 restored, 2 stored
    second.core.close()


def test_an_earlier_formats_records_are_never_read(model_dir, cold, tmp_path):
    """Records of the earlier format (version 1: a block of every layer, before KV cache groups) left in a tier
    directory are not read: each is refused (counted), removed and recomputed, never restored into a group."""
    import xxhash

    first = disk_engine(model_dir, tmp_path)
    run(first, PROMPT)
    flushed(first).core.close()
    for path in records(tmp_path):  # rewritten as version 1, checksum recomputed: only the version tells them apart
        data = bytearray(path.read_bytes())
        data[8:12] = (1).to_bytes(4, "little")
        data[-8:] = xxhash.xxh3_64_intdigest(bytes(data[:-8])).to_bytes(8, "little")
        path.write_bytes(bytes(data))
    second = disk_engine(model_dir, tmp_path)
    tokens, cached, restored = run(second, PROMPT)
    assert tokens == cold and (cached, restored) == (0, 0)
    assert second.core.stats().offload.restore_failures == 1  # the first record tried; the chain stops there
    assert_pool_whole(second)
    second.core.close()


def test_the_fingerprint_names_the_layout(model_dir, tmp_path):
    """Blocks of the hybrid layout (one group's layers) and of the uniform one (every layer) are different bytes: the
    two layouts never share a tier directory."""
    hybrid = disk_engine(model_dir, tmp_path)
    uniform = disk_engine(model_dir, tmp_path, disable_hybrid_kv_cache_manager=True)
    assert hybrid.core.offload.fingerprint.name != uniform.core.offload.fingerprint.name
    assert "sliding_window:8" in hybrid.core.offload.fingerprint.kv_cache_groups
    hybrid.core.close()
    uniform.core.close()


def _run_together(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
    """Run `requests` (id: prompt, params) concurrently to their ends, checking the pool after every step."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()


@pytest.mark.parametrize("shape", ["n=2 greedy siblings", "two identical concurrent prompts"])
def test_identical_blocks_in_one_step_are_stored_once(model_dir, shape):
    """#43 item 4: two greedy siblings (n=2), or two identical prompts admitted together, publish the same block hashes
    in the same step. Each block must be stored once: a second copy of a hash took a second host slot whose entry the
    first overwrote, that slot was lost for good (a 21-slot tier shrank to 1) and stored_blocks counted the block
    twice. A large tier: stored_blocks equals the blocks it holds; a 21-slot tier filled many times over: every slot
    is still in use."""
    siblings = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
    work = (
        {"pair": (PROMPT, siblings)}
        if shape.startswith("n=2")
        else {"a": (PROMPT, GREEDY), "b": (list(PROMPT), GREEDY)}
    )
    roomy = tiny_engine(model_dir, **POOL, kv_offloading_size="8MiB")
    _run_together(roomy, work)
    stats = roomy.core.offload.stats()
    assert stats.stored_blocks == stats.num_blocks == STORED  # each block once: the siblings' output is the same
    assert_pool_whole(roomy)

    block_bytes = roomy.core.offload.layout.block_bytes
    small = tiny_engine(model_dir, **POOL, kv_offloading_size=f"{21 * block_bytes}B")
    store = small.core.offload.store
    assert store.capacity_blocks == 21
    for i, ids in enumerate([PROMPT, *FILLERS]):
        renamed = {f"{name}{i}": (list(ids), params) for name, (_, params) in work.items()}
        _run_together(small, renamed)
        evict(small)
    assert store.usage().num_blocks == 21  # every slot holds a block: none was orphaned
    assert_pool_whole(small)
