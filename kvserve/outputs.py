"""What `LLM.generate` returns: vLLM's offline-API output shapes, so user code carries over."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.kv.misses import PrefixMiss
    from kvserve.kv.pins import PinOutcome


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token; `rank` is 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the `n` samples of a request: everything so far, or (DELTA outputs) only what is new."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and all of its samples so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens not computed: prefix-cache hits, the offload tier's restores included
    metrics: Any = None
    # Why the request failed (finish_reason "error"): its step failed even when run alone. Only this request
    # fails; the engine goes on serving the others.
    error: str | None = None
    num_restored_tokens: int = 0  # of num_cached_tokens, those restored from the KV offload tier (docs/KV_OFFLOAD.md)
    prefix_miss: PrefixMiss | None = None  # why the prefix hit stopped where it did (kv/misses.py)
    pin_outcomes: tuple[PinOutcome, ...] = ()  # what became of its cache_control pins, once finished (kv/pins.py)


def logprob_entry(
    token_id: int,
    logprob: float,
    rank: int,
    top: Mapping[int, float],
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """The per-position logprobs dict as vLLM lays it out: the chosen token first (with its rank),
    then the top-n tokens in rank order. `top` must be in descending order (as the Sampler gives it);
    it may contain the chosen token, which is not repeated."""
    entry = {token_id: Logprob(logprob, rank, decode(token_id) if decode else None)}
    for position, (tid, lp) in enumerate(top.items(), start=1):
        if tid not in entry:
            entry[tid] = Logprob(lp, position, decode(tid) if decode else None)
    return entry
