"""The free queue and block pool: O(1) queue operations, reuse order, prefix-cache bookkeeping."""

import pytest

from kvserve.capacity import NULL_BLOCK_ID
from kvserve.kv.block import FreeBlockQueue, KVCacheBlock
from kvserve.kv.hashing import BlockHasher, BlockKey
from kvserve.kv.pool import BlockPool

KEY = BlockKey(None, (1, 2, 3, 4), b"")
OTHER = BlockKey(None, (1, 2, 3, 5), b"")


def ids(queue):
    return [b.block_id for b in queue]


def test_free_queue_order_and_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3]
    q.appendleft(blocks[0])
    q.append(blocks[4])
    assert ids(q) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0] and len(q) == 3
    with pytest.raises(ValueError):
        q.append(blocks[1])  # already queued
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not queued


def test_pool_allocate_free_and_reuse_order():
    pool = BlockPool(5)  # block 0 is the null block: 4 usable
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [1, 2] and pool.num_free_blocks == 2
    pool.cache_block(a[0], b"h0", KEY)
    pool.free(a)  # a[0] hashed -> tail, a[1] unhashed -> head
    assert ids(pool.free_queue) == [2, 3, 4, 1]
    with pytest.raises(ValueError):
        pool.free([a[1]])  # double free is refused, not silently corrupting
    with pytest.raises(ValueError):
        pool.allocate(5)
    pool.check_invariants()


def test_out_of_window_blocks_are_reused_after_unhashed_ones_and_before_other_cached_blocks():
    """Blocks a sliding group gave back mid-request (free(spent=True)) wait in the spent queue: allocate() takes the
    never-used and unhashed blocks first, then the spent ones (oldest first), and only then evicts other cached blocks;
    a prefix hit revives a spent block; a reset makes them plain free blocks."""
    pool = BlockPool(9)  # 8 usable
    history = pool.allocate(2)  # a finished request's blocks: freed to the LRU tail
    spent = pool.allocate(3)  # another request's out-of-window blocks, freed after the history
    for i, b in enumerate(history + spent):
        pool.cache_block(b, bytes([i]), KEY)
    pool.free(history)
    pool.free(spent, spent=True)
    pool.check_invariants()
    assert pool.num_free_blocks == 8 and ids(pool.free_blocks()) == [6, 7, 8, 3, 4, 5, 1, 2]
    pool.touch([spent[1]])  # a hit on one of them: revived from the spent queue
    assert not spent[1].spent and ids(pool.spent_queue) == [3, 5]
    got = pool.allocate(5)
    assert [b.block_id for b in got] == [6, 7, 8, 3, 5]  # the history (1, 2) survives
    assert pool.is_cached(b"\x00") and pool.is_cached(b"\x01") and not pool.is_cached(b"\x02")
    pool.check_invariants()
    pool.free([spent[1]], spent=True)
    pool.reset_prefix_cache()
    assert pool.spent_queue.num_free_blocks == 0 and ids(pool.free_blocks())[0] == 4
    pool.check_invariants()


def test_cached_block_revived_then_evicted_on_reuse():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h", KEY)
    pool.free([block])
    assert pool.lookup(b"h", KEY) is block and pool.lookup(b"h", OTHER) is None and pool.num_free_blocks == 2
    pool.touch([block])  # a prefix hit takes it back out of the free queue
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([block])
    pool.allocate(2)  # reuse evicts its hash
    assert pool.lookup(b"h", KEY) is None and block.block_hash is None
    pool.check_invariants()


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_chained_hashes_depend_on_parent_and_salt(algo):
    hasher = BlockHasher(algo)
    tokens = list(range(10))

    def token_slice(start: int, end: int) -> list[int]:
        return tokens[start:end]

    hashes = hasher.extend(token_slice, len(tokens), 4, [])
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[1] == hasher.hash_block(hashes[0], tokens[4:8])
    assert hasher.hash_block(None, tokens[4:8]) != hashes[1]
    assert hasher.extend(token_slice, len(tokens), 4, [], extra_keys=b"salt")[0] != hashes[0]
    assert hasher.extend(token_slice, 7, 4, []) == hashes[:1]
    assert hasher.extend(token_slice, len(tokens), 4, hashes[:1]) == hashes  # only the missing blocks
    with pytest.raises(ValueError, match="md5"):
        BlockHasher("md5")


def test_the_null_block_is_never_handed_out():
    """Block 0 pads block tables, so it must never hold a request's K/V: not allocatable, not freeable, not
    revivable, and outside the free + referenced count."""
    pool = BlockPool(4)
    assert pool.null_block.block_id == NULL_BLOCK_ID == 0
    assert pool.num_usable_blocks == pool.num_free_blocks == 3 and pool.usage == 0.0
    blocks = pool.allocate(3)
    assert pool.null_block not in blocks and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.allocate(1)  # only the null block is left, and it is not for use
    with pytest.raises(ValueError):
        pool.free([pool.null_block])
    with pytest.raises(ValueError):
        pool.touch([pool.null_block])
    pool.check_invariants()
    pool.free(blocks)
    assert pool.num_free_blocks == pool.num_usable_blocks and NULL_BLOCK_ID not in ids(pool.free_queue)
    pool.check_invariants()


def test_a_pool_needs_a_usable_block_beside_the_null_block():
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1)
