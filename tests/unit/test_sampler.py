"""Sampler: vLLM semantics of greedy, temperature, top-k/p, min-p, penalties, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler, apply_penalties, prompt_logprobs, top_k_top_p_threshold
from kvserve.sampling_params import SamplingParams

EOS = 3


def req(prompt=(0,), output=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params))
    r.output_token_ids = list(output)
    return r


def rand_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def sample_ids(logits, requests, seed=0):
    return [t.token_id for t in Sampler([EOS], seed=seed)(logits, requests)]


def test_greedy_is_argmax_and_input_untouched():
    logits = rand_logits(6, 50)
    before = logits.clone()
    assert sample_ids(logits, [req(temperature=0.0) for _ in range(6)]) == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=5, top_p=1e-6)])
def test_degenerate_filters_are_greedy(params):
    logits = rand_logits(16, 300, seed=1)
    got = sample_ids(logits, [req(temperature=1.0, seed=i, **params) for i in range(16)])
    assert got == logits.argmax(-1).tolist()


def _reference_threshold(row: torch.Tensor, top_k: int, top_p: float) -> float:
    """Sort-based top-k then top-p, as vLLM describes them."""
    vals = row.sort(descending=True).values
    if top_k > 0:
        vals = vals[:top_k]
    probs = torch.softmax(vals.double(), -1)
    before = probs.cumsum(-1) - probs
    keep = int((before < top_p).sum()) if top_p < 1.0 else len(vals)
    return float(vals[max(keep, 1) - 1])


# Flat rows need more than the first topk windows: they go through the bucket select.
@pytest.mark.parametrize(("scale", "vocab"), [(0.01, 3000), (1.0, 3000), (8.0, 3000), (0.3, 20000), (2.0, 20000)])
def test_top_k_top_p_threshold_matches_sorting(scale, vocab):
    logits = rand_logits(12, vocab, seed=2, scale=scale)
    params = [
        SamplingParams(top_k=k, top_p=p)
        for k, p in [
            (0, 0.9),
            (0, 0.5),
            (10, 1.0),
            (100, 0.8),
            (2000, 0.95),
            (-1, 0.99),
            (1, 1.0),
            (0, 1e-6),
            (50, 0.3),
            (vocab, 0.7),
            (0, 0.999),
            (5000, 0.6),
        ]
    ]
    probs = (logits - logits.amax(-1, keepdim=True)).exp()  # the sampler's unnormalized probs
    threshold = top_k_top_p_threshold(probs, params)
    for i, p in enumerate(params):
        kept = int((probs[i] >= threshold[i]).sum())
        assert kept == int((logits[i] >= _reference_threshold(logits[i], p.top_k, p.top_p)).sum())
    assert top_k_top_p_threshold(probs, [SamplingParams()] * 12).eq(0).all()


def test_sampled_tokens_stay_inside_filters():
    vocab = 200
    logits = rand_logits(1, vocab, seed=3, scale=1.0).expand(400, vocab).contiguous()
    row = logits[0]
    nucleus = set((row >= _reference_threshold(row, 0, 0.5)).nonzero().flatten().tolist())
    top10 = set(row.topk(10).indices.tolist())
    probs = torch.softmax(row, -1)
    above_min_p = set((probs >= 0.5 * probs.max()).nonzero().flatten().tolist())
    for params, allowed in [(dict(top_k=10), top10), (dict(top_p=0.5), nucleus), (dict(min_p=0.5), above_min_p)]:
        got = set(sample_ids(logits, [req(**params) for _ in range(400)], seed=4))
        assert got <= allowed
        assert len(got) > 1


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    ("params", "transform"),
    [
        (dict(temperature=1.0), lambda x: torch.softmax(x, -1)),
        (dict(temperature=2.0), lambda x: torch.softmax(x / 2, -1)),
        (
            dict(temperature=0.5, top_k=3),
            lambda x: torch.softmax(torch.where(x >= x.topk(3).values[-1], x / 0.5, -math.inf), -1),
        ),
    ],
)
def test_temperature_sampling_distribution(params, transform):
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    n = 4000
    got = sample_ids(logits_row.expand(n, 6).contiguous(), [req(**params) for _ in range(n)], seed=123)
    probs = transform(logits_row)
    support = probs > 0
    counts = torch.bincount(torch.tensor(got), minlength=6).double()
    assert counts[~support].sum() == 0
    # 5 degrees of freedom at most: the 99.99th percentile is ~25.7; a fixed seed keeps it stable.
    assert _chi_square(counts[support], probs[support].double()) < 26.0


def test_seeded_rows_ignore_batch_composition_and_position():
    vocab = 1000

    def run(position: int, others: int, other_seed: int) -> list[int]:
        target = req(seed=42, temperature=0.8, top_p=0.95)
        batch = [req(temperature=1.0, seed=other_seed + i if i % 2 else None, top_k=5) for i in range(others)]
        batch.insert(position, target)
        sampler = Sampler([EOS], seed=other_seed)
        for step in range(8):
            logits = rand_logits(len(batch), vocab, seed=step, scale=1.0)
            logits[position] = rand_logits(1, vocab, seed=100 + step, scale=1.0)[0]
            for r, tok in zip(batch, sampler(logits, batch)):
                r.output_token_ids.append(tok.token_id)
        return target.output_token_ids

    reference = run(0, 0, 0)
    assert run(2, 5, 7) == reference
    assert run(6, 6, 99) == reference
    assert len(set(reference)) > 1


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    a = [sample_ids(logits, [req(seed=s)])[0] for s in range(10)]
    assert len(set(a)) > 5


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0]])
    r = req(prompt=[0], output=[2, 2, 4], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, [r])[0].tolist()
    # token 0 (prompt, positive): 2 / 2; token 2 (output twice): -1 * 2 - 0.5 - 2 * 0.25;
    # token 4 (output once): 0 * 2 - 0.5 - 0.25; tokens 1 and 3 were never seen.
    assert got == pytest.approx([1.0, 1.0, -3.0, 0.5, -0.75])


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.tensor([[1.0, 1.0]])
    r = req(prompt=[0, 0], output=[1], presence_penalty=1.0, frequency_penalty=1.0)
    assert apply_penalties(logits, [r])[0].tolist() == pytest.approx([1.0, -1.0])


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample_ids(logits, [req(output=[0], temperature=0.0)]) == [0]
    assert sample_ids(logits, [req(output=[0], temperature=0.0, repetition_penalty=1.2)]) == [1]
    assert sample_ids(logits, [req(output=[0], temperature=0.0, frequency_penalty=0.2)]) == [1]


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]])  # eos (3) is the argmax, stop id 4 next
    common = dict(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    assert sample_ids(logits, [req(output=[1], **common)]) == [2]
    assert sample_ids(logits, [req(output=[1, 1], **common)]) == [EOS]
    # With ignore_eos, eos never stops the request, so (as in vLLM) it is not blocked either.
    assert sample_ids(logits, [req(output=[], ignore_eos=True, **common)]) == [EOS]


def test_logprobs_are_raw_and_include_the_sampled_token():
    logits = rand_logits(4, 100, seed=5)
    requests = [
        req(temperature=0.0, logprobs=3, repetition_penalty=1.5, output=[int(logits[0].argmax())]),
        req(temperature=0.7, logprobs=0, seed=1),
        req(temperature=1.0),
        req(temperature=1.3, logprobs=5, top_k=20, seed=2),
    ]
    out = Sampler([EOS], seed=0)(logits, requests)
    raw = torch.log_softmax(logits, -1)
    assert out[2].logprob is None and out[2].top_logprobs is None
    assert out[0].token_id != int(logits[0].argmax())  # the penalty moved the choice
    for i, n in [(0, 3), (1, 0), (3, 5)]:
        tok = out[i]
        assert tok.logprob == pytest.approx(raw[i, tok.token_id].item())
        assert tok.rank == int((raw[i] > raw[i, tok.token_id]).sum()) + 1
        top_ids = raw[i].topk(n).indices.tolist() if n else []
        assert list(tok.top_logprobs)[:n] == top_ids
        assert tok.token_id in tok.top_logprobs
        assert len(tok.top_logprobs) == n + (tok.token_id not in top_ids)
        for t, lp in tok.top_logprobs.items():
            assert lp == pytest.approx(raw[i, t].item())


def test_prompt_logprobs():
    logits = rand_logits(5, 40, seed=6)
    next_ids = [7, 1, 39, 0, 7]
    got = prompt_logprobs(logits, next_ids, num_top=2)
    raw = torch.log_softmax(logits, -1)
    assert len(got) == 5
    for j, (entry, tid) in enumerate(zip(got, next_ids)):
        assert next(iter(entry)) == tid  # the prompt token comes first
        assert entry[tid].logprob == pytest.approx(raw[j, tid].item())
        assert entry[tid].rank == int((raw[j] > raw[j, tid]).sum()) + 1
        top = raw[j].topk(2).indices.tolist()
        assert all(t in entry for t in top) and len(entry) == 2 + (tid not in top)
        assert [entry[t].rank for t in top if t != tid] == [r + 1 for r, t in enumerate(top) if t != tid]
    assert prompt_logprobs(logits[:0], [], num_top=3) == []
    with pytest.raises(ValueError):
        prompt_logprobs(logits, next_ids[:2], num_top=0)


def test_large_vocab_mixed_batch_runs():
    vocab = 262_144
    logits = rand_logits(6, vocab, seed=7, scale=2.0)
    requests = [
        req(temperature=0.0),
        req(temperature=0.8, top_p=0.9, seed=1),
        req(temperature=1.0, top_k=40),
        req(temperature=1.0, min_p=0.1, logprobs=5),
        req(temperature=1.0, repetition_penalty=1.1, output=[5, 6]),
        req(temperature=2.0, top_p=0.95, top_k=100000),
    ]
    out = Sampler([EOS], seed=0)(logits, requests)
    assert out[0].token_id == int(logits[0].argmax())
    assert all(0 <= t.token_id < vocab for t in out)
    assert out[2].token_id in set(logits[2].topk(40).indices.tolist())
