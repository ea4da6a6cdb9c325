"""Chained block hashes: a full block's hash covers its tokens, every block before it, and extra keys."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """sha256 over (parent hash, token ids, extra keys such as a cache salt)."""
    digest = hashlib.sha256()
    digest.update(parent or b"\x00" * 32)
    digest.update(array("q", token_ids).tobytes())
    digest.update(len(extra_keys).to_bytes(4, "little"))
    digest.update(extra_keys)
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    known: list[bytes],
    extra_keys: bytes = b"",
    limit: int | None = None,
) -> list[bytes]:
    """Extend `known` (hashes of the first blocks) with the hashes of the following full blocks of
    `token_ids`, up to `limit` tokens; returns the same list."""
    end = len(token_ids) if limit is None else min(limit, len(token_ids))
    for start in range(len(known) * block_size, end - block_size + 1, block_size):
        known.append(hash_block(known[-1] if known else None, token_ids[start:start + block_size], extra_keys))
    return known
