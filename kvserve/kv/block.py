"""KV cache blocks and the O(1) doubly linked free queue that orders their reuse."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvserve.kv.hashing import BlockKey


@dataclass(frozen=True, slots=True)
class TierBlock:
    """A full block as the KV offload tier sees it (kv/offload/): the pool block that holds it (or is being restored
    into; -1 in a tier's KV events, where no pool block is meant), its chained hash and the content key a hit checks."""

    block_id: int
    block_hash: bytes
    key: BlockKey
    group_id: int = 0  # the KV cache group whose layers the block holds (kv/groups.py)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of `block_size` token slots in each of the cache's per-layer tensors (the layers of one group).

    A block is either referenced (ref_cnt > 0) or sits in the free queue. A free block may still carry
    its hash: its contents stay valid (a later prefix hit revives it) until it is reused.
    """

    block_id: int
    ref_cnt: int = 0
    group_id: int = 0  # the KV cache group that allocated it (kv/groups.py); its hash is cached in that group's map
    block_hash: bytes | None = None
    key: BlockKey | None = None  # set with block_hash: the content a prefix hit must match
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    in_free_queue: bool = False
    spent: bool = False  # in the pool's queue of blocks out of a sliding window (BlockPool.free(spent=True))

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, group={self.group_id}, ref_cnt={self.ref_cnt}, hashed={hashed})"


class FreeBlockQueue:
    """Free blocks in reuse order: pop from the head, return blocks to the head or the tail, and take any
    block out of the middle (a prefix hit on a free block), all in O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    @property
    def head(self) -> KVCacheBlock | None:
        """The block reused next (None: empty)."""
        return self._head

    def popleft(self) -> KVCacheBlock:
        block = self._head
        if block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if not block.in_free_queue:
            raise ValueError(f"{block} is not in the free queue")
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Return a block at the tail: reused last."""
        self._check_insertable(block)
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        block.in_free_queue = True
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Return a block at the head: reused first."""
        self._check_insertable(block)
        block.prev_free, block.next_free = None, self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        block.in_free_queue = True
        self.num_free_blocks += 1

    def _check_insertable(self, block: KVCacheBlock) -> None:
        if block.in_free_queue:
            raise ValueError(f"{block} is already in the free queue")

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks
