"""OffloadConnector: the scheduler's side of the KV offload tier, as vLLM's OffloadingConnector is for its
OffloadingManager: which blocks past the pool's prefix hit the tier can restore, the restores in flight, and the blocks
each step published for it to store.

Why apart from the KV manager: the manager answers for the pool alone (which blocks a request holds, what the pool can
serve); restoring is a state machine of its own (a load started, waited on, finished or cancelled), and the scheduler
asks it only two things: how many tokens the tier adds to a request's hit, and whether that request's load is done.
The tier itself (kv/offload/tier.py) is reached only through the OffloadingManager verbs (kv/offload/interface.py).

With KV cache groups (kv/groups.py) a restore follows the same rule as a pool hit: the longest prefix every group can
serve, each group's blocks from the pool or the tier. A full-attention group restores every block of that prefix it
lacks, a sliding group only the blocks of its window before the hit point. A hybrid model's state layers (kv/state.py)
add one condition, as in the pool: the prefix must end at a state snapshot, in the pool's snapshot slots or in the
tier's state records (a second OffloadingManager beside the blocks'), restored into a snapshot slot with the blocks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvserve.kv.block import KVCacheBlock, TierBlock
from kvserve.kv.hashing import BlockKey, salt_key
from kvserve.kv.manager import KVCacheManager, KVRequest
from kvserve.kv.offload.backend import done_future
from kvserve.kv.offload.interface import OffloadingManager
from kvserve.kv.offload.retention import RetentionBudget
from kvserve.kv.offload.write_through import Computed, WriteThrough

logger = logging.getLogger(__name__)


class RestoreCostModel:
    """Whether restoring n blocks is cheaper than recomputing their tokens: measured rates, not guesses. Restoring
    costs n times the measured seconds per restored block (the tier's mean so far, `restore_cost()`), plus, from disk,
    the step the request waits through for its load; recomputing costs the tokens the restore saves at the measured
    prefill seconds per token. Until both are measured, restore (a restore from memory copies bytes: it is cheaper
    than a forward pass on any model)."""

    def __init__(
        self,
        is_async: bool,
        restore_cost: Callable[[], float | None],
        state_restore_cost: Callable[[], float | None] | None = None,
    ) -> None:
        self.is_async = is_async
        self.restore_cost = restore_cost
        self.state_restore_cost = state_restore_cost  # a state snapshot's mean restore time (hybrid models)
        self.prefill_s_per_token: float | None = None
        self.step_s: float | None = None

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.8 * old + 0.2 * new

    def observe_step(self, num_prompt_tokens: int, seconds: float) -> None:
        """A finished step: its prompt tokens (only steps mostly of prefill measure the prefill rate)."""
        self.step_s = self._ema(self.step_s, seconds)
        if num_prompt_tokens >= 64:
            self.prefill_s_per_token = self._ema(self.prefill_s_per_token, seconds / num_prompt_tokens)

    def worth_restoring(self, num_blocks: int, num_tokens: int, num_snapshots: int = 0) -> bool:
        """Restoring num_blocks (of all groups) and num_snapshots state snapshots against recomputing the num_tokens
        they give back."""
        per_block = self.restore_cost() if num_blocks else 0.0
        per_snapshot = self.state_restore_cost() if num_snapshots and self.state_restore_cost else 0.0
        if per_block is None or per_snapshot is None or self.prefill_s_per_token is None:
            return True
        restore = num_blocks * per_block + num_snapshots * per_snapshot + (self.step_s or 0.0 if self.is_async else 0.0)
        return restore < num_tokens * self.prefill_s_per_token


@dataclass(slots=True)
class PendingLoad:
    """A restore from the offload tier in flight for a waiting request. It holds its blocks (the pool's blocks of the
    prefix it completes, and the fresh blocks being written), so that nothing evicts or reuses them meanwhile; when it
    is done, the restored blocks join the prefix cache and every block is released, and the request's admission then
    finds them all as ordinary prefix hits."""

    request_id: str
    held: list[KVCacheBlock]  # the pool's blocks the hit needs (referenced)
    fresh: list[KVCacheBlock]  # the restore's targets, in `targets` order
    targets: list[TierBlock]
    future: Future[int]
    cancelled: threading.Event
    pool_hit_tokens: int  # the request's hit from the pool alone, when the load started
    restored: int = -1  # blocks restored, once finished (fewer than targets: records refused or a failed copy)
    # A hybrid model's state snapshot the hit ends at, restored into a snapshot slot (its block id), when the pool's
    # snapshot slots lack it.
    state_target: TierBlock | None = None
    state_future: Future[int] | None = None

    def done(self) -> bool:
        return self.future.done() and (self.state_future is None or self.state_future.done())

    def rejected(self) -> frozenset[bytes]:
        """The hashes a finished restore did not bring back (their records failed a check, or the copy failed)."""
        return frozenset(t.block_hash for t in self.targets[self.restored :]) if self.restored >= 0 else frozenset()


class OffloadConnector:
    """Restores and stores between one engine's KV manager and its offload tier (see the module docstring).
    Engine thread only."""

    def __init__(
        self,
        kv: KVCacheManager,
        tier: OffloadingManager,
        cost: RestoreCostModel,
        state_tier: OffloadingManager | None = None,
        retention: tuple[RetentionBudget, RetentionBudget | None] | None = None,
    ) -> None:
        self.kv = kv
        # prompt_cache_retention's budgets, the blocks' and the state snapshots' (kv/offload/retention.py); None:
        # unbounded (tests of the tier alone)
        self.retention = retention
        self.tier = tier
        self.state_tier = state_tier  # a hybrid model's state snapshots (None: no state layers, or no room for one)
        self.cost = cost
        self.loads: dict[str, PendingLoad] = {}  # restores in flight, by waiting request
        self.orphan_loads: list[PendingLoad] = []  # restores whose request left: released once their copy ends
        self.external_queries_tokens = 0  # prompt tokens looked up in the tier (past the pool's hits)
        self.external_hits_tokens = 0  # of them, restored
        self.write_through = WriteThrough(kv, tier, state_tier)  # what the tier stores, from what steps computed

    # ---- restores --------------------------------------------------------------------------------------

    def start_restore(self, request: KVRequest, num_pool_hit_tokens: int, budget: int) -> PendingLoad | None:
        """Start restoring what the tier adds to the request's prefix hit, where that is cheaper than recomputing it
        and the pool can take the restored blocks and the request's first chunk after them (else they could be
        evicted again before the request is admitted); None when there is nothing worth restoring or no room."""
        kv = self.kv
        if not self.tier.readable or not kv.reads_prefix_cache(request):
            return None
        hashes = kv.hashes(request, request.num_tokens - 1)
        keys: dict[int, BlockKey] = {}
        pooled: dict[tuple[int, int], KVCacheBlock | None] = {}

        def key(i: int) -> BlockKey:
            if i not in keys:
                keys[i] = kv.key(request, hashes, i)
            return keys[i]

        def in_pool(g: int, i: int) -> KVCacheBlock | None:
            if (g, i) not in pooled:
                pooled[g, i] = kv.pool.lookup(hashes[i], key(i), g)
            return pooled[g, i]

        def available(g: int, i: int) -> bool:
            return in_pool(g, i) is not None or self.tier.lookup([(g, hashes[i])]) == 1

        has_snapshot = None if kv.state is None else (lambda i: self._has_snapshot(hashes[i], key(i)))
        length = kv.coordinator.longest_hit(len(hashes), available, has_snapshot)
        if length * kv.block_size <= num_pool_hit_tokens:
            return None
        held: list[KVCacheBlock] = []
        wanted: list[tuple[int, int]] = []  # (block index, group), in that order: a partial restore is a prefix
        for g in range(kv.num_groups):
            for i in range(kv.coordinator.first_needed_block(g, length * kv.block_size), length):
                block = in_pool(g, i)
                if block is not None:
                    held.append(block)
                else:
                    wanted.append((i, g))
        wanted.sort()
        saved = length * kv.block_size - num_pool_hit_tokens
        snapshots = kv.state_snapshots
        state_wanted = snapshots is not None and not snapshots.serves(hashes[length - 1], key(length - 1))
        if not wanted and not state_wanted:
            return None
        if not self.cost.worth_restoring(len(wanted), saved, int(state_wanted)):
            return None
        after = min(request.num_tokens - length * kv.block_size, budget)
        revived = sum(1 for b in held if b.ref_cnt == 0)
        if revived + len(wanted) + kv.num_groups * -(-after // kv.block_size) > kv.pool.num_free_blocks:
            return None
        state_target = None
        if state_wanted:
            assert snapshots is not None and self.state_tier is not None  # _has_snapshot found it in the state tier
            slot = snapshots.reserve_for_load(hashes[length - 1], key(length - 1))
            if slot is None:  # every snapshot slot holds a pinned prefix's state or another restore's
                return None
            state_target = TierBlock(slot, hashes[length - 1], key(length - 1), kv.state_group)
        kv.pool.touch(held)
        fresh = [kv.pool.allocate(1, g)[0] for _, g in wanted]
        targets = [TierBlock(b.block_id, hashes[i], key(i), g) for b, (i, g) in zip(fresh, wanted)]
        cancelled = threading.Event()
        load = PendingLoad(
            request.request_id,
            held,
            fresh,
            targets,
            self.tier.prepare_load(targets, cancelled) if targets else done_future(0),
            cancelled,
            num_pool_hit_tokens,
            state_target=state_target,
        )
        if state_target is not None and self.state_tier is not None:
            load.state_future = self.state_tier.prepare_load([state_target], cancelled)
        self.loads[request.request_id] = load
        return load

    def _has_snapshot(self, block_hash: bytes, key: BlockKey) -> bool:
        """Whether a state snapshot ends at this block (holding `key`), in the pool's snapshot slots or the state tier
        (whose records carry their key: a restore checks it)."""
        snapshots, state_tier = self.kv.state_snapshots, self.state_tier
        if snapshots is None:
            return False
        if snapshots.serves(block_hash, key):
            return True
        tier_key = (self.kv.state_group, block_hash)
        return state_tier is not None and state_tier.readable and state_tier.lookup([tier_key]) == 1

    def finish_load(self, load: PendingLoad) -> int:
        """A done restore, its request being admitted (or gone): its blocks given back (release_done_loads may have
        done that already) and the load forgotten. Returns the blocks restored."""
        self._release(load)
        if self.loads.get(load.request_id) is load:
            del self.loads[load.request_id]
        return load.restored

    def release_done_loads(self) -> None:
        """Give back the blocks of every restore that is done, at the start of a step, whoever waits before its request
        in the queue: a done restore held them until its request was reached, and a request at the head of the queue
        refused for lack of blocks never let that happen (with nothing running, no step computed again)."""
        for load in self.loads.values():
            if load.restored < 0 and load.done():
                self._release(load)

    def _release(self, load: PendingLoad) -> None:
        """Once per load: its restored blocks join the prefix cache, every block it held is released (hashed ones at
        the free queue's tail, so the admission that follows revives them), its snapshot is usable or its slot free."""
        if load.restored >= 0:
            return
        try:
            restored = load.future.result()
        except Exception as e:  # noqa: BLE001 -- a failed copy restores nothing; the blocks are recomputed
            logger.warning("KV offload: a restore failed (%s: %s); its blocks are recomputed", type(e).__name__, e)
            restored = 0
        load.restored = restored
        for block, target in zip(load.fresh[:restored], load.targets):
            self.kv.pool.cache_block(block, target.block_hash, target.key)
        self.kv.pool.free(reversed([*load.held, *load.fresh]))
        self.tier.complete_load(load.targets[:restored])
        self._finish_state_load(load)

    def _finish_state_load(self, load: PendingLoad) -> None:
        """The snapshot part of a done restore: usable from its slot now, or (not restored) its slot freed."""
        target, future, snapshots = load.state_target, load.state_future, self.kv.state_snapshots
        if target is None or future is None or snapshots is None:
            return
        try:
            ok = future.result() == 1
        except Exception as e:  # noqa: BLE001 -- a failed copy restores nothing; the state is recomputed
            logger.warning("KV offload: a state snapshot restore failed (%s: %s)", type(e).__name__, e)
            ok = False
        snapshots.loaded(target.block_hash, ok)
        if ok and self.state_tier is not None:
            self.state_tier.complete_load([target])

    def record_admission(self, request: KVRequest, num_hit_tokens: int, load: PendingLoad | None) -> int:
        """Count a request's first admission in vLLM's external prefix cache counters; returns the tokens of its hit
        the tier restored (the rest came from the pool)."""
        restored = 0 if load is None else max(0, num_hit_tokens - load.pool_hit_tokens)
        self.external_queries_tokens += request.num_tokens - (num_hit_tokens - restored)
        self.external_hits_tokens += restored
        return restored

    def retain(self, request: KVRequest, seconds: float) -> None:
        """The request's prompt blocks, as the tier stores them (every full-attention block, a sliding group's last
        window), and a hybrid model's state snapshots along its tokens (its reply's last included), are kept in the
        tier for `seconds` from now (OpenAI's prompt_cache_retention). Called as the request finishes, before its
        hashes are dropped."""
        now = time.time()
        until, tenant = now + seconds, salt_key(request.cache_salt)
        budgets = self.retention or (None, None)
        keys = self.write_through.prompt_keys(request)
        if budgets[0] is not None:
            keys = budgets[0].admit(tenant, keys, until, now)
        if keys:
            self.tier.retain(keys, until)
        if self.state_tier is not None:  # and the state snapshots a hit on the request's tokens would start from
            state_keys = self.write_through.snapshot_keys(request)
            if budgets[1] is not None:
                state_keys = budgets[1].admit(tenant, state_keys, until, now)
            if state_keys:
                self.state_tier.retain(state_keys, until)

    @property
    def retention_capped(self) -> int:
        """Tier records a retention asked for past its budgets (RetentionBudget), since start."""
        return sum(b.capped for b in self.retention or () if b is not None)

    def cancel(self, request_id: str) -> None:
        """The request left: a restore in flight for it is cancelled; its blocks are released once the copy into
        them has stopped (reap_orphan_loads)."""
        load = self.loads.pop(request_id, None)
        if load is not None:
            load.cancelled.set()
            self.orphan_loads.append(load)

    def reap_orphan_loads(self) -> None:
        """Release the restores of requests that left while their copy ran, once the copy has stopped."""
        if self.orphan_loads:
            # Each load asked once: a copy ending between two looks was neither finished nor kept, and its blocks
            # stayed referenced with no holder (the fuzzer, seed 30435, only under load).
            ended = [load.done() for load in self.orphan_loads]
            done = [load for load, end in zip(self.orphan_loads, ended) if end]
            self.orphan_loads = [load for load, end in zip(self.orphan_loads, ended) if not end]
            for load in done:
                self.finish_load(load)

    def load_futures(self) -> list[Future[int]]:
        futures = []
        for load in (*self.loads.values(), *self.orphan_loads):
            futures.append(load.future)
            if load.state_future is not None:
                futures.append(load.state_future)
        return futures

    def held_blocks(self) -> list[KVCacheBlock]:
        """The pool blocks the restores in flight hold (invariant checks): those not given back yet."""
        loads = (*self.loads.values(), *self.orphan_loads)
        return [b for load in loads if load.restored < 0 for b in (*load.held, *load.fresh)]

    # ---- stores ----------------------------------------------------------------------------------------

    def on_step_done(self, scheduled: Sequence[Computed], num_prompt_tokens: int, seconds: float) -> None:
        """After a step that succeeded: hand the tier the blocks and snapshots it completed (write-through, before any
        of them can be reused) and feed the restore cost model the step's prefill rate."""
        self.write_through.step_done(scheduled)
        self.cost.observe_step(num_prompt_tokens, seconds)

    def on_step_failed(self) -> None:
        """The step failed: what it computed may be partial, so nothing of it is stored (its saved snapshots are
        dropped; the engine drops the prefix cache, so no later step stores its blocks either)."""
        if self.kv.state is not None:
            self.kv.state.take_saved()

    def request_leaving(self, request: KVRequest) -> None:
        """The request is about to let go of its blocks (finished or preempted): store what only it holds that a
        next turn would hit (WriteThrough.leaving)."""
        self.write_through.leaving(request)
