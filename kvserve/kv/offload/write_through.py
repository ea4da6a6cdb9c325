"""What the offload tier stores, decided from what a step computed (vLLM's OffloadingConnector does the same from the
scheduler's output): the KV manager publishes blocks to the pool's prefix cache and knows no tier; this reads the
manager's tables and hashes after the step succeeded.

Which blocks (a 4-token block, a sliding window needing 2 blocks before a hit, a prompt of 23 tokens: hit point 5):

    block           0   1   2   3   4   5
    full group      s   s   s   s   s   s     every block the step completed
    sliding group   .   .   .   s   s   .     the window before the prompt's hit point (blocks 3-4): a restore of
                                              the same prompt needs nothing else of that group

A request letting go of its blocks stores each sliding group's window before the end of what it computed (where its
conversation's next turn hits), and a hybrid model's reply snapshot (its latest), while they still hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvserve.kv.block import TierBlock
from kvserve.kv.manager import KVCacheManager, KVRequest
from kvserve.kv.offload.interface import OffloadingManager


class Computed(Protocol):
    """A request's share of a step (the scheduler's ScheduledRequest): where it started, and how many tokens."""

    @property
    def request(self) -> KVRequest: ...

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def draft_token_ids(self) -> list[int]: ...


class WriteThrough:
    """The blocks and state snapshots a tier (and a state tier beside it) is handed, and when."""

    def __init__(self, kv: KVCacheManager, tier: OffloadingManager, state_tier: OffloadingManager | None) -> None:
        self.kv = kv
        self.tier = tier
        self.state_tier = state_tier

    def _stores(self, group_id: int, index: int, hit_point: int) -> bool:
        """Whether block `index` of a group is one the tier keeps: every block of a full-attention group; of a
        sliding group, those of its window before `hit_point`."""
        manager = self.kv.coordinator.managers[group_id]
        if manager.window_blocks is None:
            return True
        return manager.first_needed_block(hit_point * manager.block_size) <= index < hit_point

    def step_done(self, scheduled: Sequence[Computed]) -> None:
        """After a step that succeeded: the blocks it completed that are their group's cached blocks (a private
        duplicate of a cached block is not stored: the tier keeps each (group, hash) once), and the prompt snapshots
        it saved."""
        kv, bs = self.kv, self.kv.block_size
        blocks: list[TierBlock] = []
        for s in scheduled:
            request = s.request
            end = min(s.start + s.num_tokens - len(s.draft_token_ids), request.num_tokens)
            first, last = s.start // bs, end // bs
            if last <= first or not kv.enable_caching:
                continue
            hashes = kv.hashes(request, last * bs)
            hit_point = (request.num_prompt_tokens - 1) // bs
            for g, table in enumerate(kv.group_tables(request.request_id)):
                for i in range(first, min(last, len(table), len(hashes))):
                    block = table[i]
                    if (
                        block.key is not None
                        and kv.pool.cached[g].get(hashes[i]) is block
                        and self._stores(g, i, hit_point)
                    ):
                        blocks.append(TierBlock(block.block_id, hashes[i], block.key, g))
        if blocks:
            self.tier.prepare_store(blocks)
        if self.state_tier is not None and kv.state is not None:
            saved = [s for s in kv.state.take_saved() if s.in_prompt]
            if saved:
                self.state_tier.prepare_store([TierBlock(s.slot, s.block_hash, s.key, kv.state_group) for s in saved])

    def leaving(self, request: KVRequest) -> None:
        """The request lets go of its blocks and state slot: each sliding group's window before the end of its
        computed full blocks, and its reply's latest snapshot, are stored now, while they still hold them."""
        kv = self.kv
        if kv.coordinator.has_sliding:
            state = kv.requests.get(request.request_id)
            hashes = kv.req_hashes.get(request.request_id, [])
            end = 0 if state is None else min(request.num_computed_tokens // kv.block_size, state.num_published)
            blocks = []
            for g, table in enumerate(kv.group_tables(request.request_id)):
                if kv.coordinator.managers[g].window_blocks is None:
                    continue
                for i in range(kv.coordinator.first_needed_block(g, end * kv.block_size), min(end, len(hashes))):
                    block = table[i]
                    if block.block_hash == hashes[i] and kv.pool.cached[g].get(hashes[i]) is block and block.key:
                        blocks.append(TierBlock(block.block_id, hashes[i], block.key, g))
            if blocks:
                self.tier.prepare_store(blocks)
        tail = None if kv.state is None else kv.state.reply_tail(request.request_id)
        if tail is not None and self.state_tier is not None:
            self.state_tier.prepare_store([TierBlock(tail.slot, tail.block_hash, tail.key, kv.state_group)])

    def prompt_keys(self, request: KVRequest) -> list[tuple[int, bytes]]:
        """(group, hash) of the request's whole prompt blocks that the tier stores."""
        kv = self.kv
        hashes = kv.req_hashes.get(request.request_id, [])
        hit_point = (request.num_prompt_tokens - 1) // kv.block_size
        n = min(len(hashes), request.num_prompt_tokens // kv.block_size)
        return [(g, hashes[i]) for g in range(kv.num_groups) for i in range(n) if self._stores(g, i, hit_point)]

    def snapshot_keys(self, request: KVRequest) -> list[tuple[int, bytes]]:
        """(state group, hash) of the state snapshots saved along the request's tokens; its reply's latest is handed to
        the tier first (it is otherwise stored as the request lets go, after a retention would have looked for it)."""
        kv = self.kv
        snapshots = kv.state_snapshots
        if snapshots is None or kv.state is None:
            return []
        tail = kv.state.reply_tail(request.request_id)
        if tail is not None and self.state_tier is not None:
            self.state_tier.prepare_store([TierBlock(tail.slot, tail.block_hash, tail.key, kv.state_group)])
        hashes = kv.req_hashes.get(request.request_id, [])
        return [(kv.state_group, h) for h in hashes if h in snapshots]
