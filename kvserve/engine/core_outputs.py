"""What the engine core emits each step: token ids and numbers, never text (vLLM v1's EngineCoreOutput).

Why ids only: detokenizing, stop strings and logprob text are the front end's (engine/output_processor.py), so the
engine thread runs no tokenizer and a server's text work happens beside its streams, not inside every step. Each
output is a delta: per sequence, the tokens (and their logprobs) gained since the previous output of its request.
A front end that needs the whole request keeps it (OutputProcessor, DeltaTracker)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.stats import RequestMetrics
from kvserve.kv.misses import PrefixMiss
from kvserve.kv.pins import PinOutcome
from kvserve.outputs import Logprob

# The stop_reason of a sequence whose grammar refused a token its own mask allowed: no way on from there
# (docs/STRUCTURED_OUTPUT.md).
GRAMMAR_DEAD_END = "grammar_dead_end"

# One position's logprobs as vLLM lays them out (the chosen token first, then the top-n in rank order); in a core
# output each Logprob's decoded_token is None: the front end fills it in.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class SequenceDelta:
    """What one of a request's n sequences gained since the previous output (tokens, or only its finish)."""

    index: int  # 0..n-1
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None  # one per token, when the request asked for logprobs
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None  # the stop token id that ended it, or GRAMMAR_DEAD_END (stop strings: the front end)
    ends_on_stop_token: bool = False  # its last token is the stop token that ended it (kept out of the text)


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step. `finished`: the core holds nothing of it any more (every sequence
    finished, or the request was aborted or failed); its final output carries every sequence's finish."""

    request_id: str
    sequences: list[SequenceDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # once, in the first output after the prompt
    error: str | None = None  # why the request failed (finish_reason "error"), when it did
    num_restored_tokens: int = 0  # of num_cached_tokens, those restored from the KV offload tier
    prefix_miss: PrefixMiss | None = None  # why its prefix hit stopped where it did (kv/misses.py)
    pin_outcomes: tuple[PinOutcome, ...] = ()  # what became of its cache_control pins, once finished (kv/pins.py)
