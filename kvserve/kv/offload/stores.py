"""Where the tier's blocks live: a dict in host memory, or files in a private directory that processes share.

Both hold a block's payload (its K/V bytes, kv/offload/layout.py) under its KV cache group and chained hash (a TierKey),
with the content key a prefix hit compares, least recently used first out once `capacity_bytes` is reached. Both are
BlockStores (kv/offload/interface.py): `contains` answers from memory, never from the file system. The disk store is
also a small storage engine: each record is written to a temporary name and renamed into place (a crash leaves nothing
half-visible, only a temporary file that the next scan removes), read back through every check of record.py, and its
directory's budget is enforced under a lock file by whichever process finds it exceeded."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve.kv.hashing import BlockKey
from kvserve.kv.offload.fingerprint import KVFingerprint
from kvserve.kv.offload.interface import StoreUsage, TierKey
from kvserve.kv.offload.record import (
    CHECKSUM_BYTES,
    RecordError,
    checksum_matches,
    decode_record,
    record_head,
    record_parts,
    record_size_bounds,
    size_refusal,
)
from kvserve.kv.offload.safedir import UnsafeEntry
from kvserve.kv.offload.store_dir import (
    HEAD_READ,
    StoreDirectory,
    parse_record_name,
    record_name,
    unlink_quietly,
    write_tmp,
)

logger = logging.getLogger(__name__)

# Eviction frees down to this share of the budget, so that the directory is scanned once per tenth of it written.
_EVICT_TO = 0.9


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
        self._entries: OrderedDict[TierKey, tuple[int, BlockKey]] = OrderedDict()  # -> (slot, key), LRU first
        self._free = list(range(self.capacity_blocks - 1, -1, -1))

    def contains(self, key: TierKey) -> bool:
        return key in self._entries

    def locate(self, key: TierKey, content: BlockKey) -> int:
        """The slot holding this block (now the most recently used); KeyError when absent, RecordError when the slot
        holds another block under this hash (a collision)."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(key[1].hex())
        if entry[1] != content:
            raise RecordError("holds another block (content key differs)")
        self._entries.move_to_end(key)
        return entry[0]

    def reserve(self, blocks: list[tuple[TierKey, BlockKey]]) -> tuple[list[int], list[TierKey]]:
        """Slots for new blocks (distinct, none of them held yet; at most capacity_blocks of them), evicting the least
        recently used: (their slots in order, the evicted keys). A key held already is refused: its slot would be
        orphaned."""
        if len(blocks) > self.capacity_blocks:
            raise ValueError(f"{len(blocks)} blocks exceed the tier's {self.capacity_blocks}")
        if len({key for key, _ in blocks}) != len(blocks) or any(key in self._entries for key, _ in blocks):
            raise ValueError("reserve takes distinct blocks the store does not hold")
        slots, evicted = [], []
        for key, content in blocks:
            if self._free:
                slot = self._free.pop()
            else:
                old, (slot, _) = self._entries.popitem(last=False)
                evicted.append(old)
            self._entries[key] = (slot, content)
            slots.append(slot)
        return slots, evicted

    def usage(self) -> StoreUsage:
        return StoreUsage(len(self._entries), len(self._entries) * self.block_bytes)


class DiskStore:
    """Records as files under DIR/<fingerprint>/blocks/<first two hex digits>/<hash>-<group>.kvb.

    Thread-safe: the engine thread checks for records, a loader thread reads them, a writer thread writes them; other
    processes may do all three in the same directory at once. Which records exist is answered from an index in
    memory (`contains`: the engine thread never touches the file system): built by the start-up scan, kept by this
    process's writes, evictions and refusals, and refreshed with other processes' records by `refresh` (the tier
    calls it from a thread of its own, every REFRESH_SECONDS).

    Every file is opened through the checked descriptors of its directories, one component at a time and never
    through a link (kv/offload/safedir.py): what is planted in the directory cannot send a write, a read or the lock
    elsewhere. Hold the store open only as long as it is used: `close` releases its directories' descriptors."""

    medium = "DISK"

    def __init__(
        self,
        root: Path,
        fingerprint: KVFingerprint,
        capacity_bytes: int,
        payload_bytes: int,
        allow_other_writers: bool = False,
    ) -> None:
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = payload_bytes  # a block's payload: what every record of this store holds
        # The sizes a record of this store can have: any other file at a record's name is not one, known unread.
        self._min_size, self._max_size = record_size_bounds(payload_bytes)
        self.refused_records = 0  # records the scans refused (malformed, planted), under _mutex
        self.dir = root / fingerprint.name
        self.blocks_dir = self.dir / "blocks"
        self._store_dir = StoreDirectory.open(root, fingerprint, (self._min_size, self._max_size), allow_other_writers)
        self._blocks = self._store_dir.blocks
        self._closer = weakref.finalize(self, self._store_dir.close)
        self._digest = fingerprint.digest  # computed once: every record carries it
        # The budget: scans, and each write's room and rename, under one lock, so the directory's size is known
        # exactly between them (a scan that counted while a write landed lost that write's bytes).
        self._budget = threading.Lock()
        self._inflight = 0  # bytes of records being written, their room made (under _budget)
        self._foreign_bytes = 0  # other families' records, as the last scan found them (under _budget)
        self._mutex = threading.Lock()  # guards the counters below between this process's threads
        self._bytes_estimate = 0
        self._num_blocks_estimate = 0
        self._present: set[TierKey] = set()  # the records known to exist (see the class docstring)
        # A directory this process may not write (a read-only mount, chmod a-w, another user's lock) is still read.
        self.read_only = not self._store_dir.can_write()
        if not self.read_only:
            self._store_dir.describe()
        self.scan()

    def close(self) -> None:
        """Release the directories' descriptors (the tier's close, once its threads have stopped)."""
        self._closer()

    # ---- layout ------------------------------------------------------------------------------------

    def path_for(self, key: TierKey) -> Path:
        shard, name = record_name(key)
        return self.blocks_dir / shard / name

    # ---- reads ---------------------------------------------------------------------------------------

    def contains(self, key: TierKey) -> bool:
        return key in self._present

    def _open_record(self, key: TierKey) -> int:
        """A descriptor of the block's record; KeyError when it is missing, RecordError (the entry removed) when
        what is at its name is not a record this store may read (a link, a FIFO, another user's file)."""
        shard, name = record_name(key)
        try:
            return self._blocks.open([shard, name])
        except FileNotFoundError:
            self._forget(key)
            raise KeyError(key[1].hex()) from None
        except UnsafeEntry as e:
            self._remove_record(key)
            raise RecordError(str(e)) from None

    def read(self, key: TierKey, content: BlockKey) -> torch.Tensor:
        """The verified payload as a new uint8 tensor (for inspection and tests; restores use read_into); RecordError
        for a bad record (removed, so that it is recomputed and stored again), KeyError for a missing one. A file of a
        size no record of this store has is refused by its size, read no further than its head. Touches the file:
        its mtime is its LRU age."""
        fd = self._open_record(key)
        try:
            size = os.fstat(fd).st_size
            try:
                if not self._min_size <= size <= self._max_size:
                    raise size_refusal(os.pread(fd, HEAD_READ, 0), size, self._digest, self.payload_bytes)
                payload = decode_record(os.pread(fd, size, 0), self._digest, key[1], content, key[0])
            except RecordError:
                self._remove_record(key)
                raise
            if not self.read_only:
                _touch(fd)
        finally:
            os.close(fd)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def read_into(self, key: TierKey, content: BlockKey, parts: Sequence[memoryview]) -> None:
        """Read the block's checked payload into `parts`: writable byte views whose concatenation is the payload (a row
        of the loader's staging buffer, or the block's own slices of the KV cache, so that a restore copies each byte
        once, from the file straight to where attention reads it). One vectored read; the record's head is compared
        whole with the head this block's record must have (magic, version, fingerprint, lengths, hash and content
        key at once) and the checksum is computed over the bytes where they landed. A file of a size no record of
        such a block can have is refused by it, read no further than its head (a planted file of a terabyte costs a
        stat, not a read); any other bad one is read whole, once, for the reason it is refused. A bad record
        raises RecordError naming the check it failed (and is removed, as by read), a missing one KeyError; after
        either, `parts` hold garbage the caller must not use."""
        group_id, block_hash = key
        payload_len = sum(p.nbytes for p in parts)
        head = record_head(self._digest, block_hash, content, payload_len, group_id)
        expected = len(head) + payload_len + CHECKSUM_BYTES
        fd = self._open_record(key)
        try:
            size = os.fstat(fd).st_size
            good = False
            if size == expected:
                got_head, checksum = bytearray(len(head)), bytearray(CHECKSUM_BYTES)
                got = os.preadv(fd, [got_head, *parts, checksum], 0)
                good = got == expected and got_head == head and checksum_matches([got_head, *parts], checksum)
            if not good:
                self._remove_record(key)
                least, most = record_size_bounds(payload_len)
                if not least <= size <= most:
                    raise size_refusal(os.pread(fd, len(head), 0), size, self._digest, payload_len)
                _refusal(os.pread(fd, size, 0), self._digest, key, content, payload_len)
            if not self.read_only:
                _touch(fd)
        finally:
            os.close(fd)

    # ---- writes --------------------------------------------------------------------------------------

    def write(self, key: TierKey, content: BlockKey, payload: torch.Tensor) -> tuple[bool, list[TierKey]]:
        """Store one record (renamed into place whole): whether it was written (False: already there), and the keys
        evicted to keep the directory within its budget. OSError propagates (UnsafeEntry: the block's shard is not
        a directory this store made; EROFS: a read-only store)."""
        if self.read_only:
            raise OSError(errno.EROFS, "the KV offload directory is read-only for this process", str(self.dir))
        shard, name = record_name(key)
        with self._blocks.subdir([shard], create=True) as directory:
            try:
                there = stat.S_ISREG(directory.lstat(name).st_mode)
            except FileNotFoundError:
                there = False
            if there:
                with self._mutex:
                    self._present.add(key)
                return False, []
            parts = record_parts(self._digest, key[1], content, payload.numpy().data, key[0])
            size = sum(len(p) for p in parts)
            evicted = self._make_room(size)  # before the write: the directory never holds more than its budget
            try:
                tmp = write_tmp(directory, parts)
                with self._budget:
                    try:
                        directory.rename(tmp, name)
                    except BaseException:
                        unlink_quietly(directory, tmp)
                        raise
                    with self._mutex:
                        self._bytes_estimate += size
                        self._num_blocks_estimate += 1
                        self._present.add(key)
            finally:
                with self._budget:
                    self._inflight -= size
        return True, evicted

    def _make_room(self, size: int) -> list[TierKey]:
        """Reserve `size` bytes for a record about to be written, evicting first (scan) if the directory, with the
        records being written, would pass its budget: returns the evicted keys."""
        with self._budget:
            with self._mutex:
                known = self._bytes_estimate
            evicted = []
            if known + self._foreign_bytes + self._inflight + size > self.capacity_bytes:
                evicted = self._scan_locked(room=size)
            self._inflight += size
            return evicted

    def retain(self, key: TierKey, until: float) -> bool:
        """Keep the block's record until `until` (time.time()): its mtime is set there, so eviction, which goes by
        mtime, passes it over while it lies in the future (scan), in this process and in any other sharing the
        directory, and after a restart. False when the record is not there (not written yet, or evicted)."""
        try:
            fd = self._open_record(key)
        except (KeyError, RecordError):
            return False
        try:
            if os.fstat(fd).st_mtime < until:
                os.utime(fd, (until, until))
            return True
        finally:
            os.close(fd)

    def _forget(self, key: TierKey) -> None:
        with self._mutex:
            self._present.discard(key)

    def _remove_record(self, key: TierKey) -> None:
        """A record that failed a check: gone from the directory and the index, so that it is recomputed."""
        self._forget(key)
        if not self.read_only:
            self._unlink(*record_name(key))

    def _unlink(self, shard: str, name: str) -> None:
        """Remove an entry of a shard (best effort: it may be gone already, or the shard be unusable)."""
        try:
            with self._blocks.subdir([shard]) as directory:
                directory.unlink(name)
        except OSError:
            pass

    # ---- the budget ------------------------------------------------------------------------------------

    def scan(self) -> list[TierKey]:
        """Under the lock: count the records, remove dead writers' temporary files, and evict the least recently used
        records while the directory holds more than its budget; the index is what remains. Returns the evicted keys.
        A read-only store only counts."""
        with self._budget:
            return self._scan_locked(room=0)

    def _scan_locked(self, room: int) -> list[TierKey]:
        """scan, under _budget; `room`: bytes a write about to start needs besides those being written. The budget is
        the whole directory's: another family's records (another model's, flags' or kvserve version's subdirectory:
        each upgrade left a budget of dead ones) count against it and are evicted with this store's, least recently
        used first (the dead ones are, being never used again); this process's other stores (its family) have their
        own share and are left alone. Evicted down to 90% of the budget, so that a scan comes once per tenth of it."""
        evicted: list[TierKey] = []
        writable = not self.read_only
        with self._store_dir.locked(self.read_only):
            now = time.time()
            records, refused = self._store_dir.own_records(now, writable)
            foreign = self._store_dir.foreign_records() if writable else []
            if refused:
                logger.warning(
                    "KV offload tier: %d entries at records' names in %s are no records of it (wrong size or type, "
                    "another user's): %s, not counted against the budget",
                    refused,
                    self.blocks_dir,
                    "removed" if writable else "left (read-only)",
                )
            own_total = sum(r.size for r in records)
            foreign_total = sum(r.size for r in foreign)
            if writable and own_total + foreign_total + self._inflight + room > self.capacity_bytes:
                # Least recently used first; retained records (mtime in the future, retain) after every other, the
                # soonest to expire first: they go only when nothing else is left to evict.
                candidates = sorted([*records, *foreign], key=lambda r: (r.mtime > now, r.mtime))
                target = self.capacity_bytes * _EVICT_TO
                gone: set[int] = set()
                for r in candidates:
                    if own_total + foreign_total + self._inflight + room <= target:
                        break
                    gone.add(id(r))
                    if r.family_dir is None:
                        self._unlink(r.shard, r.name)
                        own_total -= r.size
                        key = parse_record_name(r.name)
                        if key is not None:
                            evicted.append(key)
                    else:
                        self._store_dir.unlink_foreign(r)
                        foreign_total -= r.size
                records = [r for r in records if id(r) not in gone]
            present = {key for key in (parse_record_name(r.name) for r in records) if key is not None}
            self._foreign_bytes = foreign_total
            with self._mutex:
                self._bytes_estimate, self._num_blocks_estimate = own_total, len(records)
                self._present = present
                self.refused_records += refused
        return evicted

    def refresh(self) -> tuple[list[TierKey], list[TierKey]]:
        """Bring the index up to date with the directory: the shards whose directory changed since the last look
        (records other processes wrote or evicted). Returns (keys found, keys gone). A thread's call, never the
        engine thread's."""
        found: list[TierKey] = []
        gone: list[TierKey] = []
        for shard, keys in self._store_dir.changed_shards().items():
            with self._mutex:
                known = {key for key in self._present if key[1].hex()[:2] == shard}
                found += keys - known
                gone += known - keys
                self._present |= keys
                self._present -= known - keys
        return found, gone

    def usage(self) -> StoreUsage:
        with self._mutex:
            return StoreUsage(self._num_blocks_estimate, self._bytes_estimate)


def _touch(fd: int) -> None:
    """A record was used: its mtime is its LRU age (a hint only: the directory may be read-only). A retained record's
    mtime lies in the future (DiskStore.retain): using it never shortens that."""
    try:
        if os.fstat(fd).st_mtime < time.time():
            os.utime(fd)
    except OSError:
        pass


def _refusal(data: bytes, fingerprint: bytes, key: TierKey, content: BlockKey, payload_len: int) -> None:
    """Raise the RecordError that says why `data`, a record that did not check out, must not be used: decode_record's
    reason, or that its payload does not fit a block, or (all checks passing on a second read) that it changed while
    it was read."""
    payload = decode_record(data, fingerprint, key[1], content, key[0])
    if len(payload) != payload_len:
        raise RecordError(f"payload of {len(payload)} bytes, a block holds {payload_len}")
    raise RecordError("the record changed while it was read")
