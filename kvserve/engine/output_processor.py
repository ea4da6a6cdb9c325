"""The front end's half of a request (vLLM v1's OutputProcessor): token ids from the engine core in, text out.

Why outside the core: detokenizing, stop strings and logprob text cost per token and per character, and a server's
engine thread would pay them for every stream inside every step (it also had to hold a tokenizer of its own for
them). Here they run wherever the front end runs: in LLMEngine's caller, or on the serving event loop beside each
request's stream (AsyncLLMEngine's RequestStream). A stop string found here ends the sample at once for its
consumer; `absorb` reports it so that the caller hands it back to the core (EngineCore.stop_sequence), which frees
its blocks: tokens the core produced for it meanwhile are dropped here.

The text equals what the engine produced when it detokenized itself: the stop token that ended a sample (EOS, a stop
token id, the token that completed a grammar) is kept out of the text unless include_stop_str_in_output, and text
held back as a possible stop string is released when the sample ends otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.core_outputs import EngineCoreOutput, PositionLogprobs, SequenceDelta
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from kvserve.engine.stats import RequestMetrics
    from kvserve.kv.misses import PrefixMiss
    from kvserve.kv.pins import PinOutcome
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sample:
    """Everything one sample has produced so far, and how much of it a DELTA output has handed out."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_finish: bool = False

    @property
    def has_news(self) -> bool:
        return (
            len(self.token_ids) > self.sent_tokens
            or len(self.text) > self.sent_chars
            or (self.finish_reason is not None and not self.sent_finish)
        )

    def whole(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            None if self.logprobs is None else list(self.logprobs),
            self.finish_reason,
            self.stop_reason,
        )

    def news(self) -> CompletionOutput:
        """What this sample gained since its previous DELTA output; marks it handed out."""
        tokens, chars = len(self.token_ids), len(self.text)
        out = CompletionOutput(
            self.index,
            self.text[self.sent_chars :],
            self.token_ids[self.sent_tokens : tokens],
            self.cumulative_logprob,
            None if self.logprobs is None else self.logprobs[self.sent_tokens : tokens],
            self.finish_reason,
            self.stop_reason,
        )
        self.sent_tokens, self.sent_chars, self.sent_finish = tokens, chars, self.finish_reason is not None
        return out


class RequestState:
    """One request's samples as text, built from its core outputs (`absorb`) and handed out in the kind its
    parameters ask for (`take_output`). Used by one thread: the one that consumes the request's outputs."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params = params
        self._tokenizer = tokenizer
        self._kind = params.output_kind
        self._include_stop = params.include_stop_str_in_output
        self.samples = []
        for index in range(params.n):
            sample = _Sample(index, IncrementalDetokenizer(tokenizer, prompt_token_ids, params))
            if params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            self.samples.append(sample)
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self._sent_prompt_logprobs = False
        self.num_cached_tokens = self.num_restored_tokens = 0
        self.prefix_miss: PrefixMiss | None = None
        self.pin_outcomes: tuple[PinOutcome, ...] = ()
        self.metrics: RequestMetrics | None = None
        self.error: str | None = None
        self.core_finished = False  # the core holds nothing of it any more

    @property
    def finished(self) -> bool:
        """Every sample has ended (by the core's stop conditions, a stop string here, an abort or a failure)."""
        return all(s.finish_reason is not None for s in self.samples)

    def absorb(self, output: EngineCoreOutput) -> list[int]:
        """Take one core output; returns the indices of the samples a stop string ended just now while the core
        still runs them (the caller hands each back: EngineCore.stop_sequence). A fault here (a tokenizer that
        raises) fails this request alone, as one in the core would: its sample ends in "error", the others in
        "abort", `error` says why, and the caller aborts it in the core (`failed`)."""
        self.num_cached_tokens, self.metrics = output.num_cached_tokens, output.metrics
        self.num_restored_tokens = output.num_restored_tokens
        self.prefix_miss = output.prefix_miss
        self.pin_outcomes = output.pin_outcomes or self.pin_outcomes
        self.core_finished = self.core_finished or output.finished
        if output.error is not None:
            self.error = output.error
        stopped = []
        culprit = self.samples[0]
        try:
            if output.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = [None if e is None else self._with_text(e) for e in output.prompt_logprobs]
            for delta in output.sequences:
                culprit = self.samples[delta.index]
                if self._absorb_sample(culprit, delta):
                    stopped.append(delta.index)
        except Exception as exc:  # noqa: BLE001 -- this request's own fault: it fails alone
            self._fail(culprit, exc)
            return []
        return stopped

    @property
    def failed(self) -> bool:
        """The front end failed this request (see absorb): the core must abort it."""
        return self.error is not None and not self.core_finished

    def _fail(self, culprit: _Sample, exc: Exception) -> None:
        logger.error("request %r failed in the front end: %s: %s", self.request_id, type(exc).__name__, exc)
        self.error = f"the engine failed while detokenizing this request: {type(exc).__name__}: {exc}"
        culprit.finish_reason, culprit.stop_reason = "error", None
        for sample in self.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"

    def _absorb_sample(self, sample: _Sample, delta: SequenceDelta) -> bool:
        """Append one sample's new tokens and detokenize them; True when a stop string ended it here first."""
        if sample.finish_reason is not None:  # ended here already: what the core made since is not output
            return False
        last = len(delta.token_ids) - 1
        for i, tid in enumerate(delta.token_ids):
            sample.token_ids.append(tid)
            if sample.logprobs is not None and delta.logprobs is not None:
                entry = self._with_text(delta.logprobs[i])
                sample.logprobs.append(entry)
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + entry[tid].logprob
            ends_on_stop_token = i == last and delta.ends_on_stop_token
            if ends_on_stop_token and not self._include_stop:
                continue  # the stop token itself stays out of the text
            result = sample.detokenizer.append(tid)
            sample.text += result.delta_text
            if result.stopped_on is not None and not ends_on_stop_token:
                sample.finish_reason, sample.stop_reason = "stop", result.stopped_on
                return delta.finish_reason is None  # else the core has ended it too, on a later token
        if delta.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
            if sample.detokenizer.stopped_on is None:
                sample.text += sample.detokenizer.finish().delta_text  # release text held back as a possible stop
        return False

    def _with_text(self, entry: PositionLogprobs) -> PositionLogprobs:
        """The core's entry (handed over: no one else holds it) with each token's text filled in."""
        for tid, logprob in entry.items():
            logprob.decoded_token = self._tokenizer.id_to_token(tid) or ""
        return entry

    def take_output(self) -> RequestOutput | None:
        """The request's output in the kind its parameters ask for, or None when there is nothing to hand out.
        DELTA: only the samples that advanced or finished since the previous output, each with only its new text,
        tokens and logprobs (so a consumer does O(new) work per output); the prompt's logprobs once, in the first.
        FINAL_ONLY: only once finished. CUMULATIVE: everything so far."""
        finished = self.finished
        prompt_logprobs = self.prompt_logprobs
        if self._kind is RequestOutputKind.DELTA:
            samples = [s.news() for s in self.samples if s.has_news]
            if not samples and not finished:
                return None
            if self._sent_prompt_logprobs:
                prompt_logprobs = None
            self._sent_prompt_logprobs = self._sent_prompt_logprobs or prompt_logprobs is not None
        elif self._kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        else:
            samples = [s.whole() for s in self.samples]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=samples,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            error=self.error,
            num_restored_tokens=self.num_restored_tokens,
            prefix_miss=self.prefix_miss,
            pin_outcomes=self.pin_outcomes,
        )


class OutputProcessor:
    """The requests of one synchronous front end (LLMEngine): their states by request id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.states[request_id] = RequestState(self.tokenizer, request_id, prompt, prompt_token_ids, params)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]], list[str]]:
        """The outputs the core's step gives rise to, the (request id, sample) pairs a stop string ended, for the
        core to stop, and the requests that failed here, for the core to abort. A request that has finished here
        is forgotten."""
        results: list[RequestOutput] = []
        stops: list[tuple[str, int]] = []
        failed: list[str] = []
        for core_output in outputs:
            state = self.states.get(core_output.request_id)
            if state is None:  # ended here already (every sample hit a stop string): the core's last word
                continue
            stops.extend((core_output.request_id, index) for index in state.absorb(core_output))
            if state.failed:
                failed.append(core_output.request_id)
            result = state.take_output()
            if result is not None:
                results.append(result)
            if state.finished:
                del self.states[core_output.request_id]
        return results, stops, failed

    def abort(self, request_id: str, final: EngineCoreOutput | None) -> RequestOutput | None:
        """The last output of a request aborted by its caller (None if it was unknown or over)."""
        state = self.states.pop(request_id, None)
        if state is None or final is None:
            return None
        state.absorb(final)
        return state.take_output()
