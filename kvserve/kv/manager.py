"""KVCacheManager: the scheduler's one door to the KV cache (vLLM's KVCacheManager): prefix lookups, allocation and
publication of each request's blocks, and the layers composed behind it:

    KVCacheManager
      KVCacheCoordinator (kv/coordinator.py)   block tables per group; one hit rule over every layer kind
        FullAttentionManager, SlidingWindowManager (kv/single_type.py)
      StateManager (kv/state_manager.py)       a hybrid model's state slots, snapshots and each step's copies
      PinTable (kv/pins.py)                    cache_control pins
      MissClassifier (kv/misses.py)            why a prefix hit stopped

It knows no offload tier: the connector (kv/offload/connector.py) reads what a step computed from the scheduler's
output and the tables here, as vLLM's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvserve.kv.block import KVCacheBlock
from kvserve.kv.coordinator import GroupBlocks, KVCacheCoordinator, RequestTables
from kvserve.kv.groups import KVCacheLayout, make_kv_cache_layout
from kvserve.kv.hashing import BlockHasher, BlockKey, RequestKeys, salt_key
from kvserve.kv.misses import MissClassifier, MissCounts, PrefixMiss
from kvserve.kv.pins import PinOutcome, PinTable
from kvserve.kv.pool import BlockPool
from kvserve.kv.prefix_stats import PrefixCacheStats
from kvserve.kv.state import StateSlots, StateSnapshots
from kvserve.kv.state_manager import StateManager

if TYPE_CHECKING:
    from kvserve.sampling_params import KVPin

__all__ = ["GroupBlocks", "KVCacheManager", "KVRequest", "RequestTables"]


class KVRequest(Protocol):
    """What the KV layer reads of a request; the engine's Request satisfies it. A protocol here, rather than an
    import of the engine's class, keeps kv/ below engine/: the KV layer never imports what it serves."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...

    @property
    def cache_marks(self) -> tuple[int, ...]: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class KVCacheManager:
    """Maps requests to block tables, one per KV cache group (kv/groups.py). A request holds blocks only for the
    tokens it has (and, in a sliding group, only those its next queries can see); full computed blocks are
    published to the prefix cache so later requests with the same prefix can share them.

    `reserve_tokens` > 0 emulates a contiguous cache (pre-PagedAttention systems, HF's static cache): a
    request takes blocks for that many tokens at its first allocation, whatever its length, so `bench
    memory` can measure what reserving max-model-len per request costs on the very same engine."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        hash_algo: str = "sha256",
        reserve_tokens: int = 0,
        layout: KVCacheLayout | None = None,
        max_pinned_blocks: int | None = None,
        state_slots: StateSlots | None = None,
        state_snapshots: StateSnapshots | None = None,
        max_pinned_blocks_per_tenant: int | None = None,
    ) -> None:
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        self.layout = layout or make_kv_cache_layout([None])
        if reserve_tokens and self.layout.is_hybrid:
            raise ValueError("reserving tokens per request emulates a contiguous cache: it needs the uniform layout")
        self.pool = pool
        self.block_size = block_size
        self.coordinator = KVCacheCoordinator(pool, self.layout, block_size, reserve_tokens)
        self.num_groups = self.layout.num_groups
        self.hasher = BlockHasher(hash_algo)
        self.keys = RequestKeys(self.hasher, block_size)
        self.req_hashes = self.keys.hashes_of  # the connector and tests read a request's hashes here
        self.prefix_stats = PrefixCacheStats()
        # Pinned prefixes (kv/pins.py); by default at most half the pool's blocks.
        budget = pool.num_usable_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        self.pins = PinTable(pool, budget, pool.clock, tenant_budget=max_pinned_blocks_per_tenant)
        # A hybrid model's state layers (kv/state_manager.py): a slot per scheduled request, snapshots for hits.
        self.state = (
            None
            if state_slots is None
            else StateManager(state_slots, state_snapshots, block_size, caching=pool.enable_caching)
        )
        if state_snapshots is not None:  # a pinned prefix keeps its state snapshot as it keeps its blocks
            state_snapshots.protected = self.pins.pins.__contains__
        self.misses = MissClassifier(pool, self.pins, block_size, self.hasher)

    # ---- names the rest of the engine reads --------------------------------------------------------------------

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def null_block(self) -> KVCacheBlock:
        return self.pool.null_block

    @property
    def requests(self) -> dict[str, RequestTables]:
        return self.coordinator.requests

    @property
    def state_slots(self) -> StateSlots | None:
        return None if self.state is None else self.state.slots

    @property
    def state_snapshots(self) -> StateSnapshots | None:
        return None if self.state is None else self.state.snapshots

    @property
    def miss_counts(self) -> MissCounts:
        return self.misses.counts

    @property
    def state_group(self) -> int:
        """The group index of state snapshots in KV events and the offload tier: the one past the KV cache groups."""
        return self.num_groups

    # ---- hashes and keys ---------------------------------------------------------------------------------------

    def hashes(self, request: KVRequest, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first num_tokens tokens (RequestKeys)."""
        return self.keys.hashes(request, num_tokens)

    def key(self, request: KVRequest, hashes: list[bytes], index: int) -> BlockKey:
        """What block `index` of the request holds, as a prefix hit compares it (RequestKeys)."""
        return self.keys.key(request, hashes, index)

    def reads_prefix_cache(self, request: KVRequest) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    # ---- prefix hits -------------------------------------------------------------------------------------------

    def get_computed_blocks(self, request: KVRequest) -> tuple[GroupBlocks, int]:
        """The longest prefix of the request's tokens the pool's cached blocks serve in every group (and, for a model
        with state layers, that ends at a state snapshot), as per-group tables, and its length in tokens. Never
        covers the last token, whose logits must be computed; skipped when prompt logprobs need every position's
        logits. A lookup only: it counts nothing, since a request that cannot be admitted looks up again next step."""
        if not self.reads_prefix_cache(request):
            return [[] for _ in range(self.num_groups)], 0
        hashes = self.hashes(request, request.num_tokens - 1)
        found: dict[tuple[int, int], KVCacheBlock] = {}

        def has(g: int, i: int) -> bool:
            if (g, i) not in found:
                block = self.pool.lookup(hashes[i], self.key(request, hashes, i), g)
                if block is None:
                    return False
                found[g, i] = block
            return True

        has_snapshot = None
        if self.state is not None:
            state = self.state
            has_snapshot = lambda i: state.serves(hashes[i], self.key(request, hashes, i))  # noqa: E731
        length = self.coordinator.longest_hit(len(hashes), has)
        if has_snapshot is not None:  # a hit ends at a state snapshot; for misses, what that cut off the pool's hit
            state_length = self.coordinator.longest_hit(length, has, has_snapshot)
            self.misses.snapshot_cut[request.request_id] = length - state_length
            length = state_length
        return self.coordinator.hit_tables(length, lambda g, i: found[g, i]), length * self.block_size

    def keep_state_hit(self, request: KVRequest) -> None:
        """Mark the state snapshot a waiting request would start from as the most recently used, so that the saves of
        the steps it waits through overwrite others first: a request queued behind others (--max-num-partial-prefills,
        --max-num-seqs) kept losing its snapshot to theirs when slots were few (Qwen3.5's 39 in 3 GiB)."""
        if self.state is None:
            return
        _, num_hit = self.get_computed_blocks(request)
        if num_hit:
            self.state.keep(self.hashes(request, num_hit)[num_hit // self.block_size - 1])

    def evicted_misses(self, request: KVRequest, num_hit_tokens: int) -> int:
        """The tokens after the request's hits whose blocks the pool evicted shortly before (its ghost list)."""
        if not self.reads_prefix_cache(request):
            return 0
        return self.misses.evicted_after(self.hashes(request, request.num_tokens - 1), num_hit_tokens)

    def record_prefix_query(self, request: KVRequest, num_hit_tokens: int, num_evicted_misses: int = 0) -> None:
        """Count one prefix-cache query of request.num_tokens tokens, num_hit_tokens of them hits. The scheduler calls
        it once per request, at its first admission: lookups retried while it waits, and re-admissions after
        preemption, would otherwise skew the hit rate exactly when the server is under pressure (vLLM fixed the
        same bug)."""
        if self.reads_prefix_cache(request):
            self.prefix_stats.record(request.num_tokens, num_hit_tokens)
            self.prefix_stats.evicted_misses_total += num_evicted_misses

    def classify_miss(
        self, request: KVRequest, num_hit_tokens: int, rejected: frozenset[bytes] = frozenset()
    ) -> PrefixMiss | None:
        """Why the request's prefix hit of `num_hit_tokens` stopped there (kv/misses.py), or None when it served
        every block a hit can. `rejected`: hashes whose tier records a restore refused. Asked at the first admission,
        before allocation publishes the request's own blocks."""
        if not self.reads_prefix_cache(request):
            return None
        hashes = self.hashes(request, request.num_tokens - 1)
        return self.misses.classify(request, hashes, num_hit_tokens, rejected, self.coordinator)

    # ---- allocation --------------------------------------------------------------------------------------------

    def can_fit(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Whether the pool can give the request blocks for num_new_tokens (+ lookahead) more tokens after the prefix
        hit `new_computed_blocks` (reviving those of its blocks that sit free). A query: it changes nothing."""
        return self._blocks_needed(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens) <= (
            self.pool.num_free_blocks
        )

    def _blocks_needed(
        self, request: KVRequest, num_new: int, hit: GroupBlocks | None, num_lookahead: int
    ) -> int:  # fmt: skip
        hit_len = len(hit[0]) if hit else 0
        num_tokens = request.num_computed_tokens + hit_len * self.block_size + num_new + num_lookahead
        return self.coordinator.blocks_needed(request.request_id, num_tokens, hit)

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after any prefix-hit blocks), plus slots for
        `num_lookahead_tokens` drafted tokens (speculative decoding, vLLM's name). Draft slots are never published
        to the prefix cache: a drafted token may be rejected, and its K/V with it (see `rollback`).

        First, blocks no later query of the request can see (before a sliding group's window) go back to the pool,
        whether or not the rest fits (vLLM's order: fewer blocks are then evicted for the new ones). When the pool is
        short, pins release what only they hold, as far as that makes the request fit (kv/pins.py). Returns False,
        changing nothing more, when the pool cannot supply the new blocks."""
        rid = request.request_id
        if rid in self.requests:
            self.coordinator.free_skipped(rid, request.num_computed_tokens)
        needed = self._blocks_needed(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)
        if needed > self.pool.num_free_blocks:
            hit_ids = {b.block_id for blocks in new_computed_blocks or () for b in blocks}
            if not self.pins.release_for(needed - self.pool.num_free_blocks, hit_ids):
                return False
        if self.state is not None and not self.state.acquire(rid):
            return False
        hit_len = len(new_computed_blocks[0]) if new_computed_blocks and new_computed_blocks[0] else 0
        if hit_len:
            self.pins.refresh(self.req_hashes.get(rid, [])[:hit_len])
        num_tokens = request.num_computed_tokens + hit_len * self.block_size + num_new_tokens
        tables = self.coordinator.allocate(rid, new_computed_blocks, num_tokens + num_lookahead_tokens)
        self._publish(request, tables, num_tokens)
        if self.state is not None:  # its slot from the hit's snapshot before the step, into one where it ends after it
            self.state.plan_step(request, hit_len, num_tokens, self.keys if self.enable_caching else None)
        return True

    def state_chunk(self, request: KVRequest, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` the next step computes (StateManager.chunk): unchanged without
        state snapshots."""
        if self.state is None or not self.enable_caching:
            return num_new
        return self.state.chunk(request, start, num_new)

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The state copies planned for the next step: (restores before it, saves after it), each (from, to) slots."""
        return ([], []) if self.state is None else self.state.take_copies()

    def state_saves_done(self) -> None:
        """The runner saved the snapshots it took: prefix hits may start from them; the step's slots are free to go."""
        if self.state is not None:
            self.state.end_step()

    def rollback(self, request: KVRequest) -> None:
        """After verification: return the blocks past the request's tokens (those held only rejected drafts'
        K/V) to the pool. The slots of rejected drafts inside a kept block are simply overwritten when real
        tokens reach them; such a block was never published (`allocate_slots` publishes real tokens only), and
        is published only in the step that computes its last real token."""
        self.coordinator.rollback(request.request_id, request.num_tokens)

    def _publish(self, request: KVRequest, state: RequestTables, num_tokens: int) -> None:
        """Hash the request's blocks that are full once `num_tokens` tokens are computed, in every group.

        This happens at allocation, before the step computes them, as in vLLM: a request scheduled later in the same
        step (a sibling of an n > 1 request, or a batch sharing a system prompt) can then share the blocks at once. It
        is safe because every layer writes the whole batch's new K/V before any query reads the cache, and the
        scheduler never preempts a request it already scheduled in the same step. If a step fails, the engine drops
        the prefix cache (reset_prefix_cache). A private duplicate of a block cached already (a sibling's, a
        concurrent identical prompt's) stays private."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, state.num_entries)
        start = state.num_published
        if num_full <= start:
            return
        hashes = self.hashes(request, num_full * self.block_size)
        unsalted = self.misses.unsalted(request, num_full * self.block_size) if request.cache_salt else hashes
        for i in range(start, num_full):
            key = self.key(request, hashes, i)
            self.misses.saw(hashes[i], key, unsalted[i])
            for table in state.tables:
                if table[i] is not self.null_block:
                    self.pool.cache_block(table[i], hashes[i], key)
        state.num_published = num_full

    # ---- what requests hold (the coordinator's tables; null entries are not blocks) -----------------------------

    def state_slot(self, request: KVRequest) -> int:
        """The state slot a scheduled request holds (allocate_slots gave it one)."""
        if self.state is None:
            raise KeyError(f"request {request.request_id} holds no state slot")
        return self.state.slot(request.request_id)

    def block_ids(self, request: KVRequest, group_id: int = 0) -> list[int]:
        return [b.block_id for b in self.coordinator.tables(request.request_id)[group_id]]

    def table_tail(self, request: KVRequest, group_id: int) -> tuple[int, list[int]]:
        return self.coordinator.table_tail(request.request_id, group_id)

    def group_tables(self, request_id: str) -> GroupBlocks:
        return self.coordinator.tables(request_id)

    def num_blocks_held(self, request: KVRequest) -> int:
        return self.coordinator.num_blocks_held(request.request_id)

    def num_tokens_held(self, request: KVRequest) -> int:
        state = self.requests.get(request.request_id)
        return 0 if state is None else state.num_entries * self.block_size

    def held_blocks(self) -> list[tuple[str, int, KVCacheBlock]]:
        return list(self.coordinator.held_blocks())

    def free(self, request: KVRequest) -> None:
        """Return the request's blocks and state slot. Freeing an unknown or already freed request does nothing."""
        if self.state is not None:
            self.state.release(request.request_id)
        self.coordinator.free(request.request_id)

    def forget(self, request: KVRequest) -> None:
        """Drop per-request bookkeeping once a request is gone for good."""
        self.free(request)
        rid = request.request_id
        self.keys.forget(rid)
        self.misses.forget(rid)
        if self.state is not None:
            self.state.forget(rid)

    # ---- pins --------------------------------------------------------------------------------------------------

    def pin_prefix(self, request: KVRequest, pins: Sequence[KVPin]) -> tuple[PinOutcome, ...]:
        """Pin the prefixes `pins` ask for, as far as the request computed and cached them (whole blocks; a hit's
        blocks in every group). Called as the request finishes, before its blocks are freed; what became of each."""
        state = self.requests.get(request.request_id)
        if not pins:
            return ()
        if state is None or not self.enable_caching:
            return tuple(PinOutcome(0, "not_cached") for _ in pins)
        hashes = self.req_hashes.get(request.request_id, [])
        computed = min(request.num_computed_tokens // self.block_size, state.num_published, len(hashes))
        ends = [self._pin_end(request, hashes, min(pin.num_tokens // self.block_size, computed)) for pin in pins]
        prefixes = [(hashes[n - 1], self.coordinator.cached_prefix(hashes, n), n * self.block_size) if n else None
                    for n in ends]  # fmt: skip
        return self.pins.pin_all(prefixes, [pin.ttl_s for pin in pins], salt_key(request.cache_salt))

    def _pin_end(self, request: KVRequest, hashes: list[bytes], length: int) -> int:
        """Where a pin of `length` blocks ends: there, or for a model with state layers at the last state snapshot at
        or before it (a hit needs one: the pin keeps it, StateSnapshots.protected)."""
        state = self.state
        while (
            state is not None and length and not state.serves(hashes[length - 1], self.key(request, hashes, length - 1))
        ):
            length -= 1
        return length

    def expire_pins(self) -> int:
        return self.pins.expire()

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache, pins first (their blocks hold no prefix afterwards), and the state snapshots with the
        copies planned for a step that did not run (a failed step's saves would name states never saved)."""
        self.pins.clear()
        self.pool.reset_prefix_cache()
        if self.state is not None:
            self.state.reset()

    def check_state(self) -> None:
        """The state slots' and snapshots' invariants (kv/state.py), for check_kv_invariants."""
        if self.state is not None:
            self.state.check()
