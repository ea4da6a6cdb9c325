"""The n-gram drafter, greedy verification, the config and the gate, without a model."""

from __future__ import annotations

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from kvserve.spec_decode.gate import SpecDecoder
from kvserve.spec_decode.ngram import propose_ngram
from kvserve.spec_decode.verify import verify_greedy

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def test_ngram_takes_the_longest_most_recent_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 3, 2, 4) == [7, 8, 5]  # "1 2 3" last seen before 7 8 5
    assert propose_ngram([5, 6, 7, 8], 3, 2, 4) == []
    assert propose_ngram([4, 4, 4], 2, 1, 4) == [4]  # what follows the match may be shorter than k
    assert propose_ngram([1, 2, 3, 1, 2], 5, 2, 2) == [3, 1, 2]


def test_verify_greedy_accepts_up_to_the_first_mismatch_then_takes_the_target():
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert verify_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    with pytest.raises(ValueError):
        verify_greedy([5], [5])


def test_config_parses_vllm_json_and_rejects_other_methods():
    cfg = EngineConfig.parse(speculative_config=NGRAM)
    assert cfg.speculative_config == SpeculativeConfig("ngram", 4, 4, 2)
    assert EngineConfig().speculative_config is None
    for method in ("eagle", "draft_model", "mtp"):
        with pytest.raises(ValueError, match="not supported"):
            parse_speculative_config({"method": method})
    for bad in (
        '{"method": "ngram", "num_speculative_tokens": 0}',
        '{"method": "magic"}',
        "{nope",
        '{"method": "ngram", "model": "x"}',
        '{"num_speculative_tokens": 2}',
        "[1]",
    ):
        with pytest.raises(ValueError):
            parse_speculative_config(bad)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from kvserve.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--speculative-config", NGRAM]))
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None


def _decoding(params: SamplingParams, out: list[int]) -> Request:
    request = Request("r", [1, 2, 3, 1, 2], params)
    request.output_token_ids = list(out)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_gate_drafts_only_requests_it_verifies_exactly():
    spec = SpecDecoder(SpeculativeConfig())
    greedy = SamplingParams(temperature=0, max_tokens=50)
    assert spec.wants_draft(_decoding(greedy, [3]), {})
    assert not spec.wants_draft(_decoding(greedy, [3]), {"r": None})  # a grammar whose matcher is not made yet
    assert spec.wants_draft(_decoding(SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=50), [3]), {})
    for params in (
        SamplingParams(temperature=0, logprobs=2, max_tokens=50),
        SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=0.5, max_tokens=50),
        SamplingParams(temperature=0, min_tokens=5, max_tokens=50),
    ):
        assert spec.wants_draft(_decoding(params, [3]), {})  # verify.DraftedRow makes each exact
    prefilling = _decoding(greedy, [3])
    prefilling.num_computed_tokens = 2
    assert not spec.wants_draft(prefilling, {})


def test_gate_stops_low_acceptance_and_large_batches():
    spec = SpecDecoder(SpeculativeConfig(disable_by_batch_size=2, acceptance_window=8, min_acceptance_rate=0.5))
    request = _decoding(SamplingParams(temperature=0, max_tokens=50), [3, 1, 2])
    spec.propose([request], {}, 256, num_running=1)
    assert request.spec_token_ids == [3, 1, 2]
    spec.propose([request], {}, 256, num_running=3)
    assert request.spec_token_ids == []
    spec.record(request, 8, 3)
    assert not spec.wants_draft(request, {})
    assert (spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) == (1, 8, 3)


def test_acceptance_is_counted_per_draft_position():
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4))
    request = _decoding(SamplingParams(temperature=0, max_tokens=50), [3])
    assert spec.stats.num_accepted_tokens_per_pos == [0, 0, 0, 0]
    for drafted, accepted in [(4, 4), (4, 1), (2, 2), (4, 0), (3, 2)]:
        spec.record(request, drafted, accepted)
    # position i counts the drafts that kept at least i + 1 tokens
    assert spec.stats.num_accepted_tokens_per_pos == [4, 3, 1, 1]
    assert sum(spec.stats.num_accepted_tokens_per_pos) == spec.stats.num_accepted_tokens == 9


def test_drafts_are_capped_by_max_tokens_and_max_model_len():
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    request = _decoding(SamplingParams(temperature=0, max_tokens=5), [3, 1, 2])
    spec.propose([request], {}, 256, num_running=1)
    assert len(request.spec_token_ids) == 1  # 3 out, max 5: one draft + the bonus
    request = _decoding(SamplingParams(temperature=0, max_tokens=50), [3, 1, 2])
    spec.propose([request], {}, request.num_tokens + 2, num_running=1)
    assert len(request.spec_token_ids) == 2


def test_spec_decode_imports_downward_only():
    """spec_decode/ sits below the engine: it reads requests through a protocol, never engine/ or above."""
    import ast
    from pathlib import Path

    import kvserve.spec_decode

    forbidden = ("kvserve.engine", "kvserve.server", "kvserve.bench", "kvserve.cli", "kvserve.kv")
    for path in Path(kvserve.spec_decode.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.startswith(forbidden)], (path.name, names)


def test_drafted_rows_see_the_drafts_before_their_position():
    from kvserve.spec_decode.verify import DraftedRow, drafted_rows

    plain = _decoding(SamplingParams(temperature=0, max_tokens=50), [3])
    assert drafted_rows(plain, [7, 8]) == [plain] * 3  # nothing reads history: the request itself
    penalized = _decoding(SamplingParams(temperature=0, frequency_penalty=0.5, max_tokens=50), [3])
    rows = drafted_rows(penalized, [7, 8])
    assert all(isinstance(r, DraftedRow) for r in rows)
    assert [r.output_token_ids for r in rows] == [[3], [3, 7], [3, 7, 8]]
    assert all(r.prompt_token_ids == penalized.prompt_token_ids for r in rows)
    assert penalized.output_token_ids == [3]  # the request itself is untouched
    blocked = _decoding(SamplingParams(temperature=0, min_tokens=3, max_tokens=50), [3])
    assert [len(r.output_token_ids) for r in drafted_rows(blocked, [7, 8])] == [1, 2, 3]
