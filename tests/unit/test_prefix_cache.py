"""Prefix caching in the KV manager: what is shared, what is not, eviction order, tenant isolation,
collisions, and the accounting. The pool is checked whole after every scenario."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvserve.engine.request import Request
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool
from kvserve.kv.prefix_stats import PrefixCacheStats

BS = 16


@dataclass
class Params:
    seed: int | None = None
    prompt_logprobs: int | None = None


def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, Params(), cache_salt=salt)


def run_prefill(kv: KVCacheManager, r: Request) -> int:
    """Admit a request the way the scheduler does and mark its prompt computed; returns cached tokens."""
    hit_blocks, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, hit_blocks)
    kv.record_prefix_query(r, num_hit)
    r.num_computed_tokens = r.num_tokens
    return num_hit


def make(num_blocks: int = 128, algo: str = "sha256") -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks + 1)  # num_blocks usable, plus the null block
    return pool, KVCacheManager(pool, BS, algo)


SYSTEM = list(range(1000, 1500))  # a 500-token shared prefix: 31 full blocks + 4 tokens


def test_two_requests_share_the_full_blocks_of_a_500_token_prefix():
    pool, kv = make()
    a = request("a", SYSTEM + [1, 2, 3])
    b = request("b", SYSTEM + [7, 8, 9, 10])
    assert run_prefill(kv, a) == 0
    assert run_prefill(kv, b) == 31 * BS  # the block holding tokens 496..511 differs: not shared
    blocks_a, blocks_b = kv.group_tables("a")[0], kv.group_tables("b")[0]
    assert [x.block_id for x in blocks_a[:31]] == [x.block_id for x in blocks_b[:31]]
    assert all(x.ref_cnt == 2 for x in blocks_a[:31])
    assert blocks_a[31] is not blocks_b[31] and blocks_a[31].ref_cnt == blocks_b[31].ref_cnt == 1
    assert blocks_a[31].block_hash is None  # partial blocks are never hashed
    kv.forget(a)
    assert all(x.ref_cnt == 1 for x in blocks_b[:31])  # only a's references dropped
    kv.forget(b)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_hit_never_covers_the_last_prompt_token():
    pool, kv = make()
    run_prefill(kv, request("a", list(range(64))))
    again = request("b", list(range(64)))  # exactly 4 full blocks: the 4th must be recomputed
    assert run_prefill(kv, again) == 48
    pool.check_invariants()


def test_eviction_is_lru_and_prefix_heads_outlive_tails():
    pool, kv = make(num_blocks=8)
    old = request("old", list(range(0, 32)))  # 2 blocks
    new = request("new", list(range(100, 132)))
    run_prefill(kv, old)
    kv.forget(old)
    run_prefill(kv, new)
    kv.forget(new)
    # Free queue: 4 never-used blocks first, then old's blocks (tail block first), then new's.
    order = [b.block_id for b in pool.free_queue]
    old_ids = [b for b in order if pool.blocks[b].key and pool.blocks[b].key.token_ids[0] in (0, 16)]
    assert order[-4:-2] == old_ids and pool.blocks[order[-4]].key.token_ids[0] == 16
    hog = request("hog", list(range(500, 500 + 16 * 5)))  # needs 5 blocks: evicts old's tail block
    hit, n = kv.get_computed_blocks(hog)
    assert kv.allocate_slots(hog, hog.num_tokens, hit)
    assert kv.get_computed_blocks(request("old2", list(range(0, 32))))[1] == 16  # head survived
    assert kv.get_computed_blocks(request("new2", list(range(100, 132))))[1] == 16
    kv.forget(hog)
    pool.check_invariants()


def test_salted_requests_do_not_share_or_probe():
    pool, kv = make()
    run_prefill(kv, request("a", SYSTEM))
    assert kv.get_computed_blocks(request("b", SYSTEM + [5], salt="tenant-b")) == ([[]], 0)
    run_prefill(kv, request("c", SYSTEM, salt="tenant-b"))
    assert kv.get_computed_blocks(request("d", SYSTEM + [5], salt="tenant-b"))[1] == 31 * BS
    assert kv.get_computed_blocks(request("e", SYSTEM + [5], salt="tenant-c"))[1] == 0
    pool.check_invariants()


def test_a_hash_collision_is_caught_by_the_content_check(monkeypatch):
    pool, kv = make(algo="xxhash")
    monkeypatch.setattr(kv.hasher, "_digest", lambda data: b"\x01" * 16)  # every block collides
    run_prefill(kv, request("a", list(range(40))))
    other = request("b", list(range(200, 240)))
    assert kv.get_computed_blocks(other) == ([[]], 0)
    assert run_prefill(kv, other) == 0
    same = request("c", list(range(40)))
    assert kv.get_computed_blocks(same)[1] == 16  # block 0 matches (block 1's key has another parent)
    pool.check_invariants()


def test_accounting_and_hit_rate_window():
    pool, kv = make()
    run_prefill(kv, request("a", SYSTEM + [1]))
    run_prefill(kv, request("b", SYSTEM + [2]))
    s = kv.prefix_stats
    assert s.queries_total == 2 * 501 and s.hits_total == 31 * BS
    assert s.hit_rate == pytest.approx(31 * BS / (2 * 501))
    stats = PrefixCacheStats(window=2)
    for q, h in [(10, 0), (10, 10), (10, 10)]:
        stats.record(q, h)
    assert stats.hit_rate == 1.0 and stats.hits_total == 20


def test_caching_off_shares_nothing():
    pool = BlockPool(64, enable_caching=False)
    kv = KVCacheManager(pool, BS)
    run_prefill(kv, request("a", SYSTEM[:100]))
    assert run_prefill(kv, request("b", SYSTEM[:100])) == 0
    assert not pool.cached[0]
