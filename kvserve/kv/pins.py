"""Pinned prefixes: KV blocks kept out of eviction for a time, as Anthropic's `cache_control` promises.

Why references, not a flag on the block: a pin holds one reference on each block its prefix needs, exactly as a
running request does, so the pool's rules stay as they are (a referenced block is never free, never evicted) and the
invariant checker counts a pin as one more holder. A pin is keyed by the chained hash of its last block, which
includes the cache salt: one pin per prefix and tenant, and a pin can only ever serve requests of its own salt.

A prefix is pinned when a request that asked for it finishes (its blocks are computed and cached by then); pinning
it again, or a later request hitting it, moves its expiry to `now + ttl` when that is later. Pins expire on the
scheduler's clock (injectable, for tests); the blocks of an expired pin go back to the pool's LRU like any freed
block. Pinned blocks are capped at `budget_blocks` distinct blocks (a chat's successive pins share their history's
blocks, which count once; a sliding-window group's window before each pin's end does not). A new pin that would
exceed it displaces the least recently used pins first (the newest prefix is the one a conversation continues from;
a displaced pin's blocks stay ordinary cached blocks, written through to the offload tier where one is configured);
one that cannot fit even alone is refused. Both are counted. And pins never starve a live request: when the pool
cannot give a request its blocks even after evicting every unreferenced one, the least recently used pins are
released first (KVCacheManager.allocate_slots), before anyone is refused or preempted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvserve.kv.block import KVCacheBlock
from kvserve.kv.pool import BlockPool


@dataclass(slots=True)
class Pin:
    """One pinned prefix: the blocks it holds a reference on, how long it lives, and until when."""

    key: bytes  # the chained hash of its last block
    blocks: list[KVCacheBlock]
    num_tokens: int
    ttl_s: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class PinOutcome:
    """What became of one pin a request asked for, for its response: `pinned` (new), `refreshed` (it existed),
    `refused` (larger than the budget alone), `not_cached` (nothing of it was computed and cached: no whole block, or
    caching off); `displaced`: older pins released to make room for it."""

    num_tokens: int
    outcome: str
    displaced: int = 0


@dataclass(slots=True)
class PinStats:
    """Counters since start: pins made, refreshed (pinned again or hit), expired, displaced by newer pins over the
    budget, refused (larger than the budget alone)."""

    created: int = 0
    refreshed: int = 0
    expired: int = 0
    displaced: int = 0
    refused: int = 0


@dataclass(slots=True)
class PinTable:
    """The live pins of one pool."""

    pool: BlockPool
    budget_blocks: int
    clock: Callable[[], float] = time.monotonic
    pins: OrderedDict[bytes, Pin] = field(default_factory=OrderedDict)  # least recently used first
    stats: PinStats = field(default_factory=PinStats)
    pinned: dict[int, int] = field(default_factory=dict)  # block id -> pins holding it: len() is the budget's count
    # The block hashes of pins that expired lately (a miss on one is "pin_expired", kv/misses.py), the last 4,096.
    expired_hashes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    expired_capacity: int = 4096

    def pin(self, key: bytes, blocks: list[KVCacheBlock], num_tokens: int, ttl_s: float) -> PinOutcome:
        """Pin `blocks` (the prefix ending at the block hashed `key`) for `ttl_s` seconds, or refresh the pin if it
        exists, displacing the least recently used pins when the budget has no room."""
        now = self.clock()
        existing = self.pins.get(key)
        if existing is not None:
            existing.ttl_s = max(existing.ttl_s, ttl_s)
            existing.expires_at = max(existing.expires_at, now + ttl_s)
            self.pins.move_to_end(key)
            self.stats.refreshed += 1
            return PinOutcome(num_tokens, "refreshed")
        if len({b.block_id for b in blocks}) > self.budget_blocks:
            self.stats.refused += 1
            return PinOutcome(num_tokens, "refused")
        displaced = 0
        while self.pins and len(self.pinned) + sum(1 for b in blocks if b.block_id not in self.pinned) > (
            self.budget_blocks
        ):
            self._release(next(iter(self.pins)))  # the least recently used pin
            self.stats.displaced += 1
            displaced += 1
        self.pool.touch(blocks)
        self.pins[key] = Pin(key, blocks, num_tokens, ttl_s, now + ttl_s)
        for b in blocks:
            self.pinned[b.block_id] = self.pinned.get(b.block_id, 0) + 1
        self.stats.created += 1
        return PinOutcome(num_tokens, "pinned", displaced)

    def release_oldest(self) -> bool:
        """Release the least recently used pin (a live request needs its blocks); False when there is none."""
        if not self.pins:
            return False
        self._release(next(iter(self.pins)))
        self.stats.displaced += 1
        return True

    def refresh(self, hashes: Iterable[bytes]) -> None:
        """A request hit these blocks: every pin ending at one of them lives another TTL from now."""
        if not self.pins:
            return
        now = self.clock()
        for block_hash in hashes:
            found = self.pins.get(block_hash)
            if found is not None:
                found.expires_at = max(found.expires_at, now + found.ttl_s)
                self.pins.move_to_end(block_hash)
                self.stats.refreshed += 1

    def expire(self) -> int:
        """Release the pins whose time is up; returns how many."""
        if not self.pins:
            return 0
        now = self.clock()
        gone = [key for key, found in self.pins.items() if found.expires_at <= now]
        for key in gone:
            for block in self.pins[key].blocks:
                if block.block_hash is not None:
                    self.expired_hashes[block.block_hash] = None
                    self.expired_hashes.move_to_end(block.block_hash)
            self._release(key)
        while len(self.expired_hashes) > self.expired_capacity:
            self.expired_hashes.popitem(last=False)
        self.stats.expired += len(gone)
        return len(gone)

    def clear(self) -> None:
        """Release every pin (the prefix cache is being dropped: the blocks hold no prefix any more)."""
        for key in list(self.pins):
            self._release(key)

    def _release(self, key: bytes) -> None:
        found = self.pins.pop(key)
        for b in found.blocks:
            left = self.pinned[b.block_id] - 1
            if left:
                self.pinned[b.block_id] = left
            else:
                del self.pinned[b.block_id]
        self.pool.free(reversed(found.blocks))

    def held_blocks(self) -> list[KVCacheBlock]:
        """Every reference the pins hold (the invariant checker counts them as holders)."""
        return [b for found in self.pins.values() for b in found.blocks]

    @property
    def num_pinned_refs(self) -> int:
        """References the pins hold (a block in two pins counts twice)."""
        return sum(self.pinned.values())

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks the pins hold (what the budget counts)."""
        return len(self.pinned)

    @property
    def num_pinned_tokens(self) -> int:
        return sum(found.num_tokens for found in self.pins.values())
