"""Suffix drafting: the count trie's matching and greedy walk on hand-made sequences, the global cache of finished
outputs (helps a repeated request, bounded, eviction exact), per-request state released at finish and abort, the
config's errors, and greedy output identical with the method on and off in the whole engine."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from test_spec_engine import GREEDY, checkpoint, make_engine, repetitive_prompts, run  # noqa: F401 -- fixture

from kvserve import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from kvserve.spec_decode.drafter import NgramDrafter, make_drafter
from kvserve.spec_decode.suffix import SuffixDrafter, SuffixTrie, best_draft

SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "disable_by_batch_size": 64}


def indexed(tokens: list[int], depth: int = 24) -> tuple[SuffixTrie, list]:
    """A trie of one sequence and the sequence's suffix nodes (what a request's own trie drafts from)."""
    trie = SuffixTrie(depth)
    suffixes = trie.start()
    for t in tokens:
        suffixes = trie.extend(suffixes, t)
    return trie, suffixes


def dump(trie: SuffixTrie) -> tuple:
    """The trie's counts as nested tuples (children in token order), to compare two tries."""

    def node(n) -> tuple:
        kids = n.children or ({} if n.best is None else {n.best: n.best_child})
        return n.count, n.total, tuple((t, node(c)) for t, c in sorted(kids.items()))

    return node(trie.root)


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def test_walk_takes_the_most_frequent_continuation():
    # After "1 2": 3 twice, 4 once; after "1 2 3": 5 both times. The context ends with "1 2".
    seq = [1, 2, 3, 5, 9, 1, 2, 4, 8, 1, 2, 3, 5, 7, 1, 2]
    _, suffixes = indexed(seq)
    # The match "1 2" (2 tokens; "7 1 2" never continued) caps the draft at 2: 3 (2/3), then 5 (certain after
    # "1 2 3": 2/3 so far).
    assert best_draft(suffixes, 8, 1.0, 0.1).tokens == [3, 5]
    # Up to 4: after "1 2 3 5" came 9 and 7 once each (1/3 so far; the tie goes to the newer, 7), then 1.
    draft = best_draft(suffixes, 8, 2.0, 0.1)
    assert draft.tokens == [3, 5, 7, 1]
    assert draft.score == pytest.approx(2 / 3 + 2 / 3 + 1 / 3 + 1 / 3)


def test_min_token_prob_stops_the_walk():
    seq = [1, 2, 3, 5, 9, 1, 2, 4, 8, 1, 2, 3, 5, 7, 1, 2]
    _, suffixes = indexed(seq)
    assert best_draft(suffixes, 8, 2.0, 0.5).tokens == [3, 5]  # 1/3 for the third token is below 0.5
    assert best_draft(suffixes, 8, 2.0, 0.7).tokens == []  # even the first (2/3) is below 0.7


def test_max_spec_factor_caps_the_draft_by_the_match_length():
    seq = list(range(10, 30)) + [5, 6, 7] + list(range(10, 13))  # "10 11 12" matches, a certain 17-token run
    _, suffixes = indexed(seq)
    assert len(best_draft(suffixes, 32, 1.0, 0.1).tokens) == 3  # matched 3 tokens
    assert best_draft(suffixes, 32, 2.0, 0.1).tokens == list(range(13, 19))
    assert best_draft(suffixes, 4, 2.0, 0.1).tokens == [13, 14, 15, 16]  # and by k


def test_depth_bounds_the_trie_and_match_plus_draft():
    seq = list(range(100, 120)) + list(range(100, 110))
    trie, suffixes = indexed(seq, depth=5)
    assert len(suffixes) == 5  # suffix nodes of lengths 0..4
    # The first 20 tokens' substrings of at most 5 tokens, then the 4 + 3 + 2 + 1 that span "119 100 ...".
    assert trie.num_nodes == 1 + sum(min(5, i + 1) for i in range(20)) + 10
    draft = best_draft(suffixes, 32, 8.0, 0.0)
    assert draft.tokens == [110, 111, 112, 113]  # the 1-token match leaves depth 4 to draft from
    assert best_draft(suffixes, 32, 1.0, 0.0).tokens == [110, 111]  # m = 2, 2 tokens: 2 * 1.0 (m=3: 2, m=4: 1)


def test_remove_undoes_insert_exactly():
    rng = random.Random(0)
    for _ in range(20):
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(30))] for _ in range(8)]
        both, later = SuffixTrie(6), SuffixTrie(6)
        for s in seqs:
            both.insert(s)
        for s in seqs[:4]:
            both.remove(s)
        for s in seqs[4:]:
            later.insert(s)
        assert dump(both) == dump(later)
        assert both.num_nodes == later.num_nodes


def test_global_cache_drafts_a_repeated_request_from_the_first_ones_output():
    rng = random.Random(1)
    prompt = [rng.randrange(1000) for _ in range(20)]
    answer = [rng.randrange(1000, 2000) for _ in range(40)]  # nothing in the prompt predicts it
    for cached, expect_long in ((10, True), (0, False)):
        drafter = SuffixDrafter(24, cached, 1.0, 0.1)
        drafter.on_finished(FakeRequest("a", prompt, answer))
        again = FakeRequest("b", prompt, answer[:10])
        draft = drafter.propose(again, 8)
        assert (draft == answer[10:18]) is expect_long
        if not expect_long:
            assert draft == []


def test_global_cache_is_bounded_and_evicts_the_oldest():
    drafter = SuffixDrafter(8, 2, 1.0, 0.1)
    outputs = [[100 * i + j for j in range(12)] for i in range(1, 4)]
    for i, out in enumerate(outputs):
        drafter.on_finished(FakeRequest(str(i), [1], out))
    assert drafter.num_cached_requests == 2
    only_last_two = SuffixTrie(8)
    for out in outputs[1:]:
        only_last_two.insert(out)
    assert dump(drafter.global_trie) == dump(only_last_two)
    assert drafter.propose(FakeRequest("x", [7], outputs[0][:4]), 4) == []  # evicted
    assert drafter.propose(FakeRequest("y", [7], outputs[2][:4]), 4) == outputs[2][4:8]


def test_per_request_state_is_released_at_finish():
    drafter = SuffixDrafter(24, 10, 1.0, 0.1)
    requests = [FakeRequest(str(i), [1, 2, 3, 1, 2], [3]) for i in range(3)]
    for r in requests:
        assert drafter.propose(r, 4) == [1, 2, 3]  # "1 2 3" matched: at most 3 (max_spec_factor 1)
    assert drafter.num_live_requests == 3
    requests[0].output_token_ids += [1, 2]  # later tokens are indexed incrementally
    assert drafter.propose(requests[0], 4) == [3, 1, 2]  # "1 2 3 1 2" -> 3 1 2, then the end of the text
    for r in requests:
        drafter.on_finished(r)
    assert drafter.num_live_requests == 0
    assert drafter.num_cached_requests == 3


def test_make_drafter_follows_the_method():
    assert isinstance(make_drafter(SpeculativeConfig("ngram")), NgramDrafter)
    assert isinstance(make_drafter(SpeculativeConfig("suffix")), SuffixDrafter)


def test_config_keys_defaults_and_errors():
    cfg = parse_speculative_config('{"method": "suffix"}')
    assert cfg is not None
    assert (
        cfg.num_speculative_tokens,
        cfg.suffix_decoding_max_tree_depth,
        cfg.suffix_decoding_max_cached_requests,
        cfg.suffix_decoding_max_spec_factor,
        cfg.suffix_decoding_min_token_prob,
    ) == (8, 24, 1000, 1.0, 0.1)
    assert parse_speculative_config({"method": "ngram"}).num_speculative_tokens == 4  # type: ignore[union-attr]
    assert parse_speculative_config({"method": "suffix", "num_speculative_tokens": 3}).num_speculative_tokens == 3  # type: ignore[union-attr]
    bad = [
        ("suffix_decoding_max_tree_depth", 1, ">= 2"),
        ("suffix_decoding_max_cached_requests", -1, ">= 0"),
        ("suffix_decoding_max_spec_factor", 0, "> 0"),
        ("suffix_decoding_min_token_prob", 1.5, r"in \[0, 1\]"),
    ]
    for key, value, expected in bad:
        with pytest.raises(ValueError, match=f"{key} must be {expected}"):
            parse_speculative_config({"method": "suffix", key: value})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        parse_speculative_config('{"method": "suffix", "suffix_decoding_max_depth": 4}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_speculative_config('{"method": "suffix"')
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_speculative_config('"suffix"')


@pytest.mark.parametrize(
    "engine_kw", [{}, dict(num_gpu_blocks_override=24, max_model_len=64)], ids=["default", "preempt"]
)
def test_engine_output_identical_and_state_released(checkpoint, engine_kw):  # noqa: F811 -- the imported fixture
    prompts = repetitive_prompts(6, seed=3)
    prompts += prompts[:2]  # repeated requests: the global cache has their first copy's output
    params = [GREEDY] * len(prompts)
    params[1] = SamplingParams(temperature=0.05, seed=7, max_tokens=24, ignore_eos=True)  # seeded: same draws
    off = run(make_engine(checkpoint, None, **engine_kw), prompts, params)
    engine = make_engine(checkpoint, SUFFIX, **engine_kw)
    on = run(engine, prompts, params)
    assert on == off
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    if engine_kw:
        assert engine.core.scheduler.num_preemptions > 0  # a preempted request kept its trie and drafted on
    assert engine.core.spec is not None
    drafter = engine.core.spec.drafter
    assert isinstance(drafter, SuffixDrafter)
    assert drafter.num_live_requests == 0
    assert drafter.num_cached_requests == len(prompts)
    # An aborted request lets go of its trie too.
    engine.add_request("gone", prompts[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(20):  # its prefill, then its first draft makes its trie
        engine.step()
        if drafter.num_live_requests:
            break
    assert drafter.num_live_requests == 1
    engine.abort_request("gone")
    assert drafter.num_live_requests == 0
    engine.check_invariants()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks
