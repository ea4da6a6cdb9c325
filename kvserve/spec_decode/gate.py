"""Which requests draft this step, the drafts themselves, and the acceptance counters behind the metrics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.drafter import make_drafter
from kvserve.structured.matcher import validate_tokens

if TYPE_CHECKING:
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.matcher import GrammarMatcher


class DraftRequest(Protocol):
    """What drafting reads and writes of a request (the engine's Request satisfies it)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    spec_token_ids: list[int]
    spec_num_drafted: int
    spec_num_accepted: int

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...


@dataclass(slots=True)
class SpecDecodeStats:
    """Totals since start, under vLLM's metric names (kvserve:spec_decode_num_*_total)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token at draft position i was accepted (so it never rises along i); vLLM's
    # spec_decode_num_accepted_tokens_per_pos. Where acceptance falls off says how many tokens are worth drafting.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class SpecDecoder:
    """The engine's speculative-decoding part: proposes drafts before a step and counts what verification
    accepted after it. Holds the config, the totals and the drafter (config.method's; the suffix drafter keeps
    per-request tries, released by `on_finished`); per-request acceptance lives on the request."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.drafter = make_drafter(config)
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)

    def propose(
        self,
        running: Iterable[DraftRequest],
        grammars: Mapping[str, GrammarMatcher | None],
        max_model_len: int,
        num_running: int,
    ) -> None:
        """Set every running request's `spec_token_ids` for the coming step (empty: no drafting). `grammars`:
        the constrained requests' matchers, by request id (None: not made yet, so no draft)."""
        enabled = num_running <= self.config.disable_by_batch_size
        for request in running:
            draft: list[int] = []
            if enabled and self.wants_draft(request, grammars):
                draft = self._draft(request, max_model_len)
                matcher = grammars.get(request.request_id)
                if draft and matcher is not None:  # only what the grammar allows: verification masks by it
                    draft = draft[: validate_tokens(matcher, draft)]
            request.spec_token_ids = draft

    def wants_draft(self, request: DraftRequest, grammars: Mapping[str, GrammarMatcher | None]) -> bool:
        """Decoding (one token to compute), a grammar's matcher ready if it has a grammar, and its acceptance not
        too low. Every sampling option verifies exactly: each verified position's sampler row sees the drafts
        before it (verify.DraftedRow: penalties, min_tokens) and, with a grammar, is masked by the grammar's state
        after them (structured.matcher.draft_masks), as a one-token step there would be."""
        if request.num_computed_tokens + 1 != request.num_tokens:
            return False
        if request.request_id in grammars and grammars[request.request_id] is None:
            return False
        cfg = self.config
        return (
            request.spec_num_drafted < cfg.acceptance_window
            or request.spec_num_accepted >= cfg.min_acceptance_rate * request.spec_num_drafted
        )

    def _draft(self, request: DraftRequest, max_model_len: int) -> list[int]:
        """Drafts capped so that the verified tokens stay within max_tokens and max-model-len."""
        params = request.sampling_params
        k = min(self.config.num_speculative_tokens, max_model_len - request.num_tokens)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - len(request.output_token_ids) - 1)
        if k <= 0:
            return []
        return self.drafter.propose(request, k)

    def on_finished(self, request: DraftRequest) -> None:
        """`request` finished or was aborted (call once, when the engine forgets it): the drafter lets go of it."""
        self.drafter.on_finished(request)

    def record(self, request: DraftRequest, num_drafted: int, num_accepted: int) -> None:
        """Count one verified draft of `request`."""
        request.spec_num_drafted += num_drafted
        request.spec_num_accepted += num_accepted
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
        per_pos = self.stats.num_accepted_tokens_per_pos
        for pos in range(num_accepted):  # accepted drafts are a prefix of the draft: positions 0..num_accepted-1
            per_pos[pos] += 1
