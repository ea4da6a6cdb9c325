"""Verification of drafted tokens against the target model: greedy, and speculative sampling.

With an n-gram draft the draft distribution is a point mass on the drafted token t, so the speculative-sampling
rule (Leviathan et al. 2023, Chen et al. 2023) reads: accept t with probability p(t); on rejection, sample from p
with t removed and renormalized. Sampling x ~ p as usual and accepting t iff x == t is that rule exactly: P(accept)
= p(t), and a rejected x is distributed as p restricted to tokens other than t. So verification samples each
position as a one-token step would (the sampler, with the request's own generator), in order, and stops at the
first position whose token differs from the draft. A seeded request then draws one number per token it gains,
exactly as without drafting: its output is the same token for token whether or not drafting ran, whatever else
is in the batch (the adaptive gate may switch drafting on and off between steps)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvserve.structured.matcher import draft_masks

if TYPE_CHECKING:
    import torch

    from kvserve.sampling_params import SamplerRow, SamplingParams
    from kvserve.structured.matcher import GrammarMatcher, RowMask


class _Sampled(Protocol):
    @property
    def token_id(self) -> int: ...


SampledT = TypeVar("SampledT", bound=_Sampled)
# The engine's sampler as verification uses it: logits rows, their sampler rows and grammar masks -> one token each.
RowSampler = Callable[["torch.Tensor", "list[SamplerRow]", "list[RowMask] | None"], "list[SampledT]"]


def verify_by_sampling(draft: Sequence[int], sample_at: Callable[[int], int]) -> list[int]:
    """The tokens a drafted request gains: `sample_at(i)` is the target's token after position i of the verified
    chunk (0: after the request's last real token), asked in order and only while the drafts before it were
    accepted. Accepted drafts, then the first token that differs from the draft (or the bonus after the last)."""
    gained: list[int] = []
    for i in range(len(draft) + 1):
        token = sample_at(i)
        gained.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return gained


def verify_greedy(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """verify_by_sampling with every position's (greedy) token known up front: `target[i]` is the argmax after
    position i, len(draft) + 1 of them, computed in one batched call."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(target)} target tokens for {len(draft)} drafts; expected {len(draft) + 1}")
    return verify_by_sampling(draft, target.__getitem__)


@dataclass(frozen=True, slots=True)
class DraftedRow:
    """The sampler's view of a drafted request at verified position i: its output as it will be if the drafts
    before i are accepted (`output + draft[:i]`). Penalties (repetition over prompt + output, presence and
    frequency over output) and min_tokens blocking read those tokens, so each row is judged exactly as a one-token
    step at that point would judge it; a row is used only while the drafts before it are accepted."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


def drafted_rows(request: SamplerRow, draft: Sequence[int]) -> list[SamplerRow]:
    """One sampler row per verified position of `request` (len(draft) + 1). A request whose sampling reads no
    history (no penalties, min_tokens met whatever the drafts) is its own row at every position."""
    params = request.sampling_params
    if not params.has_penalties and len(request.output_token_ids) >= params.min_tokens:
        return [request] * (len(draft) + 1)
    out = request.output_token_ids
    return [
        DraftedRow(params, request.prompt_token_ids, out + list(draft[:i]), request.generator)
        for i in range(len(draft) + 1)
    ]


def verify_draft(
    sample: RowSampler[SampledT],
    request: SamplerRow,
    draft: Sequence[int],
    logits: torch.Tensor,
    matcher: GrammarMatcher | None,
) -> list[SampledT]:
    """The tokens one drafted request gains from its verified chunk (`logits`: len(draft) + 1 rows): the sampler's
    own choice at each position, the drafts accepted up to the first mismatch and the sampler's token there. Each
    position's row sees the drafts before it as output tokens (penalties, min_tokens: DraftedRow) and is masked by
    the grammar's state after them (matcher.draft_masks), so it is what a one-token step there would have chosen.
    Greedy rows in one call; a sampled request one row at a time, so that a seeded request draws once per token it
    gains. Each token comes with its row's logprobs when the request asked for them."""
    rows = drafted_rows(request, draft)
    masks = None if matcher is None else draft_masks(matcher, draft, logits.shape[1])
    if request.sampling_params.is_greedy:
        targets = sample(logits, rows, masks)
        return targets[: len(verify_greedy(draft, [t.token_id for t in targets]))]
    gained: list[SampledT] = []

    def sample_at(i: int) -> int:
        token = sample(logits[i : i + 1], rows[i : i + 1], None if masks is None else masks[i : i + 1])[0]
        gained.append(token)
        return token.token_id

    verify_by_sampling(draft, sample_at)
    return gained
