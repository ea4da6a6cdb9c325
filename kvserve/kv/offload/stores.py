"""Where the tier's blocks live: a dict in host memory, or files in a private directory that processes share.

Both hold a block's payload (its K/V bytes, kv/offload/layout.py) under its KV cache group and chained hash (a TierKey),
with the content key a prefix hit compares, least recently used first out once `capacity_bytes` is reached. Both are
BlockStores (kv/offload/interface.py): `contains` answers from memory, never from the file system. The disk store is
also a small storage engine: each record is written to a temporary name and renamed into place (a crash leaves nothing
half-visible, only a temporary file that the next scan removes), read back through every check of record.py, and its
directory's budget is enforced under a lock file by whichever process finds it exceeded."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.kv.hashing import BlockKey
from kvserve.kv.offload.fingerprint import KVFingerprint, family_of
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
from kvserve.kv.offload.safedir import ALLOW_OTHER_WRITERS_FLAG, CheckedDir, Trust, UnsafeEntry, others_can_write

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
# A temporary file older than this belongs to a writer that died (a write takes milliseconds): the next scan removes it.
STALE_TMP_SECONDS = 600.0
# Eviction frees down to this share of the budget, so that the directory is scanned once per tenth of it written.
_EVICT_TO = 0.9
_LOCK_FILE = "lock"
# Enough of a file's start to say why it is not a record (its header and more), when its size already says it is not.
_HEAD_READ = 4096
_FINGERPRINT_FILE = "fingerprint.json"


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
        self.top = root
        self.dir = root / fingerprint.name
        self.blocks_dir = self.dir / "blocks"
        trust = Trust(os.geteuid(), other_writers=allow_other_writers)
        with CheckedDir.open_top(root, trust, create=True) as top:
            _warn_if_open(top)
            self._dir = top.subdir([fingerprint.name], create=True)
        try:
            _warn_if_open(self._dir)
            self._blocks = self._dir.subdir(["blocks"], create=True)
        except BaseException:
            self._dir.close()
            raise
        _warn_if_open(self._blocks)
        self._closer = weakref.finalize(self, _close_dirs, self._dir, self._blocks)
        self._digest = fingerprint.digest  # computed once: every record carries it
        self._family = fingerprint.family  # subdirectories of this family are this process's own (its other stores)
        self._trust = trust
        # The budget: scans, and each write's room and rename, under one lock, so the directory's size is known
        # exactly between them (a scan that counted while a write landed lost that write's bytes).
        self._budget = threading.Lock()
        self._inflight = 0  # bytes of records being written, their room made (under _budget)
        self._foreign_bytes = 0  # other families' records, as the last scan found them (under _budget)
        self._mutex = threading.Lock()  # guards the counters below between this process's threads
        self._bytes_estimate = 0
        self._num_blocks_estimate = 0
        self._present: set[TierKey] = set()  # the records known to exist (see the class docstring)
        self._shard_mtimes: dict[str, float] = {}  # what refresh saw of each shard directory
        self._warned: set[str] = set()  # unsafe entries already logged (once each)
        # A directory this process may not write (a read-only mount, chmod a-w, another user's lock) is still read.
        self.read_only = not self._can_write()
        if not self.read_only:
            self._describe_fingerprint()
        self.scan()

    def _can_write(self) -> bool:
        """Whether this process may write the directory: its lock opens read-write (created if missing). One that
        refuses (EACCES, EPERM, EROFS) is used read-only: restores from what earlier runs stored; nothing is stored,
        evicted, removed or touched (a user who made it read-only meant it). An unsafe lock (a link, another user's)
        refuses the tier instead."""
        try:
            fd = self._dir.open([_LOCK_FILE], os.O_RDWR | os.O_CREAT)
        except UnsafeEntry:
            raise
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return False
            raise
        os.close(fd)
        return True

    def close(self) -> None:
        """Release the directories' descriptors (the tier's close, once its threads have stopped)."""
        self._closer()

    # ---- layout ------------------------------------------------------------------------------------

    def path_for(self, key: TierKey) -> Path:
        shard, name = _record_name(key)
        return self.blocks_dir / shard / name

    def _describe_fingerprint(self) -> None:
        """fingerprint.json beside the blocks: what the subdirectory's KV was computed under, for a person. Written
        by a new temporary file renamed over whatever is at the name (a link there is replaced, never followed)."""
        try:
            if stat.S_ISREG(self._dir.lstat(_FINGERPRINT_FILE).st_mode):
                return
        except FileNotFoundError:
            pass
        text = json.dumps(self.fingerprint.describe(), indent=2, sort_keys=True) + "\n"
        _write_new(self._dir, _FINGERPRINT_FILE, [text.encode()])

    # ---- reads ---------------------------------------------------------------------------------------

    def contains(self, key: TierKey) -> bool:
        return key in self._present

    def _open_record(self, key: TierKey) -> int:
        """A descriptor of the block's record; KeyError when it is missing, RecordError (the entry removed) when
        what is at its name is not a record this store may read (a link, a FIFO, another user's file)."""
        shard, name = _record_name(key)
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
                    raise size_refusal(os.pread(fd, _HEAD_READ, 0), size, self._digest, self.payload_bytes)
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
        shard, name = _record_name(key)
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
                tmp = _write_tmp(directory, parts)
                with self._budget:
                    try:
                        directory.rename(tmp, name)
                    except BaseException:
                        _unlink_quietly(directory, tmp)
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
            self._unlink(*_record_name(key))

    def _unlink(self, shard: str, name: str) -> None:
        """Remove an entry of a shard (best effort: it may be gone already, or the shard be unusable)."""
        try:
            with self._blocks.subdir([shard]) as directory:
                directory.unlink(name)
        except OSError:
            pass

    # ---- the budget ------------------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory's lock file, held exclusively: one process at a time scans and evicts. A read-only store
        takes none (it evicts and removes nothing, and its reads never depend on the lock)."""
        if self.read_only:
            yield
            return
        fd = self._dir.open([_LOCK_FILE], os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _shards(self) -> Iterator[tuple[str, CheckedDir]]:
        """Each shard directory of blocks/, open and checked (the caller closes it). An entry at a shard's name that
        is not a directory of this store's (a link, a file, another user's) is skipped, logged once."""
        try:
            names = sorted(n for n in os.listdir(self._blocks.fd) if _is_shard_name(n))
        except FileNotFoundError:
            return
        for name in names:
            try:
                directory = self._blocks.subdir([name])
            except UnsafeEntry as e:
                self._warn_once(e)
                continue
            except FileNotFoundError:
                continue
            yield name, directory

    def _warn_once(self, e: OSError) -> None:
        where = str(e.filename)
        if where not in self._warned:
            self._warned.add(where)
            logger.warning("KV offload tier: %s is %s: not used", where, e.strerror)

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
        with self._locked():
            now = time.time()
            records, refused = self._own_records(now, writable)
            foreign = self._foreign_records() if writable else []
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
                        self._unlink_foreign(r)
                        foreign_total -= r.size
                records = [r for r in records if id(r) not in gone]
            present = {key for key in (parse_record_name(r.name) for r in records) if key is not None}
            self._foreign_bytes = foreign_total
            with self._mutex:
                self._bytes_estimate, self._num_blocks_estimate = own_total, len(records)
                self._present = present
                self.refused_records += refused
        return evicted

    def _own_records(self, now: float, writable: bool) -> tuple[list[_Found], int]:
        """This store's well-formed records, and how many entries at records' names were refused (removed when
        writable), dead writers' temporary files removed on the way."""
        records: list[_Found] = []
        refused = 0
        for shard, directory in self._shards():
            with directory, os.scandir(directory.fd) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith(TMP_PREFIX):
                        if writable and now - st.st_mtime > STALE_TMP_SECONDS:
                            _unlink_quietly(directory, entry.name)
                    elif _key_in(shard, entry.name) is None:
                        continue
                    elif self._well_formed(st, directory.where([entry.name])):
                        records.append(_Found(st.st_mtime, st.st_size, shard, entry.name))
                    else:
                        refused += 1
                        if writable:
                            _unlink_quietly(directory, entry.name)
        return records, refused

    def _foreign_records(self) -> list[_Found]:
        """The records of the top directory's other families' subdirectories: regular files of this user's at
        records' names (whatever their size: another store's records are another size). A subdirectory whose
        fingerprint.json is missing or unreadable counts as another family's."""
        found: list[_Found] = []
        try:
            top = CheckedDir.open_top(self.top, self._trust, create=False)
        except OSError:
            return found
        with top:
            for name in sorted(os.listdir(top.fd)):
                if name == self.fingerprint.name or not _is_fingerprint_name(name):
                    continue
                try:
                    with top.subdir([name]) as sub:
                        if _family_in(sub) == self._family:
                            continue
                        with sub.subdir(["blocks"]) as blocks:
                            found += _records_in(blocks, name)
                except OSError:  # not a directory of this user's, or gone: not this store's to count
                    continue
        return found

    def _unlink_foreign(self, record: _Found) -> None:
        """Remove another family's record (best effort: its own process may have evicted it meanwhile)."""
        assert record.family_dir is not None
        try:
            with CheckedDir.open_top(self.top, self._trust, create=False) as top:
                with top.subdir([record.family_dir, "blocks", record.shard]) as directory:
                    directory.unlink(record.name)
        except OSError:
            pass

    def _well_formed(self, st: os.stat_result, where: str) -> bool:
        """Whether an entry at a record's name can be a record of this store, from its stat alone: a regular file of
        this user's that others cannot write, of a size a record of this payload has. Only such entries count
        against the budget (a planted terabyte file evicted every good record)."""
        try:
            self._blocks.trust.check(st, where, directory=False)
        except UnsafeEntry:
            return False
        return self._min_size <= st.st_size <= self._max_size

    def refresh(self) -> tuple[list[TierKey], list[TierKey]]:
        """Bring the index up to date with the directory: list the shards whose directory changed since the last look
        (records other processes wrote or evicted). Returns (keys found, keys gone). A thread's call, never the
        engine thread's."""
        found: list[TierKey] = []
        gone: list[TierKey] = []
        try:
            names = [n for n in os.listdir(self._blocks.fd) if _is_shard_name(n)]
        except FileNotFoundError:
            return found, gone
        for shard in names:
            try:
                mtime = os.stat(shard, dir_fd=self._blocks.fd, follow_symlinks=False).st_mtime
                if self._shard_mtimes.get(shard) == mtime:
                    continue
                with self._blocks.subdir([shard]) as directory, os.scandir(directory.fd) as entries:
                    listed = [e.name for e in entries if e.is_file(follow_symlinks=False)]
            except OSError:
                continue
            self._shard_mtimes[shard] = mtime
            keys = {key for key in (_key_in(shard, n) for n in listed) if key is not None}
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


@dataclass(frozen=True, slots=True)
class _Found:
    """A record a scan found: its mtime (LRU age), size, shard and file name, and for another family's record the
    subdirectory it is in (None: this store's own)."""

    mtime: float
    size: int
    shard: str
    name: str
    family_dir: str | None = None


def _is_fingerprint_name(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _family_in(directory: CheckedDir) -> str | None:
    """The family of a fingerprint subdirectory, from its fingerprint.json; None when it has none readable."""
    try:
        fd = directory.open([_FINGERPRINT_FILE])
    except OSError:
        return None
    try:
        description = json.loads(os.pread(fd, _HEAD_READ * 16, 0))
    except ValueError:
        return None
    finally:
        os.close(fd)
    return family_of(description) if isinstance(description, dict) else None


def _records_in(blocks: CheckedDir, family_dir: str) -> list[_Found]:
    found: list[_Found] = []
    for shard in sorted(n for n in os.listdir(blocks.fd) if _is_shard_name(n)):
        try:
            with blocks.subdir([shard]) as directory, os.scandir(directory.fd) as entries:
                for entry in entries:
                    if _key_in(shard, entry.name) is None:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                        blocks.trust.check(st, directory.where([entry.name]), directory=False)
                    except OSError:
                        continue
                    found.append(_Found(st.st_mtime, st.st_size, shard, entry.name, family_dir))
        except OSError:
            continue
    return found


def _close_dirs(*dirs: CheckedDir) -> None:
    for directory in dirs:
        directory.close()


def _write_new(directory: CheckedDir, name: str, parts: Sequence[bytes | memoryview]) -> int:
    """Write `parts` as the file `name` of `directory`, whole or not at all: into a new temporary file (_write_tmp),
    then renamed over `name` (atomic on POSIX: a reader sees the old entry or the whole new file). Returns the bytes
    written."""
    tmp = _write_tmp(directory, parts)
    try:
        directory.rename(tmp, name)
    except BaseException:
        _unlink_quietly(directory, tmp)
        raise
    return sum(len(p) for p in parts)


def _write_tmp(directory: CheckedDir, parts: Sequence[bytes | memoryview]) -> str:
    """Write `parts` into a new temporary file of `directory` (an unpredictable name, created exclusively, so that
    nothing planted at it is written through): its name, for the caller to rename into place. O_TMPFILE would leave
    no name at all, but linking it into place needs /proc or a privilege and cannot replace an entry atomically; a
    crash leaves this temporary name to the next scan instead."""
    size = sum(len(p) for p in parts)
    tmp = f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    try:
        fd = directory.open([tmp], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            written = os.writev(fd, parts)
            if written != size:  # a short write (a full disk, a signal): finish it or fail
                rest = b"".join(bytes(p) for p in parts)[written:]
                while rest:
                    n = os.write(fd, rest)
                    rest = rest[n:]
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quietly(directory, tmp)
        raise
    return tmp


def _unlink_quietly(directory: CheckedDir, name: str) -> None:
    try:
        directory.unlink(name)
    except OSError:
        pass


def _touch(fd: int) -> None:
    """A record was used: its mtime is its LRU age (a hint only: the directory may be read-only). A retained record's
    mtime lies in the future (DiskStore.retain): using it never shortens that."""
    try:
        if os.fstat(fd).st_mtime < time.time():
            os.utime(fd)
    except OSError:
        pass


def _record_name(key: TierKey) -> tuple[str, str]:
    """(shard, file name) of a block's record: blocks/<first two hex digits>/<hash hex>-<group>.kvb."""
    group_id, block_hash = key
    name = block_hash.hex()
    return name[:2], f"{name}-{group_id}{RECORD_SUFFIX}"


def _is_shard_name(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _key_in(shard: str, name: str) -> TierKey | None:
    """The key of a record named `name` in `shard`; None for any other name, or a record in the wrong shard (where
    no read would look for it)."""
    key = parse_record_name(name)
    return key if key is not None and key[1].hex()[:2] == shard else None


def parse_record_name(name: str) -> TierKey | None:
    """The key of a record's file name (<hash hex>-<group>.kvb); None for any other name."""
    if not name.endswith(RECORD_SUFFIX) or name.startswith(TMP_PREFIX):
        return None
    stem, _, group = name[: -len(RECORD_SUFFIX)].rpartition("-")
    try:
        return int(group), bytes.fromhex(stem)
    except ValueError:
        return None


def _refusal(data: bytes, fingerprint: bytes, key: TierKey, content: BlockKey, payload_len: int) -> None:
    """Raise the RecordError that says why `data`, a record that did not check out, must not be used: decode_record's
    reason, or that its payload does not fit a block, or (all checks passing on a second read) that it changed while
    it was read."""
    payload = decode_record(data, fingerprint, key[1], content, key[0])
    if len(payload) != payload_len:
        raise RecordError(f"payload of {len(payload)} bytes, a block holds {payload_len}")
    raise RecordError("the record changed while it was read")


def _warn_if_open(directory: CheckedDir) -> None:
    """A directory of the tier that other users can read or enter is used, with a warning: it holds data derived
    from prompts; chmod 700 it. One that others can write, or another user's, gets here only when the user allowed
    it (ALLOW_OTHER_WRITERS_FLAG): warned about too, since the tier then restores whatever they put there."""
    st = os.fstat(directory.fd)
    mode = stat.S_IMODE(st.st_mode)
    if others_can_write(st) or st.st_uid != directory.trust.uid:
        logger.warning(
            "the KV offload directory %s (mode %o, uid %d) is one other users can write: used because of %s; "
            "the tier restores whatever they put there",
            directory.path,
            mode,
            st.st_uid,
            ALLOW_OTHER_WRITERS_FLAG,
        )
    elif mode & 0o077:
        logger.warning(
            "the KV offload directory %s is open to other users (mode %o): it holds data derived from prompts; "
            "chmod 700 it",
            directory.path,
            mode,
        )
