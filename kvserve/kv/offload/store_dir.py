"""A disk store's directory: opened safely, its lock, its description, and its census (which records it holds).

The layout (kv/offload/stores.py DiskStore): DIR/<fingerprint>/blocks/<first two hex digits>/<hash hex>-<group>.kvb,
one fingerprint subdirectory per model, flags and kvserve version, its fingerprint.json beside the blocks, and a lock
file. Every entry is opened through the checked descriptors of its directories, one component at a time and never
through a link (kv/offload/safedir.py). A scan's census counts the store's own records (entries at records' names
that are not well-formed records are refused, and removed when it may write), removes dead writers' temporary files,
and lists the records of other families' subdirectories, which count against the same budget (each upgrade left a
whole budget of dead ones). Split from DiskStore, which keeps the index, the budget and the records' I/O: this module
opens, lists, describes and removes entries.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.kv.offload.fingerprint import KVFingerprint, family_of
from kvserve.kv.offload.interface import TierKey
from kvserve.kv.offload.safedir import ALLOW_OTHER_WRITERS_FLAG, CheckedDir, Trust, UnsafeEntry, others_can_write

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
# A temporary file older than this belongs to a writer that died (a write takes milliseconds): the next scan removes it.
STALE_TMP_SECONDS = 600.0
# Enough of a file's start to say why it is not a record (its header and more), when its size already says it is not.
HEAD_READ = 4096
FINGERPRINT_FILE = "fingerprint.json"
_LOCK_FILE = "lock"


@dataclass(slots=True)
class StoreDirectory:
    """One store's directory, open: `dir` (DIR/<fingerprint>) and `blocks` (its blocks/), checked, under `top` (the
    tier's directory, opened with `trust`); its family `family` (subdirectories of that family are this process's
    other stores: not counted); a record's size within `size_bounds`. `close` releases the descriptors."""

    top: Path
    trust: Trust
    dir: CheckedDir
    blocks: CheckedDir
    fingerprint: KVFingerprint
    size_bounds: tuple[int, int]
    warned: set[str] = field(default_factory=set)  # unsafe entries already logged (once each)
    shard_mtimes: dict[str, float] = field(default_factory=dict)  # what changed_shards saw of each shard

    @classmethod
    def open(
        cls, root: Path, fingerprint: KVFingerprint, size_bounds: tuple[int, int], allow_other_writers: bool
    ) -> StoreDirectory:
        """Open (creating what is missing) DIR/<fingerprint>/blocks; a directory others can read is warned about."""
        trust = Trust(os.geteuid(), other_writers=allow_other_writers)
        with CheckedDir.open_top(root, trust, create=True) as top:
            _warn_if_open(top)
            directory = top.subdir([fingerprint.name], create=True)
        try:
            _warn_if_open(directory)
            blocks = directory.subdir(["blocks"], create=True)
        except BaseException:
            directory.close()
            raise
        _warn_if_open(blocks)
        return cls(root, trust, directory, blocks, fingerprint, size_bounds)

    def close(self) -> None:
        self.blocks.close()
        self.dir.close()

    @property
    def min_size(self) -> int:
        return self.size_bounds[0]

    @property
    def max_size(self) -> int:
        return self.size_bounds[1]

    def can_write(self) -> bool:
        """Whether this process may write the directory: its lock opens read-write (created if missing). One that
        refuses (EACCES, EPERM, EROFS) is used read-only: restores from what earlier runs stored; nothing is stored,
        evicted, removed or touched (a user who made it read-only meant it). An unsafe lock (a link, another user's)
        refuses the tier instead."""
        try:
            fd = self.dir.open([_LOCK_FILE], os.O_RDWR | os.O_CREAT)
        except UnsafeEntry:
            raise
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return False
            raise
        os.close(fd)
        return True

    def describe(self) -> None:
        """fingerprint.json beside the blocks: what the subdirectory's KV was computed under, for a person. Written
        by a new temporary file renamed over whatever is at the name (a link there is replaced, never followed)."""
        try:
            if stat.S_ISREG(self.dir.lstat(FINGERPRINT_FILE).st_mode):
                return
        except FileNotFoundError:
            pass
        text = json.dumps(self.fingerprint.describe(), indent=2, sort_keys=True) + "\n"
        write_new(self.dir, FINGERPRINT_FILE, [text.encode()])

    @contextmanager
    def locked(self, read_only: bool) -> Iterator[None]:
        """The directory's lock file, held exclusively: one process at a time scans and evicts. A read-only store
        takes none (it evicts and removes nothing, and its reads never depend on the lock)."""
        if read_only:
            yield
            return
        fd = self.dir.open([_LOCK_FILE], os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def changed_shards(self) -> dict[str, set[TierKey]]:
        """The records of each shard whose directory changed since the last look (other processes' writes and
        evictions), for the store's refresh; a shard that cannot be listed is left for the next look."""
        changed: dict[str, set[TierKey]] = {}
        try:
            names = [n for n in os.listdir(self.blocks.fd) if is_shard_name(n)]
        except FileNotFoundError:
            return changed
        for shard in names:
            try:
                mtime = os.stat(shard, dir_fd=self.blocks.fd, follow_symlinks=False).st_mtime
                if self.shard_mtimes.get(shard) == mtime:
                    continue
                with self.blocks.subdir([shard]) as directory, os.scandir(directory.fd) as entries:
                    listed = [e.name for e in entries if e.is_file(follow_symlinks=False)]
            except OSError:
                continue
            self.shard_mtimes[shard] = mtime
            changed[shard] = {key for key in (key_in(shard, n) for n in listed) if key is not None}
        return changed

    def shards(self) -> Iterator[tuple[str, CheckedDir]]:
        """Each shard directory of blocks/, open and checked (the caller closes it). An entry at a shard's name that
        is not a directory of the store's (a link, a file, another user's) is skipped, logged once."""
        try:
            names = sorted(n for n in os.listdir(self.blocks.fd) if is_shard_name(n))
        except FileNotFoundError:
            return
        for name in names:
            try:
                directory = self.blocks.subdir([name])
            except UnsafeEntry as e:
                self._warn_once(e)
                continue
            except FileNotFoundError:
                continue
            yield name, directory

    def _warn_once(self, e: OSError) -> None:
        where = str(e.filename)
        if where not in self.warned:
            self.warned.add(where)
            logger.warning("KV offload tier: %s is %s: not used", where, e.strerror)

    def own_records(self, now: float, writable: bool) -> tuple[list[FoundRecord], int]:
        """The store's well-formed records, and how many entries at records' names were refused (removed when
        writable), dead writers' temporary files removed on the way."""
        records: list[FoundRecord] = []
        refused = 0
        for shard, directory in self.shards():
            with directory, os.scandir(directory.fd) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith(TMP_PREFIX):
                        if writable and now - st.st_mtime > STALE_TMP_SECONDS:
                            unlink_quietly(directory, entry.name)
                    elif key_in(shard, entry.name) is None:
                        continue
                    elif self.well_formed(st, directory.where([entry.name])):
                        records.append(FoundRecord(st.st_mtime, st.st_size, shard, entry.name))
                    else:
                        refused += 1
                        if writable:
                            unlink_quietly(directory, entry.name)
        return records, refused

    def foreign_records(self) -> list[FoundRecord]:
        """The records of the top directory's other families' subdirectories: regular files of this user's at
        records' names (whatever their size: another store's records are another size). A subdirectory whose
        fingerprint.json is missing or unreadable counts as another family's."""
        found: list[FoundRecord] = []
        try:
            top = CheckedDir.open_top(self.top, self.trust, create=False)
        except OSError:
            return found
        with top:
            for name in sorted(os.listdir(top.fd)):
                if name == self.fingerprint.name or not _is_fingerprint_name(name):
                    continue
                try:
                    with top.subdir([name]) as sub:
                        if _family_in(sub) == self.fingerprint.family:
                            continue
                        with sub.subdir(["blocks"]) as blocks:
                            found += _records_in(blocks, name)
                except OSError:  # not a directory of this user's, or gone: not this store's to count
                    continue
        return found

    def unlink_foreign(self, record: FoundRecord) -> None:
        """Remove another family's record (best effort: its own process may have evicted it meanwhile)."""
        assert record.family_dir is not None
        try:
            with CheckedDir.open_top(self.top, self.trust, create=False) as top:
                with top.subdir([record.family_dir, "blocks", record.shard]) as directory:
                    directory.unlink(record.name)
        except OSError:
            pass

    def well_formed(self, st: os.stat_result, where: str) -> bool:
        """Whether an entry at a record's name can be a record of this store, from its stat alone: a regular file of
        this user's that others cannot write, of a size a record of this payload has. Only such entries count
        against the budget (a planted terabyte file evicted every good record)."""
        try:
            self.blocks.trust.check(st, where, directory=False)
        except UnsafeEntry:
            return False
        return self.min_size <= st.st_size <= self.max_size


@dataclass(frozen=True, slots=True)
class FoundRecord:
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
        fd = directory.open([FINGERPRINT_FILE])
    except OSError:
        return None
    try:
        description = json.loads(os.pread(fd, HEAD_READ * 16, 0))
    except ValueError:
        return None
    finally:
        os.close(fd)
    return family_of(description) if isinstance(description, dict) else None


def _records_in(blocks: CheckedDir, family_dir: str) -> list[FoundRecord]:
    found: list[FoundRecord] = []
    for shard in sorted(n for n in os.listdir(blocks.fd) if is_shard_name(n)):
        try:
            with blocks.subdir([shard]) as directory, os.scandir(directory.fd) as entries:
                for entry in entries:
                    if key_in(shard, entry.name) is None:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                        blocks.trust.check(st, directory.where([entry.name]), directory=False)
                    except OSError:
                        continue
                    found.append(FoundRecord(st.st_mtime, st.st_size, shard, entry.name, family_dir))
        except OSError:
            continue
    return found


def unlink_quietly(directory: CheckedDir, name: str) -> None:
    try:
        directory.unlink(name)
    except OSError:
        pass


def record_name(key: TierKey) -> tuple[str, str]:
    """(shard, file name) of a block's record: blocks/<first two hex digits>/<hash hex>-<group>.kvb."""
    group_id, block_hash = key
    name = block_hash.hex()
    return name[:2], f"{name}-{group_id}{RECORD_SUFFIX}"


def is_shard_name(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def key_in(shard: str, name: str) -> TierKey | None:
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


def write_new(directory: CheckedDir, name: str, parts: Sequence[bytes | memoryview]) -> int:
    """Write `parts` as the file `name` of `directory`, whole or not at all: into a new temporary file (write_tmp),
    then renamed over `name` (atomic on POSIX: a reader sees the old entry or the whole new file). Returns the bytes
    written."""
    tmp = write_tmp(directory, parts)
    try:
        directory.rename(tmp, name)
    except BaseException:
        unlink_quietly(directory, tmp)
        raise
    return sum(len(p) for p in parts)


def write_tmp(directory: CheckedDir, parts: Sequence[bytes | memoryview]) -> str:
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
        unlink_quietly(directory, tmp)
        raise
    return tmp


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
