"""The drafting method behind one small interface, chosen by the config's `method`: the gate asks a `Drafter` for
up to k tokens and tells it when a request is finished, so n-gram and suffix drafting are interchangeable."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvserve.spec_decode.ngram import propose_ngram
from kvserve.spec_decode.suffix import SuffixDrafter

if TYPE_CHECKING:
    from kvserve.spec_decode.config import SpeculativeConfig


class DraftSource(Protocol):
    """What a drafter reads of a request: its id and real tokens (never its drafts)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class Drafter(Protocol):
    def propose(self, request: DraftSource, k: int) -> list[int]:
        """Up to `k` (>= 1) tokens that may follow the request's tokens; empty: no guess."""
        ...

    def on_finished(self, request: DraftSource) -> None:
        """The request finished or was aborted: release what is held for it."""
        ...


class NgramDrafter:
    """Prompt lookup over the request's own prompt + output; stateless."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request: DraftSource, k: int) -> list[int]:
        return propose_ngram(request.prompt_token_ids + request.output_token_ids, k, self.min_n, self.max_n)

    def on_finished(self, request: DraftSource) -> None:
        pass


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The drafter of `config.method` (the config has checked that kvserve has it)."""
    if config.method == "suffix":
        return SuffixDrafter(
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
    return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
