"""The sampler's grammar mask, row by row: constrained rows sample only allowed tokens, even when the model's
logits leave them no finite candidate; unconstrained rows are untouched."""

from __future__ import annotations

import pytest
import torch
from structured_support import TINY_LOGITS_WIDTH, allowed_ids

from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler
from kvserve.sampling_params import SamplingParams
from kvserve.structured.backend import GrammarBackend
from kvserve.structured.params import StructuredOutputsParams

EOS = 1
DIGITS = StructuredOutputsParams(regex="[0-9]{3}")


def request(i: int, **kw: object) -> Request:
    return Request(f"r{i}", [2, 10, 11], SamplingParams(max_tokens=8, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_finite_allowed_logit_still_samples_an_allowed_token(
    tiny_backends: dict[str, GrammarBackend], temperature: float
) -> None:
    """Every allowed token's logit is NaN, every forbidden one finite: the fallback must keep to the grammar."""
    backend = tiny_backends["xgrammar"]
    matcher = backend.matcher(backend.compile(DIGITS))
    allowed = allowed_ids(matcher, TINY_LOGITS_WIDTH)
    logits = torch.randn(1, TINY_LOGITS_WIDTH, generator=torch.Generator().manual_seed(0))
    logits[0, sorted(allowed)] = float("nan")
    token = Sampler([EOS], seed=0)(logits, [request(0, temperature=temperature, seed=3)], [matcher])[0]
    assert token.token_id in allowed


def test_unconstrained_rows_untouched(tiny_backends: dict[str, GrammarBackend]) -> None:
    backend = tiny_backends["xgrammar"]
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, TINY_LOGITS_WIDTH, generator=gen)

    def requests() -> list[Request]:  # fresh ones each time: a seeded request's generator advances
        return [
            request(0, temperature=0.0, logprobs=2),
            request(1, temperature=0.0),
            request(2, temperature=0.9, seed=4, logprobs=2),
        ]

    plain = Sampler([EOS], seed=0)(logits.clone(), requests())
    matcher = backend.matcher(backend.compile(DIGITS))
    masked_input = logits.clone()
    mixed = Sampler([EOS], seed=0)(masked_input, requests(), [None, matcher, None])
    assert mixed[0] == plain[0] and mixed[2] == plain[2]
    assert torch.equal(masked_input[[0, 2]], logits[[0, 2]])  # only the constrained row may be masked in place
    assert mixed[1].token_id in allowed_ids(backend.matcher(backend.compile(DIGITS)), TINY_LOGITS_WIDTH)


def test_all_rows_unconstrained_is_the_plain_path() -> None:
    logits = torch.randn(2, TINY_LOGITS_WIDTH, generator=torch.Generator().manual_seed(2))

    def requests() -> list[Request]:
        return [request(0, temperature=0.0), request(1, temperature=0.5, seed=9)]

    assert Sampler([EOS], seed=0)(logits, requests(), [None, None]) == Sampler([EOS], seed=0)(logits, requests())


def test_matchers_must_match_the_rows() -> None:
    with pytest.raises(ValueError, match="matchers"):
        Sampler([EOS])(torch.zeros(2, 8), [request(0), request(1)], [None])
