"""KVCacheManager: which blocks each request holds, prefix lookups, and growth on demand."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.kv.block import KVCacheBlock, TierBlock
from kvserve.kv.hashing import BlockHasher, BlockKey, salt_key
from kvserve.kv.pool import BlockPool
from kvserve.units import cdiv

if TYPE_CHECKING:
    from kvserve.kv.offload.tier import OffloadTier


class KVRequest(Protocol):
    """What the KV layer reads of a request; the engine's Request satisfies it. A protocol here, rather than an
    import of the engine's class, keeps kv/ below engine/: the KV layer never imports what it serves."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache accounting in tokens: totals since start, and a hit rate over the last `window`
    queries (a gauge users of vLLM keep asking for: totals hide what the cache does now). A query is one
    request's first admission, not every lookup (see KVCacheManager.record_prefix_query)."""

    window: int = 1000
    queries_total: int = 0
    hits_total: int = 0
    # Looked-up tokens that missed because the pool had evicted their blocks shortly before (its ghost list).
    evicted_misses_total: int = 0
    recent: deque[tuple[int, int]] = field(default_factory=deque)
    recent_queries: int = 0
    recent_hits: int = 0

    def record(self, queries: int, hits: int) -> None:
        self.queries_total += queries
        self.hits_total += hits
        self.recent.append((queries, hits))
        self.recent_queries += queries
        self.recent_hits += hits
        if len(self.recent) > self.window:
            old_q, old_h = self.recent.popleft()
            self.recent_queries -= old_q
            self.recent_hits -= old_h

    @property
    def hit_rate(self) -> float:
        return self.recent_hits / self.recent_queries if self.recent_queries else 0.0


@dataclass(slots=True)
class PendingLoad:
    """A restore from the offload tier in flight for a waiting request. It holds its blocks (the pool's hits before
    the restored ones, and the fresh blocks being written), so that nothing evicts or reuses them meanwhile; when it
    is done, the restored blocks join the prefix cache and every block is released, and the request's admission then
    finds them all as ordinary prefix hits."""

    request_id: str
    held: list[KVCacheBlock]  # the pool hits (referenced), then the restore's targets
    targets: list[TierBlock]
    future: Future[int]
    cancelled: threading.Event

    @property
    def target_blocks(self) -> list[KVCacheBlock]:
        return self.held[len(self.held) - len(self.targets) :]


class KVCacheManager:
    """Maps requests to block lists. A request holds blocks only for the tokens it has; full computed
    blocks are published to the prefix cache so later requests with the same prefix can share them.

    `reserve_tokens` > 0 emulates a contiguous cache (pre-PagedAttention systems, HF's static cache): a
    request takes blocks for that many tokens at its first allocation, whatever its length, so `bench
    memory` can measure what reserving max-model-len per request costs on the very same engine."""

    def __init__(self, pool: BlockPool, block_size: int, hash_algo: str = "sha256", reserve_tokens: int = 0) -> None:
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        self.pool = pool
        self.block_size = block_size
        self.reserve_tokens = reserve_tokens
        self.hasher = BlockHasher(hash_algo)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        self.req_num_published: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # The KV offload tier under the pool (kv/offload/tier.py), attached by the engine core; None: no tier.
        self.tier: OffloadTier | None = None
        self.loads: dict[str, PendingLoad] = {}  # restores in flight, by waiting request
        self.orphan_loads: list[PendingLoad] = []  # restores whose request left: released once their copy ends
        self.to_offload: list[TierBlock] = []  # blocks published this step, for the tier once the step succeeds
        self.external_queries_tokens = 0  # prompt tokens looked up in the tier (past the pool's hits)
        self.external_hits_tokens = 0  # of them, restored

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def _extra_keys(self, request: KVRequest) -> bytes:
        return salt_key(request.cache_salt)

    def _hashes(self, request: KVRequest, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first num_tokens tokens; only blocks not hashed before cost work,
        each O(block_size)."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        num_tokens = min(num_tokens, request.num_tokens)
        return self.hasher.extend(request.token_slice, num_tokens, self.block_size, hashes, self._extra_keys(request))

    def _key(self, request: KVRequest, hashes: list[bytes], index: int) -> BlockKey:
        bs = self.block_size
        tokens = tuple(request.token_slice(index * bs, (index + 1) * bs))
        return BlockKey(hashes[index - 1] if index else None, tokens, self._extra_keys(request))

    def _reads_prefix_cache(self, request: KVRequest) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks matching the request's tokens. Never covers the last token,
        whose logits must be computed; skipped when prompt logprobs need every position's logits.
        A lookup only: it counts nothing, since a request that cannot be admitted looks up again next step."""
        if not self._reads_prefix_cache(request):
            return [], 0
        hashes = self._hashes(request, request.num_tokens - 1)
        blocks = []
        for i, block_hash in enumerate(hashes):
            block = self.pool.lookup(block_hash, self._key(request, hashes, i))
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def evicted_misses(self, request: KVRequest, num_hit_tokens: int) -> int:
        """The tokens after the request's hits whose blocks the pool evicted shortly before (its ghost list): hits
        lost to eviction. Asked before the request's allocation, which re-publishes the blocks it computes."""
        ghosts = self.pool.recently_evicted
        if not ghosts or not self._reads_prefix_cache(request):
            return 0
        lost = 0
        for block_hash in self._hashes(request, request.num_tokens - 1)[num_hit_tokens // self.block_size :]:
            if block_hash not in ghosts:
                break
            lost += 1
        return lost * self.block_size

    def record_prefix_query(self, request: KVRequest, num_hit_tokens: int, num_evicted_misses: int = 0) -> None:
        """Count one prefix-cache query of request.num_tokens tokens, num_hit_tokens of them hits. The
        scheduler calls it once per request, when its first admission has its blocks; lookups retried while
        the request waits, and re-admissions after preemption, would otherwise inflate the queries and skew
        the hit rate exactly when the server is under pressure (vLLM fixed the same bug)."""
        if self._reads_prefix_cache(request):
            self.prefix_stats.record(request.num_tokens, num_hit_tokens)
            self.prefix_stats.evicted_misses_total += num_evicted_misses

    def _blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of num_tokens tokens holds: just enough, or its whole reservation."""
        return cdiv(max(num_tokens, self.reserve_tokens), self.block_size)

    def can_fit(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock],
        num_lookahead_tokens: int = 0,
    ) -> bool:
        held = self.req_blocks.get(request.request_id, [])
        num_tokens = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_new_tokens
            + num_lookahead_tokens
        )
        needed = self._blocks_for(num_tokens) - len(held) - len(new_computed_blocks)
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return max(needed, 0) + revived <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after any prefix-hit blocks), plus slots for
        `num_lookahead_tokens` drafted tokens (speculative decoding, vLLM's name). Draft slots are never published
        to the prefix cache: a drafted token may be rejected, and its K/V with it (see `rollback`).
        Returns False, changing nothing, when the pool cannot supply them."""
        new_computed_blocks = new_computed_blocks or []
        if not self.can_fit(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens):
            return False
        held = self.req_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            if held:
                raise ValueError(f"request {request.request_id} already holds blocks; prefix hits come first")
            self.req_num_published[request.request_id] = len(new_computed_blocks)
        self.pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        num_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        needed = self._blocks_for(num_tokens + num_lookahead_tokens) - len(held)
        if needed > 0:
            held.extend(self.pool.allocate(needed))
        self._publish(request, num_tokens)
        return True

    def rollback(self, request: KVRequest) -> None:
        """After verification: return the blocks past the request's tokens (those held only rejected drafts'
        K/V) to the pool. The slots of rejected drafts inside a kept block are simply overwritten when real
        tokens reach them; such a block was never published (`allocate_slots` publishes real tokens only), and
        is published only in the step that computes its last real token."""
        held = self.req_blocks.get(request.request_id)
        if not held:
            return
        keep = self._blocks_for(request.num_tokens)
        if len(held) > keep:
            tail = held[keep:]
            del held[keep:]
            self.pool.free(reversed(tail))

    def _publish(self, request: KVRequest, num_tokens: int) -> None:
        """Hash the request's blocks that are full once `num_tokens` tokens are computed.

        This happens at allocation, before the step computes them, as in vLLM: a request scheduled later
        in the same step (a sibling of an n > 1 request, or a batch sharing a system prompt) can then
        share the blocks at once. It is safe because every layer writes the whole batch's new K/V before
        any query reads the cache, and the scheduler never preempts a request it already scheduled in the
        same step. If a step fails, the engine drops the prefix cache (reset_prefix_cache)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_tokens // self.block_size, len(self.req_blocks.get(rid, ())))
        start = self.req_num_published.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full * self.block_size)
        blocks = self.req_blocks[rid]
        for i in range(start, num_full):
            key = self._key(request, hashes, i)
            self.pool.cache_block(blocks[i], hashes[i], key)
            if self.tier is not None:
                self.to_offload.append(TierBlock(blocks[i].block_id, hashes[i], key))
        self.req_num_published[rid] = num_full

    # ---- the offload tier ----------------------------------------------------------------------------

    def tier_hits(self, request: KVRequest, num_pool_blocks: int) -> list[tuple[bytes, BlockKey]]:
        """The blocks after the pool's `num_pool_blocks` hits that the tier holds, in order up to the first it lacks
        (never the block of the last prompt token, as for the pool)."""
        tier = self.tier
        if tier is None or not tier.readable or not self._reads_prefix_cache(request):
            return []
        hashes = self._hashes(request, request.num_tokens - 1)
        hits = []
        for i in range(num_pool_blocks, len(hashes)):
            if not tier.contains(hashes[i]):
                break
            hits.append((hashes[i], self._key(request, hashes, i)))
        return hits

    def start_load(
        self, request: KVRequest, pool_blocks: list[KVCacheBlock], hits: list[tuple[bytes, BlockKey]]
    ) -> PendingLoad | None:
        """Take fresh blocks for `hits` (and a reference on the pool's hits before them) and start copying the tier's
        blocks into them; None, changing nothing, when the pool cannot supply the blocks."""
        tier = self.tier
        assert tier is not None
        revived = sum(1 for b in pool_blocks if b.ref_cnt == 0)
        if revived + len(hits) > self.pool.num_free_blocks:
            return None
        self.pool.touch(pool_blocks)
        fresh = self.pool.allocate(len(hits))
        targets = [TierBlock(b.block_id, h, k) for b, (h, k) in zip(fresh, hits)]
        cancelled = threading.Event()
        load = PendingLoad(
            request.request_id, [*pool_blocks, *fresh], targets, tier.load(targets, cancelled), cancelled
        )
        self.loads[request.request_id] = load
        return load

    def finish_load(self, load: PendingLoad) -> int:
        """A done restore: its restored blocks join the prefix cache, every block it held is released (hashed ones at
        the free queue's tail, so the admission that follows revives them). Returns the blocks restored."""
        try:
            restored = load.future.result()
        except Exception:  # noqa: BLE001 -- a failed copy restores nothing; the blocks are recomputed
            restored = 0
        for block, target in zip(load.target_blocks[:restored], load.targets):
            self.pool.cache_block(block, target.block_hash, target.key)
        self.pool.free(reversed(load.held))
        if self.loads.get(load.request_id) is load:
            del self.loads[load.request_id]
        return restored

    def reap_orphan_loads(self) -> None:
        """Release the restores of requests that left while their copy ran, once the copy has stopped."""
        if self.orphan_loads:
            done = [load for load in self.orphan_loads if load.future.done()]
            self.orphan_loads = [load for load in self.orphan_loads if not load.future.done()]
            for load in done:
                self.finish_load(load)

    def load_futures(self) -> list[Future[int]]:
        return [load.future for load in (*self.loads.values(), *self.orphan_loads)]

    def take_offload(self) -> list[TierBlock]:
        """The blocks published since the last call (the step that computed them succeeded: the tier may copy them)."""
        blocks, self.to_offload = self.to_offload, []
        return blocks

    def block_ids(self, request: KVRequest) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.request_id, ())]

    def num_blocks_held(self, request: KVRequest) -> int:
        return len(self.req_blocks.get(request.request_id, ()))

    def free(self, request: KVRequest) -> None:
        """Return the request's blocks, last block first so that a sequence's tail is evicted before its
        shareable head. Freeing an unknown or already freed request does nothing. A restore in flight for it is
        cancelled; its blocks are released once the copy into them has stopped (reap_orphan_loads)."""
        load = self.loads.pop(request.request_id, None)
        if load is not None:
            load.cancelled.set()
            self.orphan_loads.append(load)
        blocks = self.req_blocks.pop(request.request_id, None)
        self.req_num_published.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def forget(self, request: KVRequest) -> None:
        """Drop per-request bookkeeping once a request is gone for good."""
        self.free(request)
        self.req_hashes.pop(request.request_id, None)
