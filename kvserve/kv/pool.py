"""BlockPool: hands out KV blocks, takes them back, and remembers which full blocks hold which prefix."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvserve.capacity import NULL_BLOCK_ID, usable_blocks
from kvserve.kv.block import FreeBlockQueue, KVCacheBlock
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBuffer
from kvserve.kv.hashing import BlockKey


class BlockPool:
    """Owns every block. Free blocks are reused from the head of the free queue; when a block that still
    carries a hash is reused, its hash is dropped (eviction), so the least recently freed cached block goes
    first.

    Block NULL_BLOCK_ID is the null block: never in the free queue, never allocated, never referenced, so the
    padding of block tables points at a block no request's K/V lives in. Requests share the other
    `num_usable_blocks` = num_blocks - 1, and free + referenced == num_usable_blocks at all times."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEventBuffer | None = None) -> None:
        if usable_blocks(num_blocks) < 1:
            raise ValueError(f"a block pool needs at least two blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_usable_blocks = usable_blocks(num_blocks)
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue([b for b in self.blocks if b is not self.null_block])
        self.cached: dict[bytes, KVCacheBlock] = {}
        # Prefix hits per cached hash since it was stored (for the inspector's prefix tree); dropped on eviction.
        self.hit_counts: dict[bytes, int] = {}
        self.events = events  # None: no one reads KV events, so none are made
        # The hashes the pool evicted most recently (a ghost list, as ARC keeps): a later lookup that misses on one
        # of them is a prefix hit lost to eviction, which `kvserve doctor` reports (an offload tier would keep it).
        self.recently_evicted: OrderedDict[bytes, None] = OrderedDict()
        self.recently_evicted_capacity = max(num_blocks, 1024)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        if count > self.num_free_blocks:
            raise ValueError(f"cannot allocate {count} blocks: only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: bytes, key: BlockKey) -> KVCacheBlock | None:
        """The cached block for this hash, if its stored content matches `key` (guards against collisions)."""
        block = self.cached.get(block_hash)
        return block if block is not None and block.key == key else None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit, reviving them from the free queue if needed."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            if block.block_hash is not None:
                self.hit_counts[block.block_hash] = self.hit_counts.get(block.block_hash, 0) + 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. Blocks that reach zero return to the free queue: hashed
        blocks at the tail (reused last, revivable until then), unhashed ones at the head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, key: BlockKey) -> None:
        """Record that a full, computed block holds the prefix `block_hash`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block (or a colliding one) is already cached; this one stays private
        block.block_hash, block.key = block_hash, key
        self.cached[block_hash] = block
        self.recently_evicted.pop(block_hash, None)
        if self.events is not None:
            parent = key.parent.hex() if key.parent is not None else None
            self.events.append(BlockStored(block.block_id, block_hash.hex(), parent, key.token_ids, len(key.token_ids)))

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.hit_counts.pop(block.block_hash, None)
                self.recently_evicted[block.block_hash] = None
                if len(self.recently_evicted) > self.recently_evicted_capacity:
                    self.recently_evicted.popitem(last=False)
                if self.events is not None:
                    self.events.append(BlockRemoved(block.block_id, block.block_hash.hex()))
            block.block_hash = block.key = None

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = block.key = None
        self.cached.clear()
        self.hit_counts.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Every usable block is either free or referenced, never both; the null block is neither; hashes map to
        exactly one block.

        A public debug API (the pool's invariants, checkable by anyone who drives a pool, as the tests do after
        every operation): raises AssertionError naming the broken block; O(blocks), so not on a hot
        path. EngineCore.check_invariants adds the cross-check against each request's block table."""
        free_ids = [b.block_id for b in self.free_queue]
        if len(free_ids) != len(set(free_ids)) or len(free_ids) != self.num_free_blocks:
            raise AssertionError("free queue is corrupt")
        null = self.null_block
        if null.ref_cnt or null.in_free_queue or null.block_hash is not None:
            raise AssertionError(f"the null block was handed out: {null}")
        free_set = set(free_ids)
        for block in self.blocks:
            if block is null:
                continue
            if (block.block_id in free_set) == (block.ref_cnt > 0):
                raise AssertionError(f"{block} is {'both free and referenced' if block.ref_cnt else 'lost'}")
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                raise AssertionError(f"{block} has a hash the cache map does not point back to")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cache map entry points at {block} with another hash")
