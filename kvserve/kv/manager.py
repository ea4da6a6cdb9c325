"""KVCacheManager: which blocks each request holds in each KV cache group, prefix lookups, and growth on demand."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.kv.block import KVCacheBlock, TierBlock
from kvserve.kv.groups import KVCacheLayout, make_kv_cache_layout
from kvserve.kv.hashing import BlockHasher, BlockKey, salt_key
from kvserve.kv.misses import MissCounts, PrefixMiss, SeenBlocks, common_prefix
from kvserve.kv.pins import PinOutcome, PinTable
from kvserve.kv.pool import BlockPool
from kvserve.kv.state import SNAPSHOT_INTERVAL_BLOCKS, StateSlots, StateSnapshots
from kvserve.units import cdiv

if TYPE_CHECKING:
    from kvserve.sampling_params import KVPin

# Per KV cache group, the blocks of a request's table: a sliding group's entries before its window are the null block.
GroupBlocks = list[list[KVCacheBlock]]
# has(group_id, block index) -> whether that group can serve that block of a request (a prefix-hit search's question).
HasBlock = Callable[[int, int], bool]


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
class RequestTables:
    """One request's blocks: a table per KV cache group (all equally long: one entry per block of its tokens), and per
    group how many leading entries are already the null block (blocks given back as the request moved past them)."""

    tables: GroupBlocks
    skipped: list[int]
    num_published: int = 0  # leading blocks whose hashes are published to the prefix cache

    @property
    def num_entries(self) -> int:
        return len(self.tables[0])


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
    ) -> None:
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        self.layout = layout or make_kv_cache_layout([None])
        if reserve_tokens and self.layout.is_hybrid:
            raise ValueError("reserving tokens per request emulates a contiguous cache: it needs the uniform layout")
        if pool.num_groups != self.layout.num_groups:
            raise ValueError(f"a pool of {pool.num_groups} groups cannot serve {self.layout.num_groups}")
        self.pool = pool
        # A hybrid model's state layers (kv/state.py): each scheduled request holds one slot, taken with its first
        # blocks and given back with them.
        self.state_slots = state_slots
        # Their states at block boundaries, for prefix hits (kv/state.py); None: no prefix hits for such a model. The
        # copies the runner makes around the next step: (snapshot, request slot) before it, (request slot, snapshot)
        # after it; each request's latest snapshot in its reply (replaced by the next one); and per request, the
        # blocks its last lookup found cached past its longest snapshot (a hit cut short for lack of one).
        self.state_snapshots = state_snapshots
        self.snapshot_interval_blocks = SNAPSHOT_INTERVAL_BLOCKS
        self.state_restores: list[tuple[int, int]] = []
        self.state_saves: list[tuple[int, int]] = []
        self.state_save_hashes: list[bytes] = []  # the snapshots state_saves writes, pending until the step ran
        self.saving: list[bytes] = []  # those the runner took for the step now running
        # With an offload tier (kv/offload/connector.py): the prompt snapshots state_saves writes, as the tier keys
        # them (group: the one past the KV cache groups; block id: the snapshot slot); those the running step saves;
        # those saved, for the tier once the step succeeded; and how a leaving request's reply snapshot is stored.
        self.state_save_blocks: list[TierBlock] = []
        self.saving_blocks: list[TierBlock] = []
        self.state_to_offload: list[TierBlock] = []
        self.store_states_now: Callable[[list[TierBlock]], None] | None = None
        self.reply_snapshot: dict[str, bytes] = {}
        self.snapshot_cut: dict[str, int] = {}
        self.block_size = block_size
        self.reserve_tokens = reserve_tokens
        self.hasher = BlockHasher(hash_algo)
        self.num_groups = self.layout.num_groups
        self.full_groups = [g.group_id for g in self.layout.full_groups]
        # Sliding groups by window: (blocks a hit needs before its end, the groups of that window).
        windows: dict[int, list[int]] = {}
        for g in self.layout.sliding_groups:
            windows.setdefault(g.spec.hit_blocks(block_size) or 0, []).append(g.group_id)
        self.sliding_hit_groups = list(windows.items())
        self.specs = [g.spec for g in self.layout.groups]
        self.requests: dict[str, RequestTables] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        self.prefix_stats = PrefixCacheStats()
        # Blocks published this step, for the KV offload tier once the step succeeds; collected only while a tier is
        # attached (kv/offload/connector.py sets both). `store_now` takes a leaving request's last windows (below).
        self.collect_published = False
        self.to_offload: list[TierBlock] = []
        self.store_now: Callable[[list[TierBlock]], None] | None = None
        # Pinned prefixes (kv/pins.py); by default at most half the pool's blocks.
        budget = pool.num_usable_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        self.pins = PinTable(pool, budget, pool.clock)
        if state_snapshots is not None:  # a pinned prefix keeps its state snapshot as it keeps its blocks
            state_snapshots.protected = self.pins.pins.__contains__
        # What was seen, for "why did this request miss?" (kv/misses.py): twice the pool's blocks of history.
        self.seen = SeenBlocks(max(2 * pool.num_usable_blocks, 4096))
        self.unsalted_hashes: dict[str, list[bytes]] = {}  # salted requests' block hashes without the salt
        self.miss_counts = MissCounts()

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def null_block(self) -> KVCacheBlock:
        return self.pool.null_block

    def _extra_keys(self, request: KVRequest) -> bytes:
        return salt_key(request.cache_salt)

    def hashes(self, request: KVRequest, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first num_tokens tokens; only blocks not hashed before cost work,
        each O(block_size)."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        num_tokens = min(num_tokens, request.num_tokens)
        return self.hasher.extend(request.token_slice, num_tokens, self.block_size, hashes, self._extra_keys(request))

    def key(self, request: KVRequest, hashes: list[bytes], index: int) -> BlockKey:
        """What block `index` of the request holds, as a prefix hit compares it."""
        bs = self.block_size
        tokens = tuple(request.token_slice(index * bs, (index + 1) * bs))
        return BlockKey(hashes[index - 1] if index else None, tokens, self._extra_keys(request))

    def reads_prefix_cache(self, request: KVRequest) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    # ---- prefix hits -----------------------------------------------------------------------------------

    def longest_hit(self, num_blocks: int, has: HasBlock) -> int:
        """The longest prefix, in blocks (at most num_blocks), that every group can serve: a full-attention group
        needs each of its blocks, a sliding group the blocks before the hit point that its window covers (vLLM's
        hybrid rule). Each kind's answer may shorten the prefix for the others, so the search repeats until no group
        shortens it; the prefix only shrinks, so it ends."""
        length = num_blocks
        for i in range(num_blocks):
            if not all(has(g, i) for g in self.full_groups):
                length = i
                break
        changed = True
        while changed:
            changed = False
            for need, groups in self.sliding_hit_groups:
                found = _sliding_hit(groups, need, length, has)
                if found < length:
                    length, changed = found, True
        return length

    def hit_start(self, group_id: int, length: int) -> int:
        """The first block a prefix hit of `length` blocks needs in this group: 0 for full attention, the start of
        the window before the hit point for a sliding group."""
        need = self.specs[group_id].hit_blocks(self.block_size)
        return 0 if need is None else max(0, length - need)

    def hit_blocks(self, length: int, block_of: Callable[[int, int], KVCacheBlock]) -> GroupBlocks:
        """Per group, the table of a prefix hit of `length` blocks: every block for a full-attention group, null
        entries then the window's blocks for a sliding group. block_of(group, index) gives a served block."""
        out: GroupBlocks = []
        for g in range(self.num_groups):
            first = self.hit_start(g, length)
            out.append([self.null_block] * first + [block_of(g, i) for i in range(first, length)])
        return out

    def get_computed_blocks(self, request: KVRequest) -> tuple[GroupBlocks, int]:
        """The longest prefix of the request's tokens the pool's cached blocks serve in every group, as per-group
        tables, and its length in tokens. Never covers the last token, whose logits must be computed; skipped when
        prompt logprobs need every position's logits. A lookup only: it counts nothing, since a request that cannot
        be admitted looks up again next step."""
        if not self.reads_prefix_cache(request):
            return [[] for _ in range(self.num_groups)], 0
        hashes = self.hashes(request, request.num_tokens - 1)
        found: dict[tuple[int, int], KVCacheBlock] = {}
        keys: dict[int, BlockKey] = {}

        def has(g: int, i: int) -> bool:
            if (g, i) not in found:
                if i not in keys:
                    keys[i] = self.key(request, hashes, i)
                block = self.pool.lookup(hashes[i], keys[i], g)
                if block is None:
                    return False
                found[g, i] = block
            return True

        length = self.longest_hit(len(hashes), has)
        if self.state_slots is not None:
            snapshots = self.state_snapshots
            state_length = self.longest_state_hit(
                length, has, lambda i: snapshots is not None and hashes[i] in snapshots
            )
            self.snapshot_cut[request.request_id] = length - state_length  # for misses: what the snapshots cut off
            length = state_length
        return self.hit_blocks(length, lambda g, i: found[g, i]), length * self.block_size

    def keep_state_hit(self, request: KVRequest) -> None:
        """Mark the state snapshot a waiting request would start from as the most recently used, so that the saves of
        the steps it waits through overwrite others first: a request queued behind others (--max-num-partial-prefills,
        --max-num-seqs) kept losing its snapshot to theirs when slots were few (Qwen3.5's 39 in 3 GiB)."""
        if self.state_snapshots is None:
            return
        _, num_hit = self.get_computed_blocks(request)
        if num_hit:
            self.state_snapshots.use(self.hashes(request, num_hit)[num_hit // self.block_size - 1])

    def longest_state_hit(self, length: int, has: HasBlock, has_snapshot: Callable[[int], bool]) -> int:
        """A model with state layers hits only where a state snapshot ends a prefix the groups can serve: the longest
        such prefix of at most `length` blocks. has_snapshot(i): a snapshot ends at block i (the pool's, or for a
        restore the offload tier's too)."""
        while length and (not has_snapshot(length - 1) or self.longest_hit(length, has) < length):
            length -= 1
        return length

    def evicted_misses(self, request: KVRequest, num_hit_tokens: int) -> int:
        """The tokens after the request's hits whose blocks the pool evicted shortly before (its ghost list): hits
        lost to eviction. Asked before the request's allocation, which re-publishes the blocks it computes."""
        ghosts = self.pool.recently_evicted
        if not ghosts or not self.reads_prefix_cache(request):
            return 0
        lost = 0
        for block_hash in self.hashes(request, request.num_tokens - 1)[num_hit_tokens // self.block_size :]:
            if block_hash not in ghosts:
                break
            lost += 1
        return lost * self.block_size

    def record_prefix_query(self, request: KVRequest, num_hit_tokens: int, num_evicted_misses: int = 0) -> None:
        """Count one prefix-cache query of request.num_tokens tokens, num_hit_tokens of them hits. The
        scheduler calls it once per request, when its first admission has its blocks; lookups retried while
        the request waits, and re-admissions after preemption, would otherwise inflate the queries and skew
        the hit rate exactly when the server is under pressure (vLLM fixed the same bug)."""
        if self.reads_prefix_cache(request):
            self.prefix_stats.record(request.num_tokens, num_hit_tokens)
            self.prefix_stats.evicted_misses_total += num_evicted_misses

    # ---- allocation ------------------------------------------------------------------------------------

    def _entries_for(self, num_tokens: int) -> int:
        """Table entries (per group) of a request of num_tokens tokens: just enough, or its whole reservation."""
        return cdiv(max(num_tokens, self.reserve_tokens), self.block_size)

    def can_fit(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Whether the pool can give the request blocks for num_new_tokens (+ lookahead) more tokens after the prefix
        hit `new_computed_blocks` (reviving those of its blocks that sit free). A query: it changes nothing."""
        state = self.requests.get(request.request_id)
        hit = new_computed_blocks or [[] for _ in range(self.num_groups)]
        num_tokens = request.num_computed_tokens + len(hit[0]) * self.block_size + num_new_tokens + num_lookahead_tokens
        entries = self._entries_for(num_tokens)
        held = state.num_entries if state is not None else 0
        needed = self.num_groups * max(entries - held - len(hit[0]), 0)
        revived = sum(1 for blocks in hit for b in blocks if b.ref_cnt == 0 and b is not self.null_block)
        return needed + revived <= self.pool.num_free_blocks

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
        whether or not the rest fits (vLLM's order: fewer blocks are then evicted for the new ones). Returns False,
        changing nothing more, when the pool cannot supply the new blocks."""
        rid = request.request_id
        state = self.requests.get(rid)
        if state is not None and self.sliding_hit_groups:
            self._free_skipped(request, state)
        while not self.can_fit(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens):
            if not self.pins.release_oldest():  # pins yield to live requests before anyone is refused or preempted
                return False
        if self.state_slots is not None and self.state_slots.acquire(rid) is None:
            return False
        if state is None:
            state = self.requests[rid] = RequestTables([[] for _ in range(self.num_groups)], [0] * self.num_groups)
        hit_len = 0
        if new_computed_blocks and new_computed_blocks[0]:
            if state.num_entries:
                raise ValueError(f"request {rid} already holds blocks; prefix hits come first")
            hit_len = len(new_computed_blocks[0])
            self.pins.refresh(self.req_hashes.get(rid, [])[:hit_len])
            for g, blocks in enumerate(new_computed_blocks):
                self.pool.touch(b for b in blocks if b is not self.null_block)
                state.tables[g].extend(blocks)
                state.skipped[g] = sum(1 for b in blocks if b is self.null_block)
            state.num_published = hit_len
        num_tokens = request.num_computed_tokens + hit_len * self.block_size + num_new_tokens
        needed = self._entries_for(num_tokens + num_lookahead_tokens) - state.num_entries
        if needed > 0:
            for g, table in enumerate(state.tables):
                table.extend(self.pool.allocate(needed, g))
        self._publish(request, state, num_tokens)
        if self.state_snapshots is not None:
            self._plan_state_copies(request, hit_len, num_tokens)
        return True

    def _plan_state_copies(self, request: KVRequest, hit_len: int, num_tokens: int) -> None:
        """The state copies around the request's next step: its slot filled from the snapshot its prefix hit of
        `hit_len` blocks ends at, before; after, when the step ends on a block boundary, that state saved as the
        snapshot of the boundary's block (in the reply, replacing the request's previous one there); one at a chunk
        end that is no snapshot point (`_is_snapshot_point`) is the first to be overwritten."""
        snapshots, rid, bs = self.state_snapshots, request.request_id, self.block_size
        assert snapshots is not None and self.state_slots is not None
        slot = self.state_slots.slot_of(rid)
        assert slot is not None  # allocate_slots acquired it
        if hit_len:
            source = snapshots.use(self.req_hashes[rid][hit_len - 1])
            if source is None:
                raise ValueError(f"request {rid}: the state snapshot of its prefix hit is gone")
            self.state_restores.append((source, slot))
            snapshots.num_restored += 1
        if not self.enable_caching or num_tokens % bs or num_tokens > request.num_tokens:
            return
        hashes = self.hashes(request, num_tokens)
        index = num_tokens // bs - 1
        key = self.key(request, hashes, index)
        block_hash = hashes[index]
        if num_tokens > request.num_prompt_tokens:  # a boundary inside the reply: the next chat turn starts here
            # The reply's previous snapshot goes first, so that its slot takes the new one: reserved first, the new
            # one overwrote the least recently used snapshot (another conversation's) every 16 tokens of a reply.
            previous = self.reply_snapshot.get(rid)
            if previous is not None and previous != block_hash:
                snapshots.drop(previous)
            self.reply_snapshot[rid] = block_hash
        target = snapshots.reserve(block_hash, key, lasting=self._is_snapshot_point(request, num_tokens))
        if target is not None:
            self.state_saves.append((slot, target))
            self.state_save_hashes.append(block_hash)
            if self.collect_published and num_tokens <= request.num_prompt_tokens:  # a reply's: stored as it ends
                self.state_save_blocks.append(TierBlock(target, block_hash, key, self.state_group))

    def state_chunk(self, request: KVRequest, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` a model with state snapshots computes in this step, so that the
        step ends where a snapshot is worth taking (`_snapshot_stops`), and otherwise, for a chunk that does not reach
        the end of the request's tokens, at the chunk's last block boundary (vLLM's aligned chunks). Unchanged without
        snapshots, or when the cut would leave nothing."""
        if self.state_snapshots is None or not self.enable_caching:
            return num_new
        end = start + num_new
        cut = min((s for s in self._snapshot_stops(request, start) if start < s < end), default=None)
        if cut is not None:
            return cut - start
        aligned = end // self.block_size * self.block_size
        if end < request.num_tokens and aligned > start:
            return aligned - start
        return num_new

    def _snapshot_stops(self, request: KVRequest, start: int) -> list[int]:
        """The prompt positions past `start` where a state snapshot is worth taking: the next multiple of
        `snapshot_interval_blocks` blocks (a long prompt leaves a snapshot every interval: a later prompt sharing only
        its start, a system prompt, hits at the last one before they part), the prompt's own hit point (its last block
        boundary before its last token: the same prompt sent again hits there), and each cache_control mark's last
        block boundary (its pin needs a state to restore, and keeps it: StateSnapshots never evicts a pinned
        prefix's)."""
        bs = self.block_size
        interval = self.snapshot_interval_blocks * bs
        stops = [(start // interval + 1) * interval, (request.num_prompt_tokens - 1) // bs * bs]
        return stops + [m // bs * bs for m in request.cache_marks]

    def _is_snapshot_point(self, request: KVRequest, num_tokens: int) -> bool:
        """Whether the snapshot of a step that ends at `num_tokens` (a block boundary) is one a later request is
        likely to start from: at a stop, at the prompt's end, and in the reply (the next chat turn starts there). One
        at the end of a chunk the token budget cut elsewhere is saved too, but overwritten first (a preempted request
        resumes there, or a prompt that parts there; measured: saved like the others, the chunk ends of 8 prompts
        under --max-num-batched-tokens 256 pushed 7 of their 8 prompt-end snapshots out of 32 slots)."""
        return num_tokens >= request.num_prompt_tokens or num_tokens in self._snapshot_stops(request, num_tokens - 1)

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The state copies planned for the next step: (restores before it, saves after it), each (from, to) slots."""
        copies = (self.state_restores, self.state_saves)
        self.saving, self.saving_blocks = self.state_save_hashes, self.state_save_blocks
        self.state_restores, self.state_saves, self.state_save_hashes, self.state_save_blocks = [], [], [], []
        return copies

    def state_saves_done(self) -> None:
        """The runner saved the snapshots it took (take_state_copies): prefix hits may start from them now."""
        if self.state_snapshots is not None:
            self.state_snapshots.saved(self.saving)
        self.state_to_offload += self.saving_blocks
        self.saving, self.saving_blocks = [], []

    @property
    def state_group(self) -> int:
        """The group index of state snapshots in KV events and the offload tier: the one past the KV cache groups."""
        return self.num_groups

    def take_state_offload(self) -> list[TierBlock]:
        """The prompt snapshots saved since the last call (the step that computed them succeeded: the tier may copy
        them)."""
        blocks, self.state_to_offload = self.state_to_offload, []
        return blocks

    def _offload_reply_snapshot(self, request: KVRequest) -> None:
        """A request lets go of its state: the snapshot of its reply's latest boundary (where the next chat turn
        starts) goes to the tier now, while its slot still holds it."""
        snapshots = self.state_snapshots
        block_hash = self.reply_snapshot.get(request.request_id)
        if self.store_states_now is None or snapshots is None or block_hash is None:
            return
        slot = snapshots.slot_of(block_hash)
        if slot is not None:
            self.store_states_now([TierBlock(slot, block_hash, snapshots.keys[block_hash], self.state_group)])

    def _free_skipped(self, request: KVRequest, state: RequestTables) -> None:
        """Give back, in each sliding group, the blocks before the window of the request's next query (their
        table entries become the null block). Hashed ones stay revivable, in the pool's spent queue: evicted before
        other cached blocks (BlockPool)."""
        for g, spec in enumerate(self.specs):
            first = min(spec.first_needed_block(request.num_computed_tokens, self.block_size), state.num_entries)
            table = state.tables[g]
            skipped = [table[i] for i in range(state.skipped[g], first) if table[i] is not self.null_block]
            for i in range(state.skipped[g], first):
                table[i] = self.null_block
            state.skipped[g] = max(state.skipped[g], first)
            if skipped:
                self.pool.free(skipped, spent=True)

    def rollback(self, request: KVRequest) -> None:
        """After verification: return the blocks past the request's tokens (those held only rejected drafts'
        K/V) to the pool. The slots of rejected drafts inside a kept block are simply overwritten when real
        tokens reach them; such a block was never published (`allocate_slots` publishes real tokens only), and
        is published only in the step that computes its last real token."""
        state = self.requests.get(request.request_id)
        if state is None:
            return
        keep = self._entries_for(request.num_tokens)
        for table in state.tables:
            if len(table) > keep:
                tail = [b for b in table[keep:] if b is not self.null_block]
                del table[keep:]
                self.pool.free(reversed(tail))

    def _publish(self, request: KVRequest, state: RequestTables, num_tokens: int) -> None:
        """Hash the request's blocks that are full once `num_tokens` tokens are computed, in every group.

        This happens at allocation, before the step computes them, as in vLLM: a request scheduled later
        in the same step (a sibling of an n > 1 request, or a batch sharing a system prompt) can then
        share the blocks at once. It is safe because every layer writes the whole batch's new K/V before
        any query reads the cache, and the scheduler never preempts a request it already scheduled in the
        same step. If a step fails, the engine drops the prefix cache (reset_prefix_cache).

        A block that becomes its group's cached block for its hash is queued for the offload tier (once the step
        succeeds); a private duplicate of a block cached already (a sibling's, a concurrent identical prompt's) is
        not, so the tier stores each (group, hash) once. Of a sliding group, only the blocks a restore can use are
        stored (see offload_window): a restore needs a sliding group's window before its hit point only, so the
        tier keeps about the full-attention groups' share of a long prompt (Gemma 3: 1/6 of every layer's)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, state.num_entries)
        start = state.num_published
        if num_full <= start:
            return
        hashes = self.hashes(request, num_full * self.block_size)
        unsalted = self._unsalted(request, num_full * self.block_size)
        prompt_end = (request.num_prompt_tokens - 1) // self.block_size  # where the same prompt, sent again, hits
        for i in range(start, num_full):
            key = self.key(request, hashes, i)
            self.seen.add(hashes[i], key, unsalted[i])
            for g, table in enumerate(state.tables):
                block = table[i]
                if block is self.null_block:
                    continue
                cached = self.pool.cache_block(block, hashes[i], key)
                if cached and self.collect_published and self._offloads(g, i, prompt_end):
                    self.to_offload.append(TierBlock(block.block_id, hashes[i], key, g))
        state.num_published = num_full

    def _offloads(self, group_id: int, index: int, hit_point: int) -> bool:
        """Whether block `index` of a group goes to the offload tier as it is published: every block of a
        full-attention group; of a sliding group, those of its window before `hit_point` (the end of the prompt)."""
        return not self.specs[group_id].is_sliding or self.hit_start(group_id, hit_point) <= index < hit_point

    def _offload_last_windows(self, request: KVRequest, state: RequestTables) -> None:
        """A request lets go of its blocks: each sliding group's window before the end of its computed full blocks
        (where the next turn of its conversation hits) goes to the tier now, while the blocks still hold it."""
        if self.store_now is None or not self.sliding_hit_groups:
            return
        end = min(request.num_computed_tokens // self.block_size, state.num_published)
        hashes = self.req_hashes.get(request.request_id, [])
        blocks = []
        for g, table in enumerate(state.tables):
            if not self.specs[g].is_sliding:
                continue
            for i in range(self.hit_start(g, end), min(end, len(hashes))):
                block = table[i]
                if block.block_hash == hashes[i] and self.pool.cached[g].get(hashes[i]) is block and block.key:
                    blocks.append(TierBlock(block.block_id, hashes[i], block.key, g))
        if blocks:
            self.store_now(blocks)

    def prompt_tier_keys(self, request: KVRequest) -> list[tuple[int, bytes]]:
        """(group, hash) of the request's whole prompt blocks that the offload tier stores (see _offloads)."""
        hashes = self.req_hashes.get(request.request_id, [])
        prompt_end = (request.num_prompt_tokens - 1) // self.block_size
        n = min(len(hashes), request.num_prompt_tokens // self.block_size)
        return [(g, hashes[i]) for g in range(self.num_groups) for i in range(n) if self._offloads(g, i, prompt_end)]

    def state_tier_keys(self, request: KVRequest) -> list[tuple[int, bytes]]:
        """(state group, hash) of the state snapshots saved along the request's tokens, as the offload tier stores
        them; its reply's last snapshot is handed to the tier first (it is otherwise stored as the request lets go
        of its slot, after a retention would have looked for it)."""
        snapshots = self.state_snapshots
        if snapshots is None:
            return []
        self._offload_reply_snapshot(request)
        hashes = self.req_hashes.get(request.request_id, [])
        return [(self.state_group, h) for h in hashes if h in snapshots]

    def take_offload(self) -> list[TierBlock]:
        """The blocks published since the last call (the step that computed them succeeded: the tier may copy them)."""
        blocks, self.to_offload = self.to_offload, []
        return blocks

    # ---- what requests hold ----------------------------------------------------------------------------

    def state_slot(self, request: KVRequest) -> int:
        """The state slot a scheduled request holds (allocate_slots gave it one)."""
        slot = None if self.state_slots is None else self.state_slots.slot_of(request.request_id)
        if slot is None:
            raise KeyError(f"request {request.request_id} holds no state slot")
        return slot

    def block_ids(self, request: KVRequest, group_id: int = 0) -> list[int]:
        """The request's table in one group, as block ids (the null block's id before a sliding window)."""
        state = self.requests.get(request.request_id)
        return [] if state is None else [b.block_id for b in state.tables[group_id]]

    def table_tail(self, request: KVRequest, group_id: int) -> tuple[int, list[int]]:
        """The request's table in one group as (leading null entries, block ids of the entries after them): a sliding
        group's table is mostly null entries at a long context, and the runner builds each step's tables from the
        tails (AttentionMetadata.build's leading_nulls), so its work per sliding group follows the window."""
        state = self.requests.get(request.request_id)
        if state is None:
            return 0, []
        lead = state.skipped[group_id]
        return lead, [b.block_id for b in state.tables[group_id][lead:]]

    def group_tables(self, request_id: str) -> GroupBlocks:
        """The request's tables, one per group (empty lists when it holds nothing)."""
        state = self.requests.get(request_id)
        return [[] for _ in range(self.num_groups)] if state is None else state.tables

    def num_blocks_held(self, request: KVRequest) -> int:
        """Pool blocks the request holds, all groups together (null entries are not blocks)."""
        state = self.requests.get(request.request_id)
        if state is None:
            return 0
        return sum(len(t) - sum(1 for b in t if b is self.null_block) for t in state.tables)

    def num_tokens_held(self, request: KVRequest) -> int:
        """Token slots the request's tables cover (the same in every group)."""
        state = self.requests.get(request.request_id)
        return 0 if state is None else state.num_entries * self.block_size

    def held_blocks(self) -> list[tuple[str, int, KVCacheBlock]]:
        """Every (request id, group, block) reference that requests hold, null entries left out (invariant checks,
        the inspector)."""
        return [
            (rid, g, b)
            for rid, state in self.requests.items()
            for g, table in enumerate(state.tables)
            for b in table
            if b is not self.null_block
        ]

    def free(self, request: KVRequest) -> None:
        """Return the request's blocks, each group's last block first so that a sequence's tail is evicted before
        its shareable head (with an offload tier, its sliding groups' last windows are stored first). Freeing an
        unknown or already freed request does nothing."""
        if self.state_slots is not None:
            self.state_slots.release(request.request_id)
            self._offload_reply_snapshot(request)
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return
        self._offload_last_windows(request, state)
        for table in state.tables:
            self.pool.free(reversed([b for b in table if b is not self.null_block]))

    # ---- pins ------------------------------------------------------------------------------------------

    def pin_prefix(self, request: KVRequest, pins: Sequence[KVPin]) -> tuple[PinOutcome, ...]:
        """Pin the prefixes `pins` ask for, as far as the request computed and cached them (whole blocks): every block
        of a full-attention group, the window before the prefix's end of a sliding group (what a hit needs). Called
        as the request finishes, before its blocks are freed; what became of each, for the response."""
        state = self.requests.get(request.request_id)
        if not pins:
            return ()
        if state is None or not self.enable_caching:
            return tuple(PinOutcome(0, "not_cached") for _ in pins)
        hashes = self.req_hashes.get(request.request_id, [])
        computed = min(request.num_computed_tokens // self.block_size, state.num_published, len(hashes))
        outcomes = []
        for pin in pins:
            length = min(pin.num_tokens // self.block_size, computed)
            blocks = self._cached_prefix(hashes, length) if length else []
            if blocks:
                outcomes.append(self.pins.pin(hashes[length - 1], blocks, length * self.block_size, pin.ttl_s))
            else:
                outcomes.append(PinOutcome(0, "not_cached"))
        return tuple(outcomes)

    def _cached_prefix(self, hashes: list[bytes], length: int) -> list[KVCacheBlock]:
        """The cached blocks a hit of `length` blocks needs, every group; [] if one is missing (not cached)."""
        blocks = []
        for g in range(self.num_groups):
            for i in range(self.hit_start(g, length), length):
                block = self.pool.cached[g].get(hashes[i])
                if block is None:
                    return []
                blocks.append(block)
        return blocks

    def expire_pins(self) -> int:
        return self.pins.expire()

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache, pins first (their blocks hold no prefix afterwards), and the state snapshots with the
        copies planned for a step that did not run (a failed step's saves would name states never saved)."""
        self.pins.clear()
        self.pool.reset_prefix_cache()
        if self.state_snapshots is not None:
            self.state_snapshots.clear()
            self.state_restores, self.state_saves, self.state_save_hashes, self.saving = [], [], [], []
            self.state_save_blocks, self.saving_blocks, self.state_to_offload = [], [], []
            self.reply_snapshot.clear()

    def forget(self, request: KVRequest) -> None:
        """Drop per-request bookkeeping once a request is gone for good."""
        self.free(request)
        self.req_hashes.pop(request.request_id, None)
        self.unsalted_hashes.pop(request.request_id, None)
        self.reply_snapshot.pop(request.request_id, None)
        self.snapshot_cut.pop(request.request_id, None)

    # ---- why a prefix hit stopped ----------------------------------------------------------------------

    def _unsalted(self, request: KVRequest, num_tokens: int) -> list[bytes]:
        """The request's block hashes as if it had no cache salt (its own hashes when it has none)."""
        if not request.cache_salt:
            return self.hashes(request, num_tokens)
        known = self.unsalted_hashes.setdefault(request.request_id, [])
        return self.hasher.extend(request.token_slice, min(num_tokens, request.num_tokens), self.block_size, known)

    def classify_miss(
        self, request: KVRequest, num_hit_tokens: int, rejected: frozenset[bytes] = frozenset()
    ) -> PrefixMiss | None:
        """Why the request's prefix hit of `num_hit_tokens` stopped there (kv/misses.py), or None when it served
        every block a hit can (or the request does not read the cache). `rejected`: hashes whose tier records a
        restore refused. Asked at the first admission, before allocation publishes the request's own blocks."""
        if not self.reads_prefix_cache(request):
            return None
        hashes = self.hashes(request, request.num_tokens - 1)
        k = num_hit_tokens // self.block_size
        if k >= len(hashes):
            return None
        block_hash, at = hashes[k], k * self.block_size
        extra = self._extra_keys(request)
        if not rejected.isdisjoint(hashes[k:]):  # the restore stopped at a refused record: every group's hit with it
            return PrefixMiss("tier_record_failed_check", at)
        if self.snapshot_cut.get(request.request_id, 0):
            return PrefixMiss("no_state_snapshot", at)
        full = self.full_groups
        if self.sliding_hit_groups and full and all(self.pool.is_cached(block_hash, g) for g in full):
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
            mine = request.token_slice(at, at + self.block_size)
            same = max(common_prefix(mine, s.token_ids) for s in siblings)
            # Whole blocks in common, or half a block at least: a prompt that shares only a BOS token or a chat
            # template's header with others was never seen, it did not diverge.
            if at > 0 or 2 * same >= self.block_size:
                return PrefixMiss("diverged", at, diverged_at_token=at + same)
        if self.seen.seen_under_other_salt(self._unsalted(request, (k + 1) * self.block_size)[k], extra):
            return PrefixMiss("different_cache_salt", at)
        return PrefixMiss("never_seen", at)


def _sliding_hit(groups: Sequence[int], need: int, max_blocks: int, has: HasBlock) -> int:
    """The longest prefix of at most max_blocks blocks after which every group in `groups` holds the `need` blocks
    before its end (or all blocks from the first, for a shorter prefix): scanned from the end, a run of `need`
    consecutive served blocks ending at L makes L the hit (vLLM's SlidingWindowManager)."""
    if need == 0:
        return max_blocks
    run = 0
    for i in range(max_blocks - 1, -1, -1):
        if all(has(g, i) for g in groups):
            run += 1
            if run >= need:
                return i + need
        else:
            run = 0
    return run
