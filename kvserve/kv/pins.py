"""Pinned prefixes: KV blocks kept out of eviction for a time, as Anthropic's `cache_control` promises.

Why references, not a flag on the block: a pin holds one reference on each block its prefix needs, exactly as a
running request does, so the pool's rules stay as they are (a referenced block is never free, never evicted) and the
invariant checker counts a pin as one more holder. A pin is keyed by the chained hash of its last block, which
includes the cache salt: one pin per prefix and tenant, and a pin can only ever serve requests of its own salt.

A prefix is pinned when a request that asked for it finishes (its blocks are computed and cached by then); pinning
it again, or a later request hitting it, moves its expiry to `now + ttl` when that is later. Pins expire on the
scheduler's clock (injectable, for tests); the blocks of an expired pin go back to the pool's LRU like any freed
block.

Budgets. Pinned blocks are capped at `budget_blocks` distinct blocks (a chat's successive pins share their history's
blocks, which count once; a sliding-window group's window before each pin's end does not), and each tenant (a cache
salt; requests without one are one tenant) at `tenant_budget` (default: the whole budget). A new pin over its
tenant's budget displaces that tenant's pins; one over the whole budget displaces pins of the tenant holding the most
blocks, so one tenant's pins never push out another's that holds less (max-min fairness). A pin larger than its budget
alone is refused. Each is counted; a response reports only the displacement of its own tenant's pins (another
tenant's pins are not its business, nor their existence).

Which of a tenant's pins go first: those another of its pins extends, least recently used first, then the others,
least recently used first; a pin whose release would free none of the blocks counted is passed over. Why: a chat pins
its system prompt and each turn's end, and the newest pin holds every full-attention block of the earlier ones, so an
extended pin keeps only its own window blocks (a sliding group's last window before its end: a branch there, a new
conversation on the same system prompt, still hits). A pin no other extends is a conversation's only hold on its
history. With four agents' system and newest pins over the budget on Gemma 3 (each pin ~160 window blocks), least
recently used alone released the oldest agent's newest pin and it recomputed its whole prompt every turn
(`bench prompt-cache`, hit rate 0.80); releasing the extended pins first keeps every conversation's newest one.

Pins never starve a live request: when the pool cannot give a request its blocks even after evicting every
unreferenced one, pins give way (`release_for`): the least recently used pins whose blocks only pins hold, as many as
make the request fit, and none when that would not. A pin whose blocks running requests hold too frees nothing and
stays (releasing every pin whatever it freed left cache_control keeping nothing under load).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kvserve.kv.block import KVCacheBlock
from kvserve.kv.pool import BlockPool


@dataclass(slots=True)
class Pin:
    """One pinned prefix: the blocks it holds a reference on, whose it is, how long it lives, and until when."""

    key: bytes  # the chained hash of its last block
    blocks: list[KVCacheBlock]
    num_tokens: int
    ttl_s: float
    expires_at: float
    tenant: bytes = b""  # the cache salt's key (kv/hashing.py salt_key); b"": no salt


@dataclass(frozen=True, slots=True)
class PinOutcome:
    """What became of one pin a request asked for, for its response: `pinned` (new), `refreshed` (it existed),
    `refused` (larger than its budget alone), `not_cached` (nothing of it was computed and cached: no whole block, or
    caching off); `displaced`: the same tenant's older pins released to make room for it."""

    num_tokens: int
    outcome: str
    displaced: int = 0


@dataclass(slots=True)
class PinStats:
    """Counters since start: pins made, refreshed (pinned again or hit), expired, displaced (by newer pins over a
    budget, or released so that a live request fits), refused (larger than a budget alone), and `tenant_capped`: pins
    displaced or refused because their tenant's budget was full (the per-tenant cap biting)."""

    created: int = 0
    refreshed: int = 0
    expired: int = 0
    displaced: int = 0
    refused: int = 0
    tenant_capped: int = 0


@dataclass(slots=True)
class PinTable:
    """The live pins of one pool."""

    pool: BlockPool
    budget_blocks: int
    clock: Callable[[], float] = time.monotonic
    tenant_budget: int | None = None  # distinct blocks one tenant may pin (None: the whole budget)
    pins: OrderedDict[bytes, Pin] = field(default_factory=OrderedDict)  # least recently used first
    stats: PinStats = field(default_factory=PinStats)
    pinned: dict[int, int] = field(default_factory=dict)  # block id -> pins holding it: len() is the budget's count
    by_tenant: dict[bytes, dict[int, int]] = field(default_factory=dict)  # the same, per tenant
    # The block hashes of pins that expired lately (a miss on one is "pin_expired", kv/misses.py), the last 4,096.
    expired_hashes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    expired_capacity: int = 4096

    def pin(
        self, key: bytes, blocks: list[KVCacheBlock], num_tokens: int, ttl_s: float, tenant: bytes = b""
    ) -> PinOutcome:
        """Pin `blocks` (the prefix ending at the block hashed `key`) for `ttl_s` seconds, or refresh the pin if it
        exists, displacing pins as the budgets say (see the module docstring)."""
        now = self.clock()
        existing = self.pins.get(key)
        if existing is not None:
            existing.ttl_s = max(existing.ttl_s, ttl_s)
            existing.expires_at = max(existing.expires_at, now + ttl_s)
            self.pins.move_to_end(key)
            self.stats.refreshed += 1
            return PinOutcome(num_tokens, "refreshed")
        ids = {b.block_id for b in blocks}
        tenant_budget = (
            self.budget_blocks if self.tenant_budget is None else min(self.tenant_budget, self.budget_blocks)
        )
        if len(ids) > tenant_budget:
            self.stats.refused += 1
            self.stats.tenant_capped += len(ids) <= self.budget_blocks
            return PinOutcome(num_tokens, "refused")
        own = self.by_tenant.get(tenant, {})
        displaced = 0
        while len(own) + len(ids - own.keys()) > tenant_budget:
            self._release(self._victim(tenant, own, ids))
            self.stats.displaced += 1
            self.stats.tenant_capped += 1
            displaced += 1
            own = self.by_tenant.get(tenant, {})
        while len(self.pinned) + len(ids - self.pinned.keys()) > self.budget_blocks:
            victim = max(self.by_tenant, key=lambda t: len(self.by_tenant[t]))
            self._release(self._victim(victim, self.pinned, ids if victim == tenant else set()))
            self.stats.displaced += 1
            displaced += victim == tenant
        self.pool.touch(blocks)
        self.pins[key] = Pin(key, blocks, num_tokens, ttl_s, now + ttl_s, tenant)
        counts = self.by_tenant.setdefault(tenant, {})
        for b in blocks:
            self.pinned[b.block_id] = self.pinned.get(b.block_id, 0) + 1
            counts[b.block_id] = counts.get(b.block_id, 0) + 1
        self.stats.created += 1
        return PinOutcome(num_tokens, "pinned", displaced)

    def pin_all(
        self,
        prefixes: list[tuple[bytes, list[KVCacheBlock], int] | None],
        ttls: list[float],
        tenant: bytes,
    ) -> tuple[PinOutcome, ...]:
        """Pin each (key, blocks, tokens) prefix of one request for its TTL; None or no blocks: not cached."""
        return tuple(
            self.pin(p[0], p[1], p[2], ttl, tenant) if p is not None and p[1] else PinOutcome(0, "not_cached")
            for p, ttl in zip(prefixes, ttls)
        )

    def _victim(self, tenant: bytes, counted: dict[int, int], incoming: Collection[int]) -> bytes:
        """The tenant's pin to release first (module docstring): extended ones (by another of its pins, or by the
        pin being made, whose block ids are `incoming`) before the others, least recently used first within each,
        passing over a pin that frees none of the `counted` blocks (a budget's references per block); the least
        recently used when every one is passed over."""
        own = self.by_tenant[tenant]
        oldest: Pin | None = None  # the least recently used of the tenant's pins
        oldest_freeing: Pin | None = None  # ... of those whose release frees a counted block
        for found in self.pins.values():  # least recently used first: the first extended one that frees is it
            if found.tenant != tenant:
                continue
            oldest = oldest or found
            if not any(counted[b.block_id] == 1 for b in found.blocks):
                continue
            oldest_freeing = oldest_freeing or found
            if any(own[b.block_id] > 1 or b.block_id in incoming for b in found.blocks if b.block_hash == found.key):
                return found.key
        chosen = oldest_freeing or oldest
        assert chosen is not None, "a tenant over its budget holds a pin"
        return chosen.key

    def release_for(self, blocks_short: int, keep: Collection[int] = ()) -> bool:
        """A live request needs `blocks_short` more blocks than the pool has free: release the least recently used pins
        whose blocks only pins hold, as few as give it that many; none, and False, when they cannot. `keep`: the ids
        of the request's own prefix-hit blocks: one a release frees is revived by the request at once, so it gives
        the request nothing (counting it made the allocation that followed fail, a case the fuzzer found)."""
        if blocks_short <= 0:
            return True
        released_refs: dict[int, int] = {}
        chosen: list[bytes] = []
        freed = 0
        for key, found in self.pins.items():
            if not any(b.ref_cnt == self.pinned[b.block_id] and b.block_id not in keep for b in found.blocks):
                continue  # every block of it is held by a request too, or is the request's own hit: frees nothing
            for b in found.blocks:
                released_refs[b.block_id] = released_refs.get(b.block_id, 0) + 1
                freed += released_refs[b.block_id] == b.ref_cnt and b.block_id not in keep
            chosen.append(key)
            if freed >= blocks_short:
                break
        if freed < blocks_short:
            return False
        for key in chosen:
            self._release(key)
            self.stats.displaced += 1
        return True

    def refresh(self, hashes: Iterable[bytes]) -> None:
        """A request hit these blocks: every pin ending at one of them lives another TTL from now (the content was
        used, as Anthropic's refresh-on-read says). For displacement's order only two of them become most recent:
        the first pin along the hit (the shared system prompt, which other conversations hit too) and the last (the
        one the request ends at, which its next turn will hit). Pins in between are earlier turns of the same
        conversation: the newest pin holds all their full-attention blocks, so they keep only their sliding-window
        blocks and are what goes first when the budget is short (moving every one to the front made them as recent
        as the newest, so a new pin displaced the system prompt's pin, or a live conversation's, before them)."""
        if not self.pins:
            return
        now = self.clock()
        found_keys = [block_hash for block_hash in hashes if block_hash in self.pins]
        for key in found_keys:
            found = self.pins[key]
            found.expires_at = max(found.expires_at, now + found.ttl_s)
            self.stats.refreshed += 1
        for key in dict.fromkeys(found_keys[:1] + found_keys[-1:]):
            self.pins.move_to_end(key)

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
        counts = self.by_tenant[found.tenant]
        for b in found.blocks:
            _drop_ref(self.pinned, b.block_id)
            _drop_ref(counts, b.block_id)
        if not counts:
            del self.by_tenant[found.tenant]
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


def _drop_ref(counts: dict[int, int], block_id: int) -> None:
    left = counts[block_id] - 1
    if left:
        counts[block_id] = left
    else:
        del counts[block_id]
