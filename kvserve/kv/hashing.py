"""Chained block hashes: a full block's hash covers its tokens, every block before it, and extra keys
(such as a tenant's cache salt), so equal hashes mean equal prefixes.

sha256 is the default (collision-resistant: safe when tenants share a server); xxhash (xxh3-128) is faster.
Either way a prefix hit also compares the block's stored content key, so even a collision cannot hand one
request another's KV."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.vocab import HASH_ALGOS

# tokens(start, end) -> the token ids [start, end) of a sequence, without copying the rest of it.
TokenSlice = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What a cached block holds: its parent's hash, its token ids and the extra keys. Compared on a hit."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: bytes


# The longest `cache_salt` a request may carry, in characters (as OpenAI bounds `prompt_cache_key`): a salt is a
# tenant's name or secret, and one of megabytes only costs memory and hashing time.
MAX_CACHE_SALT_CHARS = 1024
_SALT_DOMAIN = b"kvserve cache_salt\x00"


def check_cache_salt_length(cache_salt: str) -> None:
    """ValueError for a salt longer than MAX_CACHE_SALT_CHARS, saying both lengths."""
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt is {len(cache_salt):,} characters; at most {MAX_CACHE_SALT_CHARS:,} are accepted (a salt "
            "names a tenant: a random 32-character secret is plenty)"
        )


def salt_key(cache_salt: str | None) -> bytes:
    """The extra key a request's `cache_salt` adds to every block hash: a 32-byte sha256 digest of its UTF-8 bytes
    (b"" without a salt), so that every block key, miss-history entry and tier record holds 32 bytes whatever the
    salt's length, and the salt itself is kept nowhere (sha256: two salts never share a key). surrogatepass: a lone
    surrogate must never raise on the engine thread (the server rejects one up front); its bytes cannot equal any
    valid string's, so salts still never collide. One function, so that whoever predicts an engine's hashes (a
    KV-aware router) computes exactly the engine's."""
    if not cache_salt:
        return b""
    return hashlib.sha256(_SALT_DOMAIN + cache_salt.encode("utf-8", "surrogatepass")).digest()


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if algo == "xxhash":
        import xxhash

        return lambda data: xxhash.xxh3_128_digest(data)
    raise ValueError(f"unknown prefix-caching hash algorithm {algo!r}; choose from {', '.join(HASH_ALGOS)}")


class BlockHasher:
    """Hashes full blocks with one algorithm; one instance per KV manager."""

    def __init__(self, algo: str = "sha256") -> None:
        self.algo = algo
        self._digest = _digest_fn(algo)

    def hash_block(self, parent: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
        data = b"".join(
            (
                parent or b"\x00" * 16,
                len(extra_keys).to_bytes(4, "little"),
                extra_keys,
                array("q", token_ids).tobytes(),
            )
        )
        return self._digest(data)

    def extend(
        self,
        tokens: TokenSlice,
        num_tokens: int,
        block_size: int,
        known: list[bytes],
        extra_keys: bytes = b"",
    ) -> list[bytes]:
        """Extend `known` (hashes of the first blocks) with the hashes of the following full blocks among the
        first `num_tokens` tokens; returns the same list. `tokens(start, end)` returns tokens [start, end), so
        each block costs O(block_size) however long the sequence is."""
        for start in range(len(known) * block_size, num_tokens - block_size + 1, block_size):
            parent = known[-1] if known else None
            known.append(self.hash_block(parent, tokens(start, start + block_size), extra_keys))
        return known


class KeyedRequest(Protocol):
    """What RequestKeys reads of a request (the engine's Request satisfies it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class RequestKeys:
    """Each live request's block hashes and content keys, each made once as its tokens grow (a waiting request is
    looked up every step: hashing or re-slicing its whole prompt each time made lookups cost milliseconds)."""

    def __init__(self, hasher: BlockHasher, block_size: int) -> None:
        self.hasher = hasher
        self.block_size = block_size
        self.hashes_of: dict[str, list[bytes]] = {}
        self.keys_of: dict[str, list[BlockKey]] = {}
        self.extra_of: dict[str, bytes] = {}  # each request's salt key, made once

    def extra_keys(self, request: KeyedRequest) -> bytes:
        extra = self.extra_of.get(request.request_id)
        if extra is None:
            extra = self.extra_of[request.request_id] = salt_key(request.cache_salt)
        return extra

    def hashes(self, request: KeyedRequest, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first num_tokens tokens (the list grows; never shrinks)."""
        hashes = self.hashes_of.setdefault(request.request_id, [])
        num_tokens = min(num_tokens, request.num_tokens)
        return self.hasher.extend(request.token_slice, num_tokens, self.block_size, hashes, self.extra_keys(request))

    def key(self, request: KeyedRequest, hashes: list[bytes], index: int) -> BlockKey:
        """What block `index` of the request holds (its hashes up to it made already), as a prefix hit compares it."""
        keys = self.keys_of.setdefault(request.request_id, [])
        if len(keys) <= index:
            bs, extra = self.block_size, self.extra_keys(request)
            for i in range(len(keys), index + 1):
                keys.append(
                    BlockKey(hashes[i - 1] if i else None, tuple(request.token_slice(i * bs, (i + 1) * bs)), extra)
                )
        return keys[index]

    def forget(self, request_id: str) -> None:
        self.hashes_of.pop(request_id, None)
        self.keys_of.pop(request_id, None)
        self.extra_of.pop(request_id, None)
