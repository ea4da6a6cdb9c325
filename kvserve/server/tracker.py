"""The server's one place that follows an engine request's DELTA outputs, sample by sample.

Why one tracker for both routes: the engine hands out only what is new (RequestOutputKind.DELTA), so a
stream formats each piece as it comes (O(new) per output, not O(everything so far)), and a non-streamed
response needs the whole; completions and chat both need both, with the same bookkeeping (how many tokens
and characters came before a piece, for logprob contexts and text offsets; the first piece of a sample,
for echo and the role chunk; when a sample finished). Keeping it here means one place to get it right.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv.misses import PrefixMiss
from kvserve.kv.pins import PinOutcome
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput

LogprobEntry = dict[int, Logprob]


@dataclass(slots=True)
class ChoiceDelta:
    """What one sample gained in one output, and where in the sample it starts."""

    index: int  # the sample's index within its prompt (0..n-1)
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    first_token: int  # tokens of this sample before this piece
    first_char: int  # characters of this sample's text before this piece
    finish_reason: str | None
    stop_reason: int | str | None
    is_first: bool  # the sample's first piece (echo prefix, role chunk)


@dataclass(slots=True)
class _Sample:
    """Everything one sample has produced so far (lists extended in place: linear overall)."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    num_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False

    def add(self, c: CompletionOutput) -> ChoiceDelta:
        delta = ChoiceDelta(
            c.index,
            c.text,
            list(c.token_ids),
            c.logprobs,
            len(self.token_ids),
            self.num_chars,
            c.finish_reason,
            c.stop_reason,
            is_first=not self.started,
        )
        self.started = True
        self.text_parts.append(c.text)
        self.num_chars += len(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(c.logprobs)
        self.cumulative_logprob = c.cumulative_logprob
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        return delta

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            "".join(self.text_parts),
            self.token_ids,
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )


class DeltaTracker:
    """Accumulates one engine request's DELTA outputs: the pieces for a stream, the whole for a response."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs: list[LogprobEntry | None] | None = None
        self.num_cached_tokens = 0
        self.num_restored_tokens = 0  # of num_cached_tokens, from the KV offload tier
        self.prefix_miss: PrefixMiss | None = None  # why the prefix hit stopped where it did (kv/misses.py)
        self.pin_outcomes: tuple[PinOutcome, ...] = ()  # what became of its cache_control pins (kv/pins.py)
        self.finished = False
        self._samples: dict[int, _Sample] = {}
        self._last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> list[ChoiceDelta]:
        """Take one DELTA output; return each sample's new piece (a sample that only finished gives an empty
        piece with its finish reason)."""
        if output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = output.prompt_logprobs
        self.num_cached_tokens = output.num_cached_tokens
        self.num_restored_tokens = output.num_restored_tokens
        self.prefix_miss = output.prefix_miss
        self.pin_outcomes = output.pin_outcomes or self.pin_outcomes
        self.finished = output.finished
        self._last = output
        return [self._samples.setdefault(c.index, _Sample(c.index)).add(c) for c in output.outputs]

    def generated(self, index: int) -> list[int]:
        """The token ids sample `index` has produced so far."""
        sample = self._samples.get(index)
        return sample.token_ids if sample is not None else []

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self._samples.values())

    def result(self) -> RequestOutput:
        """The whole request so far, as one cumulative output (samples in index order)."""
        if self._last is None:
            raise RuntimeError("no output was received for this request")
        samples = [self._samples[i].output() for i in sorted(self._samples)]
        return RequestOutput(
            self._last.request_id,
            self._last.prompt,
            self.prompt_token_ids,
            self.prompt_logprobs,
            samples,
            self.finished,
            self.num_cached_tokens,
            self._last.metrics,
            num_restored_tokens=self.num_restored_tokens,
        )
