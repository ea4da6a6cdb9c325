"""Randomized draft / verify / rollback against the KV manager: the pool stays whole, no block is leaked, and
the prefix cache only ever holds blocks whose tokens are the requests' real (accepted) tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.core import check_kv_invariants
from kvserve.kv.groups import make_kv_cache_layout
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool


@dataclass
class FakeRequest:
    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    num_prompt_tokens: int = 4
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    cache_marks: tuple[int, ...] = ()
    drafts: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def check(manager: KVCacheManager, live: list[FakeRequest]) -> None:
    check_kv_invariants(manager)
    for request in live:
        for blocks in manager.group_tables(request.request_id):
            assert len(blocks) <= -(-(request.num_tokens + len(request.drafts)) // manager.block_size)
            for i, block in enumerate(blocks):
                if block.block_hash is not None:  # a published block holds exactly the real tokens there
                    bs = manager.block_size
                    assert (i + 1) * bs <= request.num_tokens  # never a block of draft slots
                    assert block.key is not None
                    assert list(block.key.token_ids) == request.tokens[i * bs : (i + 1) * bs]


ops = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=60
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(6, 24),
    windows=st.sampled_from([(None,), (None, 3), (5, None, 5)]),  # uniform; a full and a sliding KV cache group
)
def test_random_verify_and_rollback_keep_pool_and_prefix_cache_consistent(ops, block_size, num_blocks, windows):
    layout = make_kv_cache_layout(windows)
    manager = KVCacheManager(BlockPool(num_blocks, num_groups=layout.num_groups), block_size, layout=layout)
    # Few distinct tokens: requests share prefixes and drafts often equal what "the model" says.
    requests = [FakeRequest(f"r{i}", [i % 2, 1, 2, 1]) for i in range(3)]
    for which, num_drafts, accept, action in ops:
        request = requests[which % len(requests)]
        if action == 3:  # preempt (or finish) and start again from nothing
            manager.free(request)
            request.num_computed_tokens = 0
            continue
        if request.request_id not in manager.requests:  # (re)admission: prefix hits, then the rest
            hit, num_hit = manager.get_computed_blocks(request)
            if not manager.allocate_slots(request, request.num_tokens - num_hit, hit):
                continue
            request.num_computed_tokens = request.num_tokens
            request.tokens.append(which % 3)  # the sampled token: computed next step
            check(manager, requests)
            continue
        request.drafts = [(which + j) % 3 for j in range(num_drafts)]
        if not manager.allocate_slots(request, 1, num_lookahead_tokens=len(request.drafts)):
            request.drafts = []
            if not manager.allocate_slots(request, 1):
                manager.free(request)
                request.num_computed_tokens = 0
                continue
        check(manager, requests)
        accepted = min(accept, len(request.drafts))
        gained = request.drafts[:accepted] + [7]  # the accepted drafts, then the target's own token
        request.num_computed_tokens += 1 + accepted
        request.tokens.extend(gained)
        request.drafts = []
        manager.rollback(request)
        # Table entries for the computed tokens stay; none is kept past the last real token (rejected drafts').
        assert -(-request.num_computed_tokens // block_size) <= manager.num_tokens_held(request) // block_size
        assert manager.num_tokens_held(request) // block_size <= -(-request.num_tokens // block_size)
        check(manager, requests)
    for request in requests:
        manager.forget(request)
    manager.pool.check_invariants()
    assert manager.pool.num_free_blocks == manager.pool.num_usable_blocks
