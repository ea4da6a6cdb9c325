"""Where the tier's blocks live: a dict in host memory, or files in a private directory that processes share.

Both hold a block's payload (its K/V bytes, kv/offload/layout.py) under its chained hash, with the content key a
prefix hit compares, least recently used first out once `capacity_bytes` is reached. The disk store is also a small
storage engine: each record is written to a temporary name and renamed into place (a crash leaves nothing
half-visible, only a temporary file that the next scan removes), read back through every check of record.py, and
its directory's budget is enforced under a lock file by whichever process finds it exceeded."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.kv.hashing import BlockKey
from kvserve.kv.offload.fingerprint import KVFingerprint
from kvserve.kv.offload.record import (
    CHECKSUM_BYTES,
    RecordError,
    checksum_matches,
    decode_record,
    record_head,
    record_parts,
)

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
# A temporary file older than this belongs to a writer that died (a write takes milliseconds): the next scan removes it.
STALE_TMP_SECONDS = 600.0
# Eviction frees down to this share of the budget, so that the directory is scanned once per tenth of it written.
_EVICT_TO = 0.9


@dataclass(frozen=True, slots=True)
class StoreUsage:
    num_blocks: int
    bytes_used: int


class HostMemoryStore:
    """Blocks in one slab of host memory, [capacity // block_bytes, block_bytes] uint8, allocated once (its pages are
    touched as blocks first land in them), slots handed out least recently used first. A slab rather than a tensor a
    block: storing or restoring then allocates nothing, and a step's blocks are copied in one batched call per cache
    tensor. Engine thread only."""

    medium = "CPU"

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_bytes // block_bytes
        self.slab = torch.empty(self.capacity_blocks, block_bytes, dtype=torch.uint8)
        self._entries: OrderedDict[bytes, tuple[int, BlockKey]] = OrderedDict()  # hash -> (slot, key), LRU first
        self._free = list(range(self.capacity_blocks - 1, -1, -1))

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def locate(self, block_hash: bytes, key: BlockKey) -> int:
        """The slot holding this block (now the most recently used); KeyError when absent, RecordError when the slot
        holds another block under this hash (a collision)."""
        entry = self._entries.get(block_hash)
        if entry is None:
            raise KeyError(block_hash.hex())
        if entry[1] != key:
            raise RecordError("holds another block (content key differs)")
        self._entries.move_to_end(block_hash)
        return entry[0]

    def reserve(self, blocks: list[tuple[bytes, BlockKey]]) -> tuple[list[int], list[bytes]]:
        """Slots for new blocks (none of them held yet; at most capacity_blocks of them), evicting the least recently
        used: (their slots in order, the evicted hashes)."""
        if len(blocks) > self.capacity_blocks:
            raise ValueError(f"{len(blocks)} blocks exceed the tier's {self.capacity_blocks}")
        slots, evicted = [], []
        for block_hash, key in blocks:
            if self._free:
                slot = self._free.pop()
            else:
                old_hash, (slot, _) = self._entries.popitem(last=False)
                evicted.append(old_hash)
            self._entries[block_hash] = (slot, key)
            slots.append(slot)
        return slots, evicted

    def usage(self) -> StoreUsage:
        return StoreUsage(len(self._entries), len(self._entries) * self.block_bytes)


class DiskStore:
    """Records as files under DIR/<fingerprint>/blocks/<first two hex digits>/<hash>.kvb.

    Thread-safe: the engine thread checks for records, a loader thread reads them, a writer thread writes them; other
    processes may do all three in the same directory at once."""

    medium = "DISK"

    def __init__(self, root: Path, fingerprint: KVFingerprint, capacity_bytes: int) -> None:
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.top = root
        self.dir = root / fingerprint.name
        self.blocks_dir = self.dir / "blocks"
        _make_private_dir(root)
        _make_private_dir(self.dir)
        _make_private_dir(self.blocks_dir)
        self._describe_fingerprint()
        self._lock_path = self.dir / "lock"
        self._digest = fingerprint.digest  # computed once: every record carries it
        self._mutex = threading.Lock()  # guards the counters below between this process's threads
        self._bytes_estimate = 0
        self._num_blocks_estimate = 0
        self._tmp_serial = 0
        self.scan()

    # ---- layout ------------------------------------------------------------------------------------

    def path_for(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.blocks_dir / name[:2] / (name + RECORD_SUFFIX)

    def _describe_fingerprint(self) -> None:
        """fingerprint.json beside the blocks: what the subdirectory's KV was computed under, for a person."""
        path = self.dir / "fingerprint.json"
        if path.exists():
            return
        tmp = self.dir / f"{TMP_PREFIX}fingerprint-{os.getpid()}"
        tmp.write_text(json.dumps(self.fingerprint.describe(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)

    # ---- reads ---------------------------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        return self.path_for(block_hash).is_file()

    def read(self, block_hash: bytes, key: BlockKey) -> torch.Tensor:
        """The verified payload as a new uint8 tensor (for inspection and tests; restores use read_into); RecordError
        for a bad record (removed, so that it is recomputed and stored again), KeyError for a missing one. Touches the
        file: its mtime is its LRU age."""
        path = self.path_for(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise KeyError(block_hash.hex()) from None
        try:
            payload = decode_record(data, self._digest, block_hash, key)
        except RecordError:
            self._remove(path)
            raise
        _touch(path)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def read_into(self, block_hash: bytes, key: BlockKey, parts: Sequence[memoryview]) -> None:
        """Read the block's checked payload into `parts`: writable byte views whose concatenation is the payload (a row
        of the loader's staging buffer, or the block's own slices of the KV cache, so that a restore copies each byte
        once, from the file straight to where attention reads it). One vectored read; the record's head is compared
        whole with the head this block's record must have (magic, version, fingerprint, lengths, hash and content
        key at once) and the checksum is computed over the bytes where they landed. A bad record raises RecordError
        naming the check it failed (and is removed, as by read), a missing one KeyError; after either, `parts` hold
        garbage the caller must not use."""
        payload_len = sum(p.nbytes for p in parts)
        head = record_head(self._digest, block_hash, key, payload_len)
        expected = len(head) + payload_len + CHECKSUM_BYTES
        path = self.path_for(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(block_hash.hex()) from None
        try:
            size = os.fstat(fd).st_size
            good = False
            if size == expected:
                got_head, checksum = bytearray(len(head)), bytearray(CHECKSUM_BYTES)
                got = os.preadv(fd, [got_head, *parts, checksum], 0)
                good = got == expected and got_head == head and checksum_matches([got_head, *parts], checksum)
            if not good:
                try:
                    _refusal(os.pread(fd, size, 0), self._digest, block_hash, key, payload_len)
                except RecordError:
                    self._remove(path)
                    raise
        finally:
            os.close(fd)
        _touch(path)

    # ---- writes --------------------------------------------------------------------------------------

    def write(self, block_hash: bytes, key: BlockKey, payload: torch.Tensor) -> tuple[bool, list[bytes]]:
        """Store one record (renamed into place whole): whether it was written (False: already there), and the hashes
        evicted to keep the directory within its budget. OSError propagates."""
        path = self.path_for(block_hash)
        if path.exists():
            return False, []
        parts = record_parts(self._digest, block_hash, key, payload.numpy().data)
        size = sum(len(p) for p in parts)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        with self._mutex:
            self._tmp_serial += 1
            tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{self._tmp_serial}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                written = os.writev(fd, parts)
                if written != size:  # a short write (a full disk, a signal): finish it or fail
                    rest = b"".join(bytes(p) for p in parts)[written:]
                    while rest:
                        n = os.write(fd, rest)
                        rest = rest[n:]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            self._remove(tmp)
            raise
        with self._mutex:
            self._bytes_estimate += size
            self._num_blocks_estimate += 1
            over = self._bytes_estimate > self.capacity_bytes
        return True, self.scan() if over else []

    # ---- the budget ------------------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory's lock file, held exclusively: one process at a time scans and evicts."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def scan(self) -> list[bytes]:
        """Under the lock: count the records, remove dead writers' temporary files, and evict the least recently used
        records while the directory holds more than its budget. Returns the evicted hashes."""
        evicted: list[bytes] = []
        with self._locked():
            now = time.time()
            records = []
            for entry in _walk(self.blocks_dir):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        self._remove(Path(entry.path))
                elif entry.name.endswith(RECORD_SUFFIX):
                    records.append((st.st_mtime, st.st_size, entry.path, entry.name))
            total = sum(r[1] for r in records)
            if total > self.capacity_bytes:
                records.sort()
                target = self.capacity_bytes * _EVICT_TO
                while records and total > target:
                    _, size, path, name = records.pop(0)
                    self._remove(Path(path))
                    total -= size
                    try:
                        evicted.append(bytes.fromhex(name[: -len(RECORD_SUFFIX)]))
                    except ValueError:
                        pass
            with self._mutex:
                self._bytes_estimate, self._num_blocks_estimate = total, len(records)
        return evicted

    def usage(self) -> StoreUsage:
        with self._mutex:
            return StoreUsage(self._num_blocks_estimate, self._bytes_estimate)

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass


def _touch(path: Path) -> None:
    """A record was used: its mtime is its LRU age (a hint only: it may have been removed since, or the directory be
    read-only)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _refusal(data: bytes, fingerprint: bytes, block_hash: bytes, key: BlockKey, payload_len: int) -> None:
    """Raise the RecordError that says why `data`, a record that did not check out, must not be used: decode_record's
    reason, or that its payload does not fit a block, or (all checks passing on a second read) that it changed while
    it was read."""
    payload = decode_record(data, fingerprint, block_hash, key)
    if len(payload) != payload_len:
        raise RecordError(f"payload of {len(payload)} bytes, a block holds {payload_len}")
    raise RecordError("the record changed while it was read")


def _walk(blocks_dir: Path) -> Iterator[os.DirEntry[str]]:
    try:
        shards = list(os.scandir(blocks_dir))
    except FileNotFoundError:
        return
    for shard in shards:
        if shard.is_dir(follow_symlinks=False):
            try:
                yield from os.scandir(shard.path)
            except FileNotFoundError:
                continue


def _make_private_dir(path: Path) -> None:
    """Create `path` 0700 (it holds prompt-derived data); an existing one is used as it is, with a warning when other
    users can read or enter it. A symlink is refused: the tier's files go where the user named, nowhere else."""
    if path.is_symlink():
        raise OSError(f"{path} is a symbolic link; the KV offload tier needs a real directory")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning(
            "the KV offload directory %s is open to other users (mode %o): it holds data derived from prompts; "
            "chmod 700 it",
            path,
            mode,
        )
