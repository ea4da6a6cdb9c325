"""Why a prefix hit stopped where it did: the answer to "why did my cache miss?", classified when a request is first
admitted.

Why a bounded history of seen blocks: to tell "evicted" from "never seen" from "the prompt changed at token i" the
engine must remember blocks it no longer holds. It keeps the last `capacity` published blocks' content keys (the
BlockKey objects the pool's cached blocks already hold, so a live block costs a reference), indexed by parent for
divergence, plus each block's hash without the cache salt (computed for salted requests only), which tells a prompt
seen under another salt. The pool's ghost list (recently evicted hashes, with when and how many evictions since),
the pins' expired keys, a restore's rejected tier records, and the groups' tables (a sliding window cut the hit
short) give the rest. Looked at in this order, the first missed block's reason is:

- `tier_record_failed_check`: a tier record the restore needed (its own, or a later one: a sliding group's window
  after it) failed its checksum or fingerprint, so the restore stopped there and the rest was recomputed;
- `no_state_snapshot`: a model with state layers (kv/state.py) had the blocks cached further, but no state snapshot
  where they end (the hit stops at the last snapshot);
- `outside_sliding_window`: every full-attention group had it, a sliding group no longer had its window;
- `pin_expired`: it was pinned (cache_control) and the pin ran out before it was evicted;
- `evicted`: the pool evicted it (`evicted_ago_s`, and `evicted_blocks_since`: the LRU pressure after it);
- `diverged`: an earlier prompt of the same salt shared its prefix (whole blocks, or half a block at least) and went on
  differently, from `diverged_at_token` (a client is told this to the token only about its own tenant's prompts:
  `whole_blocks`, kvserve.server.kv_report);
- `different_cache_salt`: the same tokens were seen under another salt (reported to operators only: a client
  learns nothing of other tenants, kvserve.server.kv_report);
- `never_seen`: nothing known: a cold prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvserve.kv.hashing import BlockHasher, BlockKey, KeyedRequest, salt_key

if TYPE_CHECKING:
    from kvserve.kv.coordinator import KVCacheCoordinator
    from kvserve.kv.pins import PinTable
    from kvserve.kv.pool import BlockPool

MISS_REASONS = (
    "tier_record_failed_check",
    "no_state_snapshot",
    "outside_sliding_window",
    "pin_expired",
    "evicted",
    "diverged",
    "different_cache_salt",
    "never_seen",
)


@dataclass(frozen=True, slots=True)
class PrefixMiss:
    """Why the prefix hit of a request ended at `at_token` (the first prompt token its KV was computed for)."""

    reason: str
    at_token: int
    diverged_at_token: int | None = None
    evicted_ago_s: float | None = None
    evicted_blocks_since: int | None = None


def whole_blocks(miss: PrefixMiss) -> PrefixMiss:
    """The miss as whole cached blocks tell it, for a client that did not send the prompts compared with: a divergence
    is told at its block's first token (a `diverged_at_token` inside the block would let a client guess another
    prompt's next token: one request per candidate, padded to a block), and one inside the first block (half a block
    in common with another prompt) is `never_seen`, since no whole block was shared. Every other reason already
    speaks of whole blocks."""
    if miss.reason != "diverged":
        return miss
    if miss.at_token == 0:
        return PrefixMiss("never_seen", 0)
    return replace(miss, diverged_at_token=miss.at_token)


# Reasons only whoever runs the server may see, and what a client (or a tenant's view of the KV inspector, /metrics
# without the admin key) is told instead: that another salt sent the same text is another tenant's business.
OPERATOR_ONLY = {"different_cache_salt": "never_seen"}


def without_operator_reasons(miss: PrefixMiss) -> PrefixMiss:
    """The miss with an operator-only reason replaced by what it stands for to a client."""
    told = OPERATOR_ONLY.get(miss.reason)
    return miss if told is None else PrefixMiss(told, miss.at_token)


def tenant_view(miss: PrefixMiss) -> PrefixMiss:
    """The miss as a client that may have sent none of the prompts compared with is told it: no operator-only reason,
    a divergence in whole blocks."""
    return whole_blocks(without_operator_reasons(miss))


def tenant_counts(counts: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """Requests by reason (MissCounts.snapshot) with the operator-only reasons counted as what clients are told."""
    folded: dict[str, int] = {}
    for reason, count in counts:
        told = OPERATOR_ONLY.get(reason, reason)
        folded[told] = folded.get(told, 0) + count
    return tuple(folded.items())


def salt_digest(extra_keys: bytes) -> bytes:
    """A short stand-in for a salt, so the history compares salts without keeping them."""
    return hashlib.sha256(extra_keys).digest()[:8] if extra_keys else b""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(slots=True)
class SeenBlocks:
    """The last `capacity` published blocks: content keys by hash, children by (parent, salt), salts by unsalted
    hash. Engine thread only."""

    capacity: int
    keys: OrderedDict[bytes, BlockKey] = field(default_factory=OrderedDict)
    children: dict[tuple[bytes | None, bytes], set[bytes]] = field(default_factory=dict)
    unsalted: OrderedDict[bytes, bytes] = field(default_factory=OrderedDict)  # unsalted hash -> salt digest

    def add(self, block_hash: bytes, key: BlockKey, unsalted_hash: bytes) -> None:
        if block_hash in self.keys:
            self.keys.move_to_end(block_hash)
        else:
            self.keys[block_hash] = key
            self.children.setdefault((key.parent, key.extra_keys), set()).add(block_hash)
            if len(self.keys) > self.capacity:
                old_hash, old = self.keys.popitem(last=False)
                siblings = self.children.get((old.parent, old.extra_keys))
                if siblings is not None:
                    siblings.discard(old_hash)
                    if not siblings:
                        del self.children[(old.parent, old.extra_keys)]
        self.unsalted[unsalted_hash] = salt_digest(key.extra_keys)
        self.unsalted.move_to_end(unsalted_hash)
        if len(self.unsalted) > self.capacity:
            self.unsalted.popitem(last=False)

    def siblings(self, parent: bytes | None, extra_keys: bytes) -> list[BlockKey]:
        """The seen blocks that follow `parent` under the same salt."""
        return [self.keys[h] for h in self.children.get((parent, extra_keys), ()) if h in self.keys]

    def seen_under_other_salt(self, unsalted_hash: bytes, extra_keys: bytes) -> bool:
        found = self.unsalted.get(unsalted_hash)
        return found is not None and found != salt_digest(extra_keys)

    def clear(self) -> None:
        self.keys.clear()
        self.children.clear()
        self.unsalted.clear()


@dataclass(slots=True)
class MissCounts:
    """Requests by the reason their prefix hit stopped (since start), for metrics and `kvserve doctor`."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    def record(self, miss: PrefixMiss | None) -> None:
        if miss is not None:
            self.counts[miss.reason] += 1

    def snapshot(self) -> tuple[tuple[str, int], ...]:
        return tuple(self.counts.items())


class MissClassifier:
    """The history behind "why did this request miss?" (see the module docstring): the seen blocks (twice the pool's
    blocks of history), each salted request's hashes without its salt, and per request the blocks its last lookup
    found cached past its longest state snapshot (a hit the snapshots cut short)."""

    def __init__(self, pool: BlockPool, pins: PinTable, block_size: int, hasher: BlockHasher) -> None:
        self.pool = pool
        self.pins = pins
        self.block_size = block_size
        self.hasher = hasher
        self.seen = SeenBlocks(max(2 * pool.num_usable_blocks, 4096))
        self.unsalted_hashes: dict[str, list[bytes]] = {}
        self.snapshot_cut: dict[str, int] = {}
        self.counts = MissCounts()

    def unsalted(self, request: KeyedRequest, num_tokens: int) -> list[bytes]:
        """A salted request's block hashes as if it had no cache salt (an unsalted one's are its own hashes)."""
        known = self.unsalted_hashes.setdefault(request.request_id, [])
        return self.hasher.extend(request.token_slice, min(num_tokens, request.num_tokens), self.block_size, known)

    def saw(self, block_hash: bytes, key: BlockKey, unsalted_hash: bytes) -> None:
        """A block was published to the prefix cache."""
        self.seen.add(block_hash, key, unsalted_hash)

    def forget(self, request_id: str) -> None:
        self.unsalted_hashes.pop(request_id, None)
        self.snapshot_cut.pop(request_id, None)

    def evicted_after(self, hashes: list[bytes], num_hit_tokens: int) -> int:
        """The tokens after a hit of `num_hit_tokens` whose blocks the pool evicted shortly before (its ghost list):
        hits lost to eviction."""
        ghosts = self.pool.recently_evicted
        lost = 0
        for block_hash in hashes[num_hit_tokens // self.block_size :] if ghosts else ():
            if block_hash not in ghosts:
                break
            lost += 1
        return lost * self.block_size

    def classify(
        self,
        request: KeyedRequest,
        hashes: list[bytes],
        num_hit_tokens: int,
        rejected: frozenset[bytes],
        coordinator: KVCacheCoordinator,
    ) -> PrefixMiss | None:
        """Why the prefix hit of `num_hit_tokens` stopped there, in the module docstring's order; None when it served
        every block a hit can. `hashes`: the request's block hashes (its last token's block excluded)."""
        bs = self.block_size
        k = num_hit_tokens // bs
        if k >= len(hashes):
            return None
        block_hash, at = hashes[k], k * bs
        extra = salt_key(request.cache_salt)
        if not rejected.isdisjoint(hashes[k:]):  # the restore stopped at a refused record: every group's hit with it
            return PrefixMiss("tier_record_failed_check", at)
        if self.snapshot_cut.get(request.request_id, 0):
            return PrefixMiss("no_state_snapshot", at)
        full = coordinator.full_groups
        if coordinator.has_sliding and full and all(self.pool.is_cached(block_hash, g) for g in full):
            return PrefixMiss("outside_sliding_window", at)
        ghost = self.pool.recently_evicted.get(block_hash)
        if ghost is not None:
            reason = "pin_expired" if block_hash in self.pins.expired_hashes else "evicted"
            ago = round(max(self.pool.clock() - ghost[0], 0.0), 3)
            return PrefixMiss(reason, at, evicted_ago_s=ago, evicted_blocks_since=self.pool.num_evictions - ghost[1])
        if block_hash in self.seen.keys:  # seen, not cached, and past the ghost list: evicted long ago
            return PrefixMiss("evicted", at)
        siblings = self.seen.siblings(hashes[k - 1] if k else None, extra)
        if siblings:
            mine = request.token_slice(at, at + bs)
            same = max(common_prefix(mine, s.token_ids) for s in siblings)
            # Whole blocks in common, or half a block at least: a prompt that shares only a BOS token or a chat
            # template's header with others was never seen, it did not diverge.
            if at > 0 or 2 * same >= bs:
                return PrefixMiss("diverged", at, diverged_at_token=at + same)
        unsalted = self.unsalted(request, (k + 1) * bs)[k] if request.cache_salt else block_hash
        if self.seen.seen_under_other_salt(unsalted, extra):
            return PrefixMiss("different_cache_salt", at)
        return PrefixMiss("never_seen", at)
