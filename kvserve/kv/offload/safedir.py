"""The tier's directory, opened without following links: every path below it is opened one component at a time,
relative to the descriptor of a directory that was checked, never through a symbolic link.

Why: the tier's directory outlives the process and holds files at predictable names (the lock, the shards
blocks/00 ... ff, records named by their hashes). A link planted at any of those names before a start sent kvserve's
writes elsewhere (the lock created its target, a shard link sent every record out of the directory and out of the
budget). Opening each component with O_NOFOLLOW relative to its parent's checked descriptor (openat, as
`openat2(RESOLVE_NO_SYMLINKS)` would, portably) closes that: a path is never resolved again by name after its
directories were checked, so a rename or a link planted during a run cannot redirect it either. Every entry is also
checked for its type and owner (a FIFO in a record's place would block a read forever), and is opened O_NONBLOCK so
that the check comes before any wait."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Files: no link followed, no FIFO or device waited on before its type is checked.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


# The flag that lets the tier use entries other users can write (kvserve/engine_args.py), named in refusals.
ALLOW_OTHER_WRITERS_FLAG = "--kv-offloading-allow-other-writers"
# Why an entry others can write is refused, said once in each refusal.
_FORGERY = (
    "whoever can write there can plant records that pass every check (the checksum detects damage, not forgery) and "
    "are restored into prompts' KV"
)


class UnsafeEntry(OSError):
    """An entry of the tier's directory that the tier did not make and will not use: a symbolic link, a file where a
    directory belongs (or the reverse, or a FIFO, a socket, a device), another user's, or one other users can
    write."""

    def __str__(self) -> str:
        return f"{self.filename} is {self.strerror}"


@dataclass(frozen=True, slots=True)
class Trust:
    """Whose entries the tier uses: those owned by `uid` (this process's effective user) and writable by it alone,
    or, with `other_writers` (the user's explicit ALLOW_OTHER_WRITERS_FLAG), also those of other owners or writable
    by others. A link or an entry of the wrong type is never used."""

    uid: int
    other_writers: bool = False

    def check(self, st: os.stat_result, where: str, directory: bool) -> None:
        """Raise UnsafeEntry unless `st` (an entry at `where`, opened without following a link) is a directory (or a
        regular file) that only this user can change."""
        if directory and not stat.S_ISDIR(st.st_mode):
            raise UnsafeEntry(errno.ENOTDIR, "not a directory", where)
        if not directory and not stat.S_ISREG(st.st_mode):
            raise UnsafeEntry(errno.EINVAL, "not a regular file", where)
        if self.other_writers:
            return
        if st.st_uid != self.uid:
            raise UnsafeEntry(
                errno.EPERM,
                f"owned by uid {st.st_uid}, not by this process's uid {self.uid}: {_FORGERY}; pass "
                f"{ALLOW_OTHER_WRITERS_FLAG} if that user is trusted",
                where,
            )
        if others_can_write(st):
            raise UnsafeEntry(
                errno.EPERM,
                f"writable by other users (mode {stat.S_IMODE(st.st_mode):o}): {_FORGERY}; chmod go-w it, or pass "
                f"{ALLOW_OTHER_WRITERS_FLAG} if every user who can write there is trusted",
                where,
            )


def others_can_write(st: os.stat_result) -> bool:
    """Whether users other than the owner may write the entry: its group or everyone has the write bit (a sticky
    directory included: others may still add entries to it)."""
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _refused(e: OSError, dir_fd: int, name: str, where: str) -> OSError:
    """The error to raise for a failed no-follow open: UnsafeEntry naming what is there when the entry is a link
    (O_NOFOLLOW: ELOOP) or of the wrong type (O_DIRECTORY: ENOTDIR), else `e` itself."""
    if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
        return e
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return e
    if stat.S_ISLNK(mode):
        return UnsafeEntry(errno.ELOOP, "a symbolic link, which the KV offload tier never follows", where)
    if e.errno == errno.ENOTDIR:
        return UnsafeEntry(errno.ENOTDIR, "not a directory", where)
    return UnsafeEntry(errno.EINVAL, "not a regular file", where)


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a single path component: {name!r}")


class CheckedDir:
    """An open directory of the tier whose type and owner were checked; everything below it is opened through it
    (`open`, `subdir`). Close it (or use it as a context manager): it holds a descriptor."""

    def __init__(self, fd: int, path: Path, trust: Trust) -> None:
        self.fd = fd
        self.path = path
        self.trust = trust

    @classmethod
    def open_top(cls, path: Path, trust: Trust, create: bool) -> CheckedDir:
        """The tier's own directory `path`, created 0700 if missing and `create`. Its parents are where the user chose
        to put it and are opened as given (a link among them is the user's); `path` itself must not be a link."""
        parent = path.parent
        if create:
            parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(parent, _DIR_FLAGS & ~os.O_NOFOLLOW)
        try:
            return cls(fd, parent, trust).subdir([path.name], create)
        finally:
            os.close(fd)

    def where(self, parts: Sequence[str]) -> str:
        return str(self.path.joinpath(*parts))

    def subdir(self, parts: Sequence[str], create: bool = False) -> CheckedDir:
        """The directory at `parts` below this one, each component created 0700 if missing and `create`, opened
        without following a link, and checked."""
        fd = self._walk(parts, create)
        return CheckedDir(fd, self.path.joinpath(*parts), self.trust)

    def open(self, parts: Sequence[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
        """A descriptor of the regular file at `parts` below this directory (its directories checked on the way, none
        created), opened with `flags` without following a link and checked; with O_CREAT | O_EXCL a new file, which
        fails on any entry already at that name, a link included."""
        *dirs, name = parts
        _check_name(name)
        parent = self._walk(dirs, False) if dirs else self.fd
        try:
            try:
                fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=parent)
            except OSError as e:
                raise _refused(e, parent, name, self.where(parts)) from None
            try:
                self.trust.check(os.fstat(fd), self.where(parts), directory=False)
            except BaseException:
                os.close(fd)
                raise
            return fd
        finally:
            if parent != self.fd:
                os.close(parent)

    def _walk(self, parts: Sequence[str], create: bool) -> int:
        """A new descriptor of the directory at `parts` (this one's duplicate for none), component by component."""
        fd = os.dup(self.fd)
        try:
            for i, name in enumerate(parts):
                _check_name(name)
                where = self.where(parts[: i + 1])
                child = self._open_dir(fd, name, where, create)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_dir(self, parent: int, name: str, where: str, create: bool) -> int:
        """Open (creating it 0700 if missing and `create`) and check one directory below `parent`."""
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                pass  # another process made it meanwhile: checked below like any other
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except OSError as e:
                raise _refused(e, parent, name, where) from None
        except OSError as e:
            raise _refused(e, parent, name, where) from None
        try:
            self.trust.check(os.fstat(fd), where, directory=True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def lstat(self, name: str) -> os.stat_result:
        """The entry `name` in this directory, not following a link."""
        _check_name(name)
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str) -> None:
        """Remove the entry `name` (a link itself, never its target)."""
        _check_name(name)
        os.unlink(name, dir_fd=self.fd)

    def rename(self, old: str, new: str) -> None:
        """Rename within this directory, atomically replacing whatever entry is at `new` (a link itself, never its
        target)."""
        _check_name(old)
        _check_name(new)
        os.replace(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> CheckedDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
