"""The disk tier's directory as hostile input (#43, round three): what someone planted in it before a start, or
beside a running store, never makes kvserve write outside it, read what it must not, or lose the good records.
Runs without root and without a model: temporary directories, symlinks, FIFOs and sparse files, with the store alone
(DiskStore) or the tier over a small cache (tests/unit/test_kv_offload_store.py's helpers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_kv_offload_store import BLOCK_BYTES, FP, block

from kvserve.kv.offload.record import RecordError
from kvserve.kv.offload.stores import DiskStore


def sub(root: Path) -> Path:
    """The fingerprint's subdirectory of a tier at `root`, created 0700 as the store would."""
    path = root / FP.name
    path.mkdir(mode=0o700, parents=True)
    root.chmod(0o700)
    return path


def store_at(root: Path, **kwargs) -> DiskStore:
    return DiskStore(root, FP, capacity_bytes=1 << 30, payload_bytes=BLOCK_BYTES, **kwargs)


# ---- item 1: symbolic links are never followed ----------------------------------------------------------------


def test_a_planted_lock_link_creates_nothing_elsewhere(tmp_path):
    """The lock is opened with create-if-missing: through a link planted at its name, kvserve created the link's
    target. Now the link is refused (the tier is not used) and nothing exists where it pointed."""
    root, target = tmp_path / "tier", tmp_path / "elsewhere" / "created-by-kvserve"
    target.parent.mkdir()
    (sub(root) / "lock").symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        store_at(root)
    assert not target.exists()


def test_planted_temporary_fingerprint_links_overwrite_nothing(tmp_path):
    """fingerprint.json was written through `.tmp-fingerprint-<pid>`, a name anyone can predict: a link there made
    kvserve overwrite its target. Temporary files now have unpredictable names and are created exclusively."""
    root, victim = tmp_path / "tier", tmp_path / "victim"
    victim.write_text("precious")
    directory = sub(root)
    for pid in {os.getpid(), *range(os.getpid() - 2, os.getpid() + 3)}:
        (directory / f".tmp-fingerprint-{pid}").symlink_to(victim)
    store_at(root)
    assert victim.read_text() == "precious"
    described = directory / "fingerprint.json"
    assert not described.is_symlink() and '"block_size": 4' in described.read_text()


def test_a_planted_fingerprint_json_link_is_replaced_not_followed(tmp_path):
    root, victim = tmp_path / "tier", tmp_path / "victim"
    victim.write_text("precious")
    (sub(root) / "fingerprint.json").symlink_to(victim)
    store_at(root)
    assert victim.read_text() == "precious"
    assert not (root / FP.name / "fingerprint.json").is_symlink()


def test_shards_planted_as_links_send_no_record_elsewhere(tmp_path):
    """blocks/00 ... ff planted as links to another directory: every record went there, and the scan (which skipped
    links) counted none of it against the budget. Now no record is written through a link, and the store's count is
    what the directory holds."""
    root, elsewhere = tmp_path / "tier", tmp_path / "elsewhere"
    elsewhere.mkdir()
    blocks = sub(root) / "blocks"
    blocks.mkdir(mode=0o700)
    for i in range(256):
        (blocks / f"{i:02x}").symlink_to(elsewhere)
    store = store_at(root)
    for i in range(4):
        with pytest.raises(OSError, match="symbolic link"):
            store.write(*block(i))
    assert list(elsewhere.iterdir()) == []
    assert store.usage().num_blocks == 0 and not store.contains(block(0)[0])


@pytest.mark.parametrize("level", ["top", "fingerprint", "blocks"])
def test_a_linked_directory_at_any_level_is_refused(tmp_path, level):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    root = tmp_path / "tier"
    if level == "top":
        root.symlink_to(real)
    else:
        directory = sub(root)
        link = directory if level == "fingerprint" else directory / "blocks"
        if level == "fingerprint":
            directory.rmdir()
        link.symlink_to(real)
    with pytest.raises(OSError, match="symbolic link"):
        store_at(root)
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_planted_record_that_is_not_a_file_is_refused_and_removed(tmp_path, kind):
    """A link in a record's place is not followed (its target is neither read nor touched); a FIFO is not opened for
    a read that would never return. Either is refused like a bad record and removed; the target stays."""
    root = tmp_path / "tier"
    store = store_at(root)
    key, content, payload = block(3)
    store.write(key, content, payload)
    path = store.path_for(key)
    target = tmp_path / "target"
    target.write_bytes(path.read_bytes())  # a valid record: only where it lies is wrong
    before = target.stat()
    path.unlink()
    if kind == "link":
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    parts = [memoryview(bytearray(BLOCK_BYTES))]
    with pytest.raises(RecordError, match="symbolic link" if kind == "link" else "not a regular file"):
        store.read_into(key, content, parts)
    assert not os.path.lexists(path)
    assert target.stat().st_mtime_ns == before.st_mtime_ns and target.read_bytes()


# ---- item 2: a directory others can write is refused unless the user trusts them --------------------------------


@pytest.mark.parametrize(
    ("level", "mode"), [("top", 0o777), ("top", 0o770), ("fingerprint", 0o707), ("blocks", 0o777), ("top", 0o1777)]
)
def test_a_directory_others_can_write_is_refused(tmp_path, level, mode):
    """Whoever can write in the tier's directory can forge a record whose checksum matches (xxh3 detects damage, not
    forgery): it was used with a warning. Now a directory of the tier writable by its group or by everyone (sticky or
    not) is refused, naming the flag that allows it, and nothing is created in it."""
    root = tmp_path / "tier"
    directory = sub(root)
    (directory / "blocks").mkdir(mode=0o700)
    {"top": root, "fingerprint": directory, "blocks": directory / "blocks"}[level].chmod(mode)
    with pytest.raises(OSError, match="writable by other users.*--kv-offloading-allow-other-writers"):
        store_at(root)
    assert sorted(p.name for p in directory.iterdir()) == ["blocks"]


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    """A tier directory owned by another user (here: this process pretends to be another uid, so that the test needs
    no root to chown) is that user's to fill: refused unless trusted."""
    root = tmp_path / "tier"
    store_at(root).close()
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(root).st_uid + 1)
    with pytest.raises(OSError, match="owned by uid .*--kv-offloading-allow-other-writers"):
        store_at(root)


def test_the_flag_allows_other_writers_with_a_warning(tmp_path, monkeypatch, caplog):
    root = tmp_path / "tier"
    store_at(root).close()
    root.chmod(0o777)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(root).st_uid + 1)
    store = store_at(root, allow_other_writers=True)
    key, content, payload = block(1)
    store.write(key, content, payload)
    assert store.read(key, content).equal(payload)
    assert "other users can write" in caplog.text
    store.close()


def test_a_shard_or_record_others_can_write_is_not_used(tmp_path):
    """Below a private top: a shard directory others can write is skipped (its blocks are not stored), a record file
    others can write is refused like a bad one."""
    root = tmp_path / "tier"
    store = store_at(root)
    key, content, payload = block(2)
    store.write(key, content, payload)
    path = store.path_for(key)
    path.chmod(0o666)
    with pytest.raises(RecordError, match="writable by other users"):
        store.read(key, content)
    path.parent.chmod(0o777)
    with pytest.raises(OSError, match="writable by other users"):
        store.write(key, content, payload)
    store.close()


# ---- item 3: planted oversized records ----------------------------------------------------------------------------


def sparse(path: Path, size: int) -> None:
    """`path` grown (or created) to `size` bytes that take no disk space, its first bytes kept (skipped where the
    filesystem cannot hold such a file)."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        try:
            f.truncate(size)
        except OSError as e:
            pytest.skip(f"this filesystem holds no sparse file of {size} bytes ({e})")


@pytest.mark.parametrize("size", [2 << 30, 1 << 40])
def test_an_oversized_record_is_refused_by_its_size_without_being_read(tmp_path, monkeypatch, size):
    """A sparse file of 2 GiB in a record's place was read whole before being refused (RSS +2 GiB); one of 1 TiB
    raised MemoryError. Now its size refuses it before any read of more than a record's head, and it is removed."""
    store = store_at(tmp_path / "tier")
    key, content, payload = block(4)
    store.write(key, content, payload)
    path = store.path_for(key)
    sparse(path, size)
    asked: list[int] = []
    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        asked.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    with pytest.raises(RecordError, match="length"):
        store.read_into(key, content, [memoryview(bytearray(BLOCK_BYTES))])
    with pytest.raises(KeyError):
        store.read(key, content)  # removed
    store.write(key, content, payload)
    sparse(path, size)
    with pytest.raises(RecordError, match="length"):
        store.read(key, content)
    assert max(asked) <= 4096


def test_the_scan_counts_only_well_formed_records(tmp_path):
    """At the next start a planted 1 TiB file counted against the budget and every good record was evicted. Now the
    scan counts only records whose size a record of this store can have, removes the rest, and counts them refused."""
    root = tmp_path / "tier"
    store = store_at(root)
    for i in range(3):
        store.write(*block(i))
    store.close()
    planted, tiny = store.path_for(block(9)[0]), store.path_for(block(8)[0])
    planted.parent.mkdir(mode=0o700, exist_ok=True)
    sparse(planted, 1 << 40)
    tiny.parent.mkdir(mode=0o700, exist_ok=True)
    tiny.write_bytes(b"short")
    restarted = DiskStore(root, FP, capacity_bytes=16 * BLOCK_BYTES, payload_bytes=BLOCK_BYTES)
    assert restarted.usage().num_blocks == 3 and restarted.usage().bytes_used < 4 * BLOCK_BYTES
    assert restarted.refused_records == 2 and not planted.exists() and not tiny.exists()
    for i in range(3):
        key, content, payload = block(i)
        assert restarted.read(key, content).equal(payload)


# ---- item 7: one planted entry costs its own blocks, never the tier -----------------------------------------------


def test_a_planted_file_at_a_shards_name_costs_only_that_shards_blocks(tmp_path):
    """A file planted at a shard's name (blocks/ab) failed the write of a block of that shard, and the first write
    error turned stores off for good. Now that block is dropped and counted (io_errors), its path logged once, and
    the tier goes on storing every other block."""
    from test_kv_offload_store import _tier_on

    from kvserve.kv.block import TierBlock

    tier, caches, snapshot = _tier_on(tmp_path, queued_blocks=16)
    assert tier.store is not None
    blocks = [TierBlock(i, block(300 + i)[0][1], block(300 + i)[1]) for i in range(10)]
    victim = blocks[0].block_hash.hex()[:2]
    (tier.store.blocks_dir / victim).write_bytes(b"planted")
    tier.prepare_store(blocks)
    tier.flush()
    doomed = [b for b in blocks if b.block_hash.hex()[:2] == victim]
    assert tier.available and tier.io_errors == len(doomed) and tier.stored_blocks == len(blocks) - len(doomed)
    more = [TierBlock(i, block(400 + i)[0][1], block(400 + i)[1]) for i in range(3)]
    tier.prepare_store([b for b in more if b.block_hash.hex()[:2] != victim])
    tier.flush()
    assert tier.stored_blocks == len(blocks) - len(doomed) + len([b for b in more if b.block_hash.hex()[:2] != victim])
    tier.close()
