"""KVCacheCoordinator: a request's block tables across the KV cache groups, and the one prefix-hit rule over every layer
kind (vLLM's HybridKVCacheCoordinator): full-attention groups, sliding windows and state snapshots.

The hit search is one right-to-left scan. Full attention serves blocks 0-9 (L0 = 10), a sliding group whose hit needs
the 2 blocks before its end lacks block 7, and state snapshots end at blocks 3 and 7:

    candidate L        10      9       7       6       5       4
    window [L-2, L)    8-9 ok  7 gap   5-6 ok  4-5 ok  3-4 ok  2-3 ok
    snapshot at L-1    no      -       no      no      no      yes: a hit of 4 blocks

(9's window holds the missing block 7, so the walk goes straight to 7: no candidate in between can hold a whole
window.) Each block is asked about once per window (WindowScan), so a lookup is linear in the prefix; it re-ran the
whole search for every shorter candidate (quadratic).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvserve.kv.block import KVCacheBlock
from kvserve.kv.groups import KVCacheLayout
from kvserve.kv.pool import BlockPool
from kvserve.kv.single_type import SingleTypeKVCacheManager, WindowScan, manager_for
from kvserve.units import cdiv

# Per KV cache group, the blocks of a request's table: a sliding group's entries before its window are the null block.
GroupBlocks = list[list[KVCacheBlock]]
# has(group_id, block index) -> whether that group can serve that block of a request (a prefix-hit search's question).
HasBlock = Callable[[int, int], bool]


@dataclass(slots=True)
class RequestTables:
    """One request's blocks: a table per KV cache group (all equally long: one entry per block of its tokens), and per
    group how many leading entries are already the null block (blocks given back as the request moved past them: the
    group's first_needed_block as of the last free_skipped, vLLM's skipped blocks)."""

    tables: GroupBlocks
    skipped: list[int]
    num_published: int = 0  # leading blocks whose hashes are published to the prefix cache

    @property
    def num_entries(self) -> int:
        return len(self.tables[0])


class KVCacheCoordinator:
    """Block tables per group, and the hit rule across them (see the module docstring). `reserve_tokens` > 0 emulates a
    contiguous cache: a request takes blocks for that many tokens at its first allocation (`bench memory`)."""

    def __init__(self, pool: BlockPool, layout: KVCacheLayout, block_size: int, reserve_tokens: int = 0) -> None:
        if pool.num_groups != layout.num_groups:
            raise ValueError(f"a pool of {pool.num_groups} groups cannot serve {layout.num_groups}")
        self.pool = pool
        self.layout = layout
        self.block_size = block_size
        self.reserve_tokens = reserve_tokens
        self.num_groups = layout.num_groups
        self.managers: list[SingleTypeKVCacheManager] = [manager_for(g.spec, block_size) for g in layout.groups]
        self.full_groups = [g for g, m in enumerate(self.managers) if m.window_blocks is None]
        windows: dict[int, list[int]] = {}
        for g, m in enumerate(self.managers):
            if m.window_blocks is not None:
                windows.setdefault(m.window_blocks, []).append(g)
        self.windows = list(windows.items())  # (blocks a hit needs before its end, the groups of that window)
        self.requests: dict[str, RequestTables] = {}

    @property
    def null_block(self) -> KVCacheBlock:
        return self.pool.null_block

    @property
    def has_sliding(self) -> bool:
        return bool(self.windows)

    # ---- the hit rule --------------------------------------------------------------------------------------------

    def longest_hit(self, num_blocks: int, has: HasBlock, has_snapshot: Callable[[int], bool] | None = None) -> int:
        """The longest prefix, in blocks (at most num_blocks), that every group can serve and, for a model with state
        layers (`has_snapshot` given), that ends where a state snapshot does (has_snapshot(i): one ends at block i)."""
        length = num_blocks
        for i in range(num_blocks):
            if not all(has(g, i) for g in self.full_groups):
                length = i
                break
        scans = [WindowScan(blocks, _served(has, groups)) for blocks, groups in self.windows]
        while length > 0:
            gap = next((g for g in (s.gap(length) for s in scans) if g is not None), None)
            if gap is not None:
                length = gap
            elif has_snapshot is not None and not has_snapshot(length - 1):
                length -= 1
            else:
                break
        return length

    def first_needed_block(self, group_id: int, num_computed_tokens: int) -> int:
        """The first block of this group a request computed up to `num_computed_tokens` reads, or a prefix hit of
        num_computed_tokens / block_size blocks needs (single_type.py)."""
        return self.managers[group_id].first_needed_block(num_computed_tokens)

    def hit_tables(self, length: int, block_of: Callable[[int, int], KVCacheBlock]) -> GroupBlocks:
        """Per group, the table of a prefix hit of `length` blocks: null entries before a sliding group's window, then
        block_of(group, index) for each block the group needs."""
        out: GroupBlocks = []
        for g in range(self.num_groups):
            first = self.first_needed_block(g, length * self.block_size)
            out.append([self.null_block] * first + [block_of(g, i) for i in range(first, length)])
        return out

    def cached_prefix(self, hashes: list[bytes], length: int) -> list[KVCacheBlock]:
        """The cached blocks a hit of `length` blocks needs, every group; [] if one is missing (not cached)."""
        blocks = []
        for g in range(self.num_groups):
            for i in range(self.first_needed_block(g, length * self.block_size), length):
                block = self.pool.cached[g].get(hashes[i])
                if block is None:
                    return []
                blocks.append(block)
        return blocks

    # ---- allocation ----------------------------------------------------------------------------------------------

    def entries_for(self, num_tokens: int) -> int:
        """Table entries (per group) of a request of num_tokens tokens: just enough, or its whole reservation."""
        return cdiv(max(num_tokens, self.reserve_tokens), self.block_size)

    def blocks_needed(self, request_id: str, num_tokens: int, hit: GroupBlocks | None) -> int:
        """Blocks the pool must give (new ones, and hit blocks revived from the free queue) for the request to hold
        `num_tokens` tokens after the prefix hit `hit`."""
        state = self.requests.get(request_id)
        hit_len = len(hit[0]) if hit else 0
        held = state.num_entries if state is not None else 0
        needed = self.num_groups * max(self.entries_for(num_tokens) - held - hit_len, 0)
        revived = sum(1 for blocks in hit or () for b in blocks if b.ref_cnt == 0 and b is not self.null_block)
        return needed + revived

    def allocate(self, request_id: str, hit: GroupBlocks | None, num_tokens: int) -> RequestTables:
        """Give the request the hit's blocks (first admission only) and new blocks up to `num_tokens` tokens; the
        caller checked they fit (blocks_needed)."""
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = RequestTables(
                [[] for _ in range(self.num_groups)], [0] * self.num_groups
            )
        if hit and hit[0]:
            if state.num_entries:
                raise ValueError(f"request {request_id} already holds blocks; prefix hits come first")
            for g, blocks in enumerate(hit):
                self.pool.touch(b for b in blocks if b is not self.null_block)
                state.tables[g].extend(blocks)
                state.skipped[g] = sum(1 for b in blocks if b is self.null_block)
            state.num_published = len(hit[0])
        needed = self.entries_for(num_tokens) - state.num_entries
        if needed > 0:
            for g, table in enumerate(state.tables):
                table.extend(self.pool.allocate(needed, g))
        return state

    def free_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back, in each sliding group, the blocks before the window of the request's next query (their table
        entries become the null block). Hashed ones stay revivable, in the pool's spent queue: evicted before other
        cached blocks (BlockPool)."""
        state = self.requests.get(request_id)
        if state is None or not self.windows:
            return
        for g, manager in enumerate(self.managers):
            first = min(manager.first_needed_block(num_computed_tokens), state.num_entries)
            table = state.tables[g]
            skipped = [table[i] for i in range(state.skipped[g], first) if table[i] is not self.null_block]
            for i in range(state.skipped[g], first):
                table[i] = self.null_block
            state.skipped[g] = max(state.skipped[g], first)
            if skipped:
                self.pool.free(skipped, spent=True)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Return the blocks past the request's `num_tokens` tokens (rejected drafts' K/V) to the pool."""
        state = self.requests.get(request_id)
        if state is None:
            return
        keep = self.entries_for(num_tokens)
        for table in state.tables:
            if len(table) > keep:
                tail = [b for b in table[keep:] if b is not self.null_block]
                del table[keep:]
                self.pool.free(reversed(tail))

    def free(self, request_id: str) -> RequestTables | None:
        """Return the request's blocks, each group's last block first so that a sequence's tail is evicted before its
        shareable head; its tables as they were (None: it held nothing)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for table in state.tables:
                self.pool.free(reversed([b for b in table if b is not self.null_block]))
        return state

    # ---- what requests hold --------------------------------------------------------------------------------------

    def tables(self, request_id: str) -> GroupBlocks:
        state = self.requests.get(request_id)
        return [[] for _ in range(self.num_groups)] if state is None else state.tables

    def table_tail(self, request_id: str, group_id: int) -> tuple[int, list[int]]:
        """The request's table in one group as (leading null entries, block ids of the entries after them)."""
        state = self.requests.get(request_id)
        if state is None:
            return 0, []
        lead = state.skipped[group_id]
        return lead, [b.block_id for b in state.tables[group_id][lead:]]

    def num_blocks_held(self, request_id: str) -> int:
        return sum(len(t) - t.count(self.null_block) for t in self.tables(request_id))

    def held_blocks(self) -> Iterable[tuple[str, int, KVCacheBlock]]:
        """Every (request id, group, block) reference that requests hold, null entries left out."""
        for rid, state in self.requests.items():
            for g, table in enumerate(state.tables):
                for b in table:
                    if b is not self.null_block:
                        yield rid, g, b


def _served(has: HasBlock, groups: list[int]) -> Callable[[int], bool]:
    return lambda i: all(has(g, i) for g in groups)
