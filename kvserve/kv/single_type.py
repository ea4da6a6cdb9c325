"""One manager per kind of KV cache group (vLLM's SingleTypeKVCacheManager): what a group of that kind needs of a prefix
hit, and which of a request's blocks it can give back early.

With a 4-token block and a sliding window of 8 tokens (a hit needs the cdiv(8 - 1, 4) = 2 blocks before its end):

    block          0   1   2   3   4   5
    full group     x   x   x   x   x   x      a hit of 6 blocks needs all six
    sliding group  .   .   .   .   x   x      ... and only blocks 4-5 here: a query at token 24 sees tokens 17-24

A request computed up to token 20 no longer reads blocks 0-2 of the sliding group (its queries see 13 on): they go back
to the pool (`first_needed_block`), hashed, so a hit at that point can still revive them.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.kv.groups import KVCacheSpec


class SingleTypeKVCacheManager:
    """The rules of one spec's groups; `window_blocks` is how many blocks before a hit's end a group of it needs
    (None: all)."""

    def __init__(self, spec: KVCacheSpec, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.window_blocks = spec.window_blocks(block_size)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block a step starting at `num_computed_tokens` may read; the ones before go back to the pool.
        One boundary for running requests and hits alike: a prefix hit of L blocks is a request whose next step
        starts at token L x block_size, so it needs this group's blocks from first_needed_block(L x block_size),
        which is L - window_blocks (at least 0)."""
        return self.spec.first_needed_block(num_computed_tokens, self.block_size)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every block of a hit, every block of a request until it ends."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """The window before a hit's end; blocks out of every later query's window go back as the request moves on."""


def manager_for(spec: KVCacheSpec, block_size: int) -> SingleTypeKVCacheManager:
    return SlidingWindowManager(spec, block_size) if spec.is_sliding else FullAttentionManager(spec, block_size)


class WindowScan:
    """For one window (groups that need `window_blocks` blocks before a hit's end), the question a right-to-left hit
    search asks of each candidate length L: are blocks [L - window_blocks, L) all served (all of [0, L) for a shorter
    prefix)? Asked for decreasing L within one lookup, each block is looked at once: `low` is the lowest block of a
    run known served up to the current candidate."""

    def __init__(self, window_blocks: int, served: Callable[[int], bool]) -> None:
        self.window_blocks = window_blocks
        self.served = served
        self.low: int | None = None

    def gap(self, length: int) -> int | None:
        """The last block before `length` in its window that is not served (the next candidate length to try is that
        block's index), or None: the window is whole."""
        if self.low is None or self.low > length:
            self.low = length
        bottom = max(0, length - self.window_blocks)
        while self.low > bottom:
            if not self.served(self.low - 1):
                gap = self.low - 1
                self.low = gap  # nothing at or above it is whole for a shorter candidate's window
                return gap
            self.low -= 1
        return None
