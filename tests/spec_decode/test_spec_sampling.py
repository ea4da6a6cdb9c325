"""Speculative sampling keeps the target distribution: statistically at the verification rule with the real
sampler, and exactly in the engine (a seeded request's tokens are the same with and without drafting)."""

from __future__ import annotations

import functools

import torch

from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.verify import verify_by_sampling


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _sample_row(sampler: Sampler, logits: torch.Tensor, request: Request, row: int) -> int:
    return sampler(logits[row : row + 1], [request])[0].token_id


def test_verification_keeps_the_target_distribution_at_every_position():
    """Draft [t0, t1] against two positions' logits: the first gained token ~ p0 (so the draft t0 is accepted with
    probability p0(t0) and a rejection follows p0 without t0, renormalized), and after an acceptance the next ~ p1."""
    logits = torch.tensor(
        [[1.0, 0.5, 0.0, -0.5, -1.0, 0.2], [0.0, 1.2, -0.3, 0.4, -1.0, 0.1], [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]]
    )
    draft = [1, 3]
    sampler = Sampler([99], seed=7)
    request = Request("r", [0], SamplingParams(temperature=1.0))
    n = 6000
    firsts, seconds, rejected = [], [], []
    for _ in range(n):
        gained = verify_by_sampling(draft, functools.partial(_sample_row, sampler, logits, request))
        firsts.append(gained[0])
        if gained[0] == draft[0]:
            seconds.append(gained[1])
        else:
            assert len(gained) == 1
            rejected.append(gained[0])
    p0, p1 = torch.softmax(logits[0], -1).double(), torch.softmax(logits[1], -1).double()
    # 5 degrees of freedom: the 99.99th percentile is ~25.7; the sampler's fixed seed keeps it stable.
    assert _chi_square(torch.bincount(torch.tensor(firsts), minlength=6).double(), p0) < 26.0
    assert _chi_square(torch.bincount(torch.tensor(seconds), minlength=6).double(), p1) < 26.0
    residual = p0.clone()
    residual[draft[0]] = 0
    keep = residual > 0
    counts = torch.bincount(torch.tensor(rejected), minlength=6).double()
    assert counts[draft[0]] == 0
    assert _chi_square(counts[keep], residual[keep] / residual.sum()) < 24.0  # 4 degrees of freedom
    assert abs(len(seconds) / n - float(p0[draft[0]])) < 0.03  # acceptance rate p0(t0)


def test_a_seeded_request_draws_once_per_token_gained():
    """Verification leaves the generator where one-token steps would: the same stream of tokens."""
    logits = torch.tensor([[0.5, 0.1, 0.0, 0.2]] * 4)
    alone, drafted = Sampler([99], seed=0), Sampler([99], seed=0)
    plain = Request("a", [0], SamplingParams(temperature=1.0, seed=11))
    spec = Request("b", [0], SamplingParams(temperature=1.0, seed=11))
    reference = [alone(logits[:1], [plain])[0].token_id for _ in range(40)]
    got: list[int] = []
    while len(got) < 40:
        draft = reference[len(got) + 1 : len(got) + 4] if len(got) % 2 else [3, 3, 3]  # right and wrong drafts
        got += verify_by_sampling(draft, functools.partial(_sample_row, drafted, logits, spec))
    assert got[:40] == reference
