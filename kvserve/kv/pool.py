"""BlockPool: hands out KV blocks, takes them back, and remembers which full blocks hold which prefix."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from kvserve.capacity import NULL_BLOCK_ID, usable_blocks
from kvserve.kv.block import FreeBlockQueue, KVCacheBlock
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBuffer
from kvserve.kv.hashing import BlockKey


class BlockPool:
    """Owns every block. Free blocks are reused from the head of the free queue; when a block that still
    carries a hash is reused, its hash is dropped (eviction), so the least recently freed cached block goes
    first.

    Blocks a sliding-window group gave back mid-request (out of the window, kv/groups.py) wait in a queue of their
    own, `spent_queue`, reused after the never-used and unhashed blocks but before any other cached block. Why: such a
    block serves a prefix hit only at the one hit point whose window it covers (a prompt that stops right after it),
    while a full-attention block serves every longer prefix and the window blocks a request held when it finished
    serve its next chat turn; under LRU alone, the out-of-window blocks of other users' turns (most of a long
    prompt's sliding-group blocks) are fresher than a waiting user's history and push it out. With them evicted
    first, a pool keeps whole histories of about as many users as it could keep full-attention blocks and last
    windows for.

    Block NULL_BLOCK_ID is the null block: never in the free queue, never allocated, never referenced, so the
    padding of block tables (and a sliding-window group's entries before its window) points at a block no request's
    K/V lives in. Requests share the other `num_usable_blocks` = num_blocks - 1, and free + referenced ==
    num_usable_blocks at all times.

    One pool serves every KV cache group (kv/groups.py): a block belongs to the group that allocated it until it is
    reused, and the prefix cache maps (group, hash) to a block, one map per group (`cached[group]`), since each group
    keeps its own copy of a prefix's K/V."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        events: KVEventBuffer | None = None,
        num_groups: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if usable_blocks(num_blocks) < 1:
            raise ValueError(f"a block pool needs at least two blocks (one is the null block), got {num_blocks}")
        if num_groups < 1:
            raise ValueError(f"a block pool serves at least one KV cache group, got {num_groups}")
        self.num_blocks = num_blocks
        self.num_usable_blocks = usable_blocks(num_blocks)
        self.enable_caching = enable_caching
        self.num_groups = num_groups
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue([b for b in self.blocks if b is not self.null_block])
        self.spent_queue = FreeBlockQueue([])  # hashed blocks given back out of a sliding window, in freeing order
        self.cached: list[dict[bytes, KVCacheBlock]] = [{} for _ in range(num_groups)]
        # Prefix hits per cached hash since it was stored (for the inspector's prefix tree), per group; dropped on
        # eviction.
        self.hit_counts: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.events = events  # None (or a buffer nobody reads: KVEventBuffer.enabled): no events are made
        # The hashes the pool evicted most recently (a ghost list, as ARC keeps): a later lookup that misses on one
        # of them is a prefix hit lost to eviction, which `kvserve doctor` reports (an offload tier would keep it).
        # Each with when (time.monotonic) and the eviction count then (num_evictions less it: the LRU pressure since).
        self.recently_evicted: OrderedDict[bytes, tuple[float, int]] = OrderedDict()
        self.recently_evicted_capacity = max(num_blocks, 1024)
        self.num_evictions = 0
        self.clock = clock  # the engine's (injected in tests): eviction times, pins' expiry (kv/pins.py)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks + self.spent_queue.num_free_blocks

    def _pop_free(self) -> KVCacheBlock:
        """The block reused next: the free queue's head while it holds no prefix, else the oldest out-of-window
        block, else the free queue's head (the least recently freed cached block)."""
        head = self.free_queue.head
        if self.spent_queue.num_free_blocks and (head is None or head.block_hash is not None):
            block = self.spent_queue.popleft()
            block.spent = False
            return block
        return self.free_queue.popleft()

    def free_blocks(self) -> Iterator[KVCacheBlock]:
        """The free blocks in the order allocate() reuses them (the inspector's eviction ranks)."""
        spent_done = False
        for block in self.free_queue:
            if block.block_hash is not None and not spent_done:
                yield from self.spent_queue
                spent_done = True
            yield block
        if not spent_done:
            yield from self.spent_queue

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, count: int, group_id: int = 0) -> list[KVCacheBlock]:
        """`count` blocks for group `group_id`, least recently freed first (their old hashes evicted)."""
        if count > self.num_free_blocks:
            raise ValueError(f"cannot allocate {count} blocks: only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(count):
            block = self._pop_free()
            self._evict(block)
            block.ref_cnt = 1
            block.group_id = group_id
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: bytes, key: BlockKey, group_id: int = 0) -> KVCacheBlock | None:
        """The group's cached block for this hash, if its stored content matches `key` (guards against
        collisions)."""
        block = self.cached[group_id].get(block_hash)
        return block if block is not None and block.key == key else None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit, reviving them from the free queue if needed."""
        for block in blocks:
            if block.ref_cnt == 0:
                (self.spent_queue if block.spent else self.free_queue).remove(block)
                block.spent = False
            block.ref_cnt += 1
            if block.block_hash is not None:
                counts = self.hit_counts[block.group_id]
                counts[block.block_hash] = counts.get(block.block_hash, 0) + 1

    def free(self, blocks: Iterable[KVCacheBlock], spent: bool = False) -> None:
        """Drop one reference from each block. Blocks that reach zero return to the free queue: hashed
        blocks at the tail (reused last, revivable until then), unhashed ones at the head; `spent`: blocks a
        sliding-window group gave back mid-request, hashed ones to the tail of the spent queue (see the class)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                elif spent:
                    block.spent = True
                    self.spent_queue.append(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, key: BlockKey) -> bool:
        """Record that a full, computed block of its group holds the prefix `block_hash`. Returns whether it is now
        the group's cached block for that hash (False: caching is off, or an identical block already is, and this
        one stays private)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        cached = self.cached[block.group_id]
        if block_hash in cached:
            return False  # an identical block (or a colliding one) is already cached; this one stays private
        block.block_hash, block.key = block_hash, key
        cached[block_hash] = block
        self.recently_evicted.pop(block_hash, None)
        if self.events is not None and self.events.enabled:
            parent = key.parent.hex() if key.parent is not None else None
            self.events.append(
                BlockStored(
                    block.block_id,
                    block_hash.hex(),
                    parent,
                    key.token_ids,
                    len(key.token_ids),
                    group_idx=block.group_id,
                )
            )
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop the prefix a block being reused held (it left the free or spent queue already)."""
        if block.block_hash is not None:
            cached = self.cached[block.group_id]
            if cached.get(block.block_hash) is block:
                del cached[block.block_hash]
                self.hit_counts[block.group_id].pop(block.block_hash, None)
                self.num_evictions += 1
                self.recently_evicted[block.block_hash] = (self.clock(), self.num_evictions)
                if len(self.recently_evicted) > self.recently_evicted_capacity:
                    self.recently_evicted.popitem(last=False)
                if self.events is not None and self.events.enabled:
                    self.events.append(BlockRemoved(block.block_id, block.block_hash.hex(), group_idx=block.group_id))
            block.block_hash = block.key = None

    def is_cached(self, block_hash: bytes, group_id: int = 0) -> bool:
        return block_hash in self.cached[group_id]

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(c) for c in self.cached)

    def reset_prefix_cache(self) -> None:
        while self.spent_queue.num_free_blocks:  # holding no prefix now, they are reused first
            block = self.spent_queue.popleft()
            block.spent = False
            self.free_queue.appendleft(block)
        for cached in self.cached:
            for block in cached.values():
                block.block_hash = block.key = None
            cached.clear()
        for counts in self.hit_counts:
            counts.clear()
        if self.events is not None and self.events.enabled:
            self.events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Every usable block is either free or referenced, never both; the null block is neither; hashes map to
        exactly one block.

        A public debug API (the pool's invariants, checkable by anyone who drives a pool, as the tests do after
        every operation): raises AssertionError naming the broken block; O(blocks), so not on a hot
        path. EngineCore.check_invariants adds the cross-check against each request's block table."""
        free_ids = [b.block_id for b in self.free_blocks()]
        if len(free_ids) != len(set(free_ids)) or len(free_ids) != self.num_free_blocks:
            raise AssertionError("free queue is corrupt")
        if any(not b.spent or b.block_hash is None for b in self.spent_queue) or any(b.spent for b in self.free_queue):
            raise AssertionError("the spent queue holds a block that is not a hashed out-of-window block")
        null = self.null_block
        if null.ref_cnt or null.in_free_queue or null.block_hash is not None:
            raise AssertionError(f"the null block was handed out: {null}")
        free_set = set(free_ids)
        for block in self.blocks:
            if block is null:
                continue
            if (block.block_id in free_set) == (block.ref_cnt > 0):
                raise AssertionError(f"{block} is {'both free and referenced' if block.ref_cnt else 'lost'}")
            if block.block_hash is not None and self.cached[block.group_id].get(block.block_hash) is not block:
                raise AssertionError(f"{block} has a hash the cache map does not point back to")
        for group_id, cached in enumerate(self.cached):
            for block_hash, block in cached.items():
                if block.block_hash != block_hash or block.group_id != group_id:
                    raise AssertionError(f"group {group_id}'s cache map entry points at {block} with another hash")
