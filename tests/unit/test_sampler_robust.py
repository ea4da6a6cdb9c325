"""Hostile sampling: whatever the parameters or the model do to the logits, the sampler returns real token ids
(issue 14: an infinite temperature with min_tokens, or repetition_penalty=1e-45, drew id == vocab size), and
SamplingParams rejects, in float32 terms, the values that cause it."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler
from kvserve.sampling_params import SamplingParams

EOS = 3
VOCAB = 64
NAN, INF = float("nan"), float("inf")


def req(output=(), **params) -> Request:
    r = Request("r", [5, 6, 7, 8], SamplingParams(**params))
    r.output_token_ids = list(output)
    return r


def forced(request: Request, **fields: float) -> Request:
    """A request whose parameters bypass validation: the sampler must cope even with those."""
    for name, value in fields.items():
        setattr(request.sampling_params, name, value)
    return request


def logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def ids(sampler_logits: torch.Tensor, requests: list[Request], seed: int = 0) -> list[int]:
    return [t.token_id for t in Sampler([EOS], seed=seed)(sampler_logits, requests)]


def in_vocab(tokens: list[int]) -> bool:
    return all(0 <= t < VOCAB for t in tokens)


@pytest.mark.parametrize("temperature", [INF, 3.0e38, 1e39])
def test_infinite_or_huge_temperature_with_min_tokens_stays_in_vocab(temperature):
    requests = [forced(req(temperature=1.0, min_tokens=2, seed=i), temperature=temperature) for i in range(8)]
    tokens = ids(logits(8), requests)
    assert in_vocab(tokens) and EOS not in tokens


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1e-4])
def test_tiny_repetition_penalty_stays_in_vocab_and_prefers_seen_tokens(temperature):
    rows = logits(4).abs()  # positive logits: dividing by 1e-45 overflows them to +inf
    requests = [req(temperature=temperature, repetition_penalty=1e-45, seed=i) for i in range(4)]
    tokens = ids(rows, requests)
    assert in_vocab(tokens) and set(tokens) <= {5, 6, 7, 8}  # the penalty "rewards" the seen tokens


def test_nan_logits_never_win_and_all_nan_rows_fall_back():
    rows = logits(4)
    favourite = rows.argmax(-1)
    rows[:2, 11] = NAN  # some NaN: the real favourite still wins (greedy) / is a candidate (sampled)
    rows[2:] = NAN  # nothing but NaN: a real id all the same
    requests = [req(temperature=0.0), forced(req(top_k=1), temperature=1.0), req(temperature=0.0), req(seed=1)]
    tokens = ids(rows, requests)
    assert in_vocab(tokens) and tokens[:2] == favourite[:2].tolist()


def test_row_with_every_token_blocked_falls_back_to_the_raw_argmax():
    rows = logits(2)
    requests = [
        forced(req(temperature=0.0), frequency_penalty=INF, presence_penalty=INF),
        forced(req(seed=3), temperature=INF),
    ]
    requests[0].output_token_ids = list(range(VOCAB))  # every token seen: an infinite penalty blocks all
    requests[1].output_token_ids = []
    requests[1].sampling_params.min_tokens = 1
    rows[1] = -INF
    rows[1, EOS] = 1.0  # only eos is finite, and min_tokens blocks it
    tokens = ids(rows, requests)
    assert tokens == [int(rows[0].argmax()), EOS]


def test_input_logits_are_untouched_when_rows_need_fixing():
    rows = logits(3)
    rows[0, 4] = NAN
    rows[1, 9] = INF
    before = rows.clone()
    ids(rows, [req(temperature=0.0), req(temperature=0.0), req(seed=2, repetition_penalty=1e-45)])
    assert torch.equal(rows.isnan(), before.isnan()) and torch.equal(rows.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize(
    "field", ["temperature", "repetition_penalty", "top_p", "min_p", "presence_penalty", "frequency_penalty"]
)
@pytest.mark.parametrize("value", [INF, -INF, NAN, 1e39, -1e39, 10**400])
def test_values_not_finite_in_float32_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: value})
    assert "finite" in str(err.value) or "must be" in str(err.value)


@pytest.mark.parametrize(("field", "value"), [("repetition_penalty", 1e-46), ("top_p", 1e-50)])
def test_values_that_round_to_zero_in_float32_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("temperature", "1"), ("top_p", None), ("min_p", True)])
def test_non_numbers_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_finite_float32_extremes_are_accepted():
    SamplingParams(temperature=3.0e38, repetition_penalty=1e-45, top_p=1e-40, min_p=1e-45)
    SamplingParams(temperature=2, repetition_penalty=3.0e38, top_p=1, min_p=0)
    assert math.isfinite(SamplingParams(temperature=3.0e38).temperature)


def test_greedy_with_the_native_row_max_chooses_what_torch_does():
    """The engine's sampler takes the native kernels' row max for greedy rows (kernels/row_max.cpp): on hostile rows
    (some NaN, all NaN, all -inf, +inf, ties, a huge vocabulary) it picks the ids torch's max(dim=-1) leads to."""
    from kvserve.kernels.native import cpu_supports_native
    from kvserve.kernels.ops import NativeKernels, load_kernels
    from kvserve.model.tokenizer import default_cache_dir

    if not cpu_supports_native()[0]:
        pytest.skip("no native kernels on this CPU")
    native = load_kernels(default_cache_dir() / "kernels")
    assert isinstance(native, NativeKernels)
    for vocab in (VOCAB, 262_147):
        rows = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
        rows[0, 11] = NAN
        rows[1] = NAN
        rows[2] = -INF
        rows[3, 7] = INF
        rows[4] = 2.0  # a tie everywhere: the first index
        rows[5, [9, 40]] = 99.0  # a tie of two: the first
        rows[6, -1] = 1e30  # the last column
        requests = [req(temperature=0.0) for _ in range(8)]
        want = [t.token_id for t in Sampler([EOS], seed=0)(rows.clone(), requests)]
        got = [t.token_id for t in Sampler([EOS], seed=0, row_max=native.row_max)(rows.clone(), requests)]
        assert got == want
        assert got[4] == 0 and got[5] == 9 and got[6] == vocab - 1
