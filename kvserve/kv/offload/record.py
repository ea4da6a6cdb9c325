"""One stored block as bytes on disk: a versioned header, the block's identity, its K/V payload and a checksum.

Why a record is self-describing: a file read back is untrusted input (another process wrote it, a crash may have cut it,
a disk may have flipped a bit, someone may have copied files between machines). It is used only when every check passes:
magic and format version, the fingerprint of the engine settings it was computed under, the exact length, the xxh3-64
checksum over everything before it, and the block's identity (its KV cache group, its chained hash and the content key a
prefix hit compares: parent hash, token ids, extra keys such as a cache salt). Anything else raises RecordError and the
block is recomputed. xxh3 runs at memory speed (tens of GB/s), so checking a 576 KiB block costs microseconds where
sha256 would cost a millisecond."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import xxhash

from kvserve.kv.hashing import BlockKey

MAGIC = b"KVSBLOCK"
# 2: records carry their KV cache group (kv/groups.py): a block is one group's layers, not every layer's.
FORMAT_VERSION = 2
# magic, version, fingerprint digest (16 bytes), payload length, KV cache group, hash length, parent length (0xFFFF:
# none), extra keys length, number of tokens.
_HEADER = struct.Struct("<8sI16sQIHHII")
_CHECKSUM = struct.Struct("<Q")
_NO_PARENT = 0xFFFF
# The most a record's identity (header, hash, parent hash, extra keys, token ids) may take. A store never writes a
# larger record (a block whose cache salt would pass it is not stored), so a file's size alone tells a planted or
# damaged file from a record of a known payload length, before anything of it is read (record_size_bounds).
MAX_IDENTITY_BYTES = 64 * 1024


class RecordError(ValueError):
    """A stored record that must not be used: its reason says which check failed."""


def encode_record(
    fingerprint: bytes, block_hash: bytes, key: BlockKey, payload: bytes | memoryview, group_id: int = 0
) -> bytes:
    """The record's bytes: header, identity, payload, then the checksum of all of them."""
    return b"".join(record_parts(fingerprint, block_hash, key, payload, group_id))


def record_parts(
    fingerprint: bytes, block_hash: bytes, key: BlockKey, payload: bytes | memoryview, group_id: int = 0
) -> tuple[bytes, bytes | memoryview, bytes]:
    """The record as (header and identity, payload, checksum), for a vectored write that copies the payload once.
    RecordError when its identity exceeds MAX_IDENTITY_BYTES (such a block is not stored)."""
    head = record_head(fingerprint, block_hash, key, len(payload), group_id)
    if len(head) > MAX_IDENTITY_BYTES:
        raise RecordError(f"an identity of {len(head)} bytes, more than a record holds ({MAX_IDENTITY_BYTES})")
    digest = xxhash.xxh3_64(head)
    digest.update(payload)
    return head, payload, _CHECKSUM.pack(digest.intdigest())


def record_head(fingerprint: bytes, block_hash: bytes, key: BlockKey, payload_len: int, group_id: int = 0) -> bytes:
    """The header and identity that open the record of this block under this fingerprint: the same bytes for every
    good record of it, so a reader that knows which block it wants can compare them whole (DiskStore.read_into)."""
    parent = key.parent
    tokens = array("q", key.token_ids).tobytes()
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        fingerprint,
        payload_len,
        group_id,
        len(block_hash),
        _NO_PARENT if parent is None else len(parent),
        len(key.extra_keys),
        len(key.token_ids),
    )
    return b"".join((header, block_hash, parent or b"", key.extra_keys, tokens))


CHECKSUM_BYTES = _CHECKSUM.size


def record_size_bounds(payload_len: int) -> tuple[int, int]:
    """The least and the most bytes a record of a `payload_len`-byte payload can take: any other size is not one."""
    return _HEADER.size + payload_len + _CHECKSUM.size, MAX_IDENTITY_BYTES + payload_len + _CHECKSUM.size


def _parse_header(view: memoryview, fingerprint: bytes) -> tuple[int, int, int, int, int, int, int]:
    """The checked header's (payload length, group, hash length, parent length, extra keys length, number of tokens,
    the record's whole length as the header says); RecordError for a header that is short or not of this format and
    fingerprint."""
    if len(view) < _HEADER.size:
        raise RecordError(f"truncated: {len(view)} bytes")
    magic, version, stored_fp, payload_len, group, hash_len, parent_len, extra_len, num_tokens = _HEADER.unpack_from(
        view
    )
    if magic != MAGIC:
        raise RecordError("not a kvserve block record (bad magic)")
    if version != FORMAT_VERSION:
        raise RecordError(f"format version {version}, this kvserve reads {FORMAT_VERSION}")
    if stored_fp != fingerprint:
        raise RecordError("computed under another fingerprint")
    parent_bytes = 0 if parent_len == _NO_PARENT else parent_len
    total = _HEADER.size + hash_len + parent_bytes + extra_len + 8 * num_tokens + payload_len + _CHECKSUM.size
    return payload_len, group, hash_len, parent_len, extra_len, num_tokens, total


def size_refusal(start: bytes | bytearray, size: int, fingerprint: bytes, payload_len: int) -> RecordError:
    """Why a file of `size` bytes beginning with `start` (its first bytes, at most a record's worth: the caller never
    reads a file of the wrong size whole) is not the record of a `payload_len`-byte block: its header's own reason,
    or that its length is not what its header says, or that its payload does not fit a block."""
    if size < _HEADER.size + _CHECKSUM.size:
        return RecordError(f"truncated: {size} bytes")
    try:
        stored_payload, *_, total = _parse_header(memoryview(start), fingerprint)
    except RecordError as e:
        return e
    if size != total:
        return RecordError(f"length {size}, its header says {total}")
    if stored_payload != payload_len:
        return RecordError(f"payload of {stored_payload} bytes, a block holds {payload_len}")
    return RecordError(f"length {size}, not a record of a {payload_len}-byte block")


def checksum_matches(parts: Sequence[bytes | bytearray | memoryview], stored: bytes | bytearray) -> bool:
    """Whether the xxh3-64 of `parts` in turn (the record's head and its payload, wherever they were read to) is the
    stored checksum."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    stored_value: int = _CHECKSUM.unpack(stored)[0]
    return digest.intdigest() == stored_value


def decode_record(
    data: bytes | bytearray | memoryview, fingerprint: bytes, block_hash: bytes, key: BlockKey, group_id: int = 0
) -> memoryview:
    """The payload of a record that passes every check for this block (of this group) under this fingerprint; else
    RecordError."""
    view = memoryview(data)
    if len(view) < _HEADER.size + _CHECKSUM.size:
        raise RecordError(f"truncated: {len(view)} bytes")
    payload_len, stored_group, hash_len, parent_len, extra_len, num_tokens, expected = _parse_header(view, fingerprint)
    parent_bytes = 0 if parent_len == _NO_PARENT else parent_len
    if len(view) != expected:
        raise RecordError(f"length {len(view)}, its header says {expected}")
    body = view[: -_CHECKSUM.size]
    (checksum,) = _CHECKSUM.unpack_from(view, len(body))
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise RecordError("checksum mismatch")
    at = _HEADER.size
    stored_hash = bytes(view[at : at + hash_len])
    at += hash_len
    parent = None if parent_len == _NO_PARENT else bytes(view[at : at + parent_len])
    at += parent_bytes
    extra = bytes(view[at : at + extra_len])
    at += extra_len
    tokens = tuple(array("q", view[at : at + 8 * num_tokens].tobytes()))
    at += 8 * num_tokens
    if stored_hash != block_hash or BlockKey(parent, tokens, extra) != key:
        raise RecordError("holds another block (hash or content key differs)")
    if stored_group != group_id:
        raise RecordError(f"holds KV cache group {stored_group}'s block, not group {group_id}'s")
    return view[at : at + payload_len]
