"""Scheduler: decides, each step, how many tokens of which requests go into the next forward pass."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.engine.core_outputs import GRAMMAR_DEAD_END
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampledToken
from kvserve.engine.stop_checker import check_stop
from kvserve.kv.events import AdmissionRefused
from kvserve.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from kvserve.kv.offload.connector import OffloadConnector, PendingLoad


# The waiting requests, from the front, whose state snapshot hits each step marks recently used (keep_state_hit): those
# next in line; a lookup each, every step.
KEPT_STATE_HITS = 32


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # new tokens computed this step: a prefill chunk, or 1 for a decode (+ drafted tokens)
    start: int  # the request's num_computed_tokens before this step (its first new position)
    # Speculative decoding: tokens drafted after the request's last token, verified in this step (counted in
    # num_tokens, not in the request's tokens).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def completes_sequence(self) -> bool:
        """True when this step computes the last known token, so a new token is sampled."""
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # What each preempted request had before it lost its blocks: (computed tokens, blocks held).
    preempted_held: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Waiting requests whose grammar failed to compile: finished (error) by the scheduler, reported by the engine.
    grammar_failed: list[tuple[Request, BaseException]] = field(default_factory=list)
    # The first waiting request, when it stayed waiting only because the pool lacked blocks for it: the inspector's
    # AdmissionRefused event, decided here and nowhere else.
    refused: AdmissionRefused | None = None
    # Requests admitted for the first time whose prefix hit stopped short, and why (Request.prefix_miss): the
    # inspector's PrefixMissed events.
    missed: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class TokenSink(Protocol):
    """What the engine does per token as the scheduler appends a sequence's new tokens (update_from_output): the parts
    of a sequence the scheduler does not own (its grammar matcher, its logprobs, the engine's counters)."""

    def admit(self, request: Request, token: SampledToken) -> bool:
        """Before `token` joins the output: advance the sequence's grammar, if any; False when the grammar refuses it
        (a dead end: the sequence ends with what it has). Raises for a fault of this request alone."""
        ...

    def record(self, request: Request, token: SampledToken) -> bool:
        """After it joined: record its logprobs and counts; True when the sequence's grammar is now complete."""
        ...

    def failed(self, request: Request, exc: Exception) -> None:
        """A fault of this request while its tokens were appended: it fails alone (the engine finishes it)."""
        ...


class PlainSink:
    """A TokenSink for sequences without grammars or logprobs (the scheduler's tests): every token is admitted."""

    def admit(self, request: Request, token: SampledToken) -> bool:
        return True

    def record(self, request: Request, token: SampledToken) -> bool:
        return False

    def failed(self, request: Request, exc: Exception) -> None:
        raise exc


class Scheduler:
    """Continuous batching under a token budget, FCFS, with chunked prefill mixed into decode steps and
    recompute preemption of the newest running request when the pool runs dry.

    Fault isolation: after a failed step, `quarantine` sends every request of that step back to waiting
    as a suspect. A suspect runs alone (one per step, before anything else) until it samples a token; one
    that fails alone is the culprit, and the engine fails it by itself."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_num_partial_prefills: int | None = None,
        offload: OffloadConnector | None = None,
        eos_token_ids: tuple[int, ...] = (),
        long_prefill_token_threshold: int = 0,
        max_long_partial_prefills: int = 1,
        attention_break_even_tokens: int = 0,
    ) -> None:
        self.kv = kv_manager
        self.eos_token_ids = eos_token_ids
        self.offload = offload  # the KV offload tier's scheduler side (kv/offload/connector.py), or None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # Requests whose prompts may be unfinished after a step (vLLM's max_num_partial_prefills; None: any number)
        self.max_num_partial_prefills = max_num_partial_prefills
        # Long prompts (vLLM's --long-prefill-token-threshold; 0: none): a prompt with more than this many tokens left
        # to compute (more than one chunk, where chunks shrink with the context) takes at most this many a step, at
        # most max_long_partial_prefills of them at once, and yields to the other requests (_fill says how). Only with
        # chunked prefill.
        self.long_prefill_token_threshold = long_prefill_token_threshold if enable_chunked_prefill else 0
        self.max_long_partial_prefills = max_long_partial_prefills
        # A long prompt's chunk shrinks as its context grows, so that every chunk's step costs about what the first
        # did: threshold x K / (K + context), K the model's attention_break_even_tokens (0: not scaled).
        self.attention_break_even_tokens = attention_break_even_tokens
        # Tokens computed for other requests since a long prompt last got a chunk (at most the threshold: owed then).
        self.tokens_since_long_chunk = self.long_prefill_token_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.suspects: set[str] = set()  # request ids of a failed step's requests, each to be run alone
        # Grammars still compiling, by request id: such a request waits (others pass it) until its future is done.
        self.pending_grammars: dict[str, Future[Any]] = {}

    def add(self, request: Request, grammar: Future[Any] | None = None) -> None:
        """Queue `request`; with `grammar` (its constraint compiling), it is admitted only once that is done."""
        if grammar is not None and (not grammar.done() or grammar.exception() is not None):
            self.pending_grammars[request.request_id] = grammar  # a failed one is reported at the next schedule
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        self.kv.expire_pins()
        if self.offload is not None:
            self.offload.reap_orphan_loads()
            self.offload.release_done_loads()
        if self.suspects:
            suspect = self._next_suspect()
            if suspect is not None:
                return self._schedule_alone(suspect)
            self.suspects.clear()  # stale ids only (cannot happen: finish() discards them); never get stuck
        out = SchedulerOutput()
        if self.kv.state_snapshots is not None:  # before this step's saves: the snapshots queued requests start from
            for waiting in itertools.islice(self.waiting, min(self.max_num_seqs, KEPT_STATE_HITS)):
                self.kv.keep_state_hit(waiting)
        threshold = self.long_prefill_token_threshold
        long_turn = self.tokens_since_long_chunk >= threshold
        if self._fill(out, long_turn) and not out.scheduled:  # long prompts yielded to requests that could not run
            out.refused = None
            self._fill(out, long_turn=True)
        if threshold:
            if any(self._is_long(s.request, s.start) for s in out.scheduled):
                self.tokens_since_long_chunk = 0
            else:
                self.tokens_since_long_chunk = min(threshold, self.tokens_since_long_chunk + out.num_tokens)
        return out

    def _long_chunk(self, start: int) -> int:
        """The most tokens a long prompt with `start` tokens computed takes this step. On a CPU a chunk's time grows
        with its context (each token attends to all before it): with K the context at which a token's attention costs
        as much as its matrix products, the threshold's tokens at context 0 cost what threshold x K / (K + start) do
        at `start`. Qwen2.5-Coder-0.5B (K 8,320), threshold 256: 256 tokens at the start, 75 at 20k, 51 at 32k. Never
        less than a block (a step's fixed cost, a tiny model's small K)."""
        threshold, k = self.long_prefill_token_threshold, self.attention_break_even_tokens
        return threshold if not k else max(min(threshold, self.kv.block_size), threshold * k // (k + start))

    def _is_long(self, request: Request, start: int) -> bool:
        """Whether a request with `start` tokens computed is a long prompt's prefill: more left than one chunk (vLLM's
        rule, more than the threshold, where chunks are not scaled)."""
        return self.long_prefill_token_threshold > 0 and request.num_tokens - start > self._long_chunk(start)

    def _fill(self, out: SchedulerOutput, long_turn: bool) -> bool:
        """Schedule one step into `out`: running requests first (decodes, prefills under way), then waiting ones (FCFS,
        passing those that must wait). Long prompts take at most one chunk (_long_chunk), at most
        max_long_partial_prefills of them at once; outside `long_turn` they yield. Returns whether one yielded.

        Why long prompts yield on a CPU: a step's time grows with its tokens, so a short request sharing steps with a
        long prompt's chunks waits a chunk's time for each of its tokens. Yielding, a short request waits at most for
        the step in progress, and gets `threshold` tokens (its prompt, then its decodes) before the long prompt's next
        chunk (tokens_since_long_chunk counts them); the long prompt loses the time the short one used, as it would
        sharing steps with it, and is never starved. A step where nothing else can run is the long prompts' turn."""
        budget = self.max_num_batched_tokens
        num_long = sum(self._is_long(r, r.num_computed_tokens) for r in self.running)
        num_yielded = 0  # running long prompts that yielded (their prompts are unfinished after this step)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not long_turn and self._is_long(request, request.num_computed_tokens):
                num_yielded += 1
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.enable_chunked_prefill and num_new < request.num_tokens - request.num_computed_tokens:
                break
            if self._is_long(request, request.num_computed_tokens):
                num_new = min(num_new, self._long_chunk(request.num_computed_tokens))
            num_new = self.kv.state_chunk(request, request.num_computed_tokens, num_new)
            drafts = self._drafts_that_fit(request, num_new, budget)
            while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts)):
                if drafts:  # no room to verify drafts: a plain decode, preempting nobody for a guess
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append(ScheduledRequest(request, num_new + len(drafts), request.num_computed_tokens, drafts))
            budget -= num_new + len(drafts)
            i += 1

        partial = sum(s.start + s.num_tokens < s.request.num_tokens for s in out.scheduled) + num_yielded
        yielded = num_yielded > 0
        i = 0  # the first waiting request not passed over (its grammar still compiling)
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[i]
            if self.pending_grammars and not self._grammar_ready(request, out):
                if not request.is_finished:  # still compiling: the requests behind it go first
                    i += 1
                continue
            load: PendingLoad | None = None
            if self.offload is not None:
                load = self.offload.loads.get(request.request_id)
                if load is not None:  # a restore from the offload tier in flight
                    if not load.done():
                        i += 1  # the requests behind it go first
                        continue
                    self.offload.finish_load(load)
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            if self.offload is not None and load is None:  # one restore per admission: a failed one is recomputed
                load = self.offload.start_restore(request, num_hit, budget)
                if load is not None:
                    if not load.done():  # loading from disk: it waits, the others step
                        i += 1
                        continue
                    self.offload.finish_load(load)
                    hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - num_hit
            if not self.enable_chunked_prefill and remaining > budget:
                if remaining > self.max_num_batched_tokens:  # no step can hold it: never block the queue behind it
                    i += 1  # (the engine refuses such prompts: its max-model-len is at most one step's budget)
                    continue
                break
            long = self._is_long(request, num_hit)
            if long and (not long_turn or num_long >= self.max_long_partial_prefills):
                yielded |= not long_turn
                i += 1  # the shorter requests behind it go first
                continue
            num_long += long
            num_new = self.kv.state_chunk(
                request, num_hit, min(remaining, budget, self._long_chunk(num_hit) if long else remaining)
            )
            unfinished = num_hit + num_new < request.num_tokens
            if unfinished and self.max_num_partial_prefills is not None and partial >= self.max_num_partial_prefills:
                break  # FCFS: the requests behind it wait too
            partial += unfinished
            first = request.status is RequestStatus.WAITING  # not a retry after preemption
            lost = self.kv.evicted_misses(request, num_hit) if first else 0
            rejected = load.rejected() if load is not None else frozenset()
            miss = self.kv.classify_miss(request, num_hit, rejected) if first else None
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                out.refused = self._refusal(request, num_new, hit_blocks, out)
                break
            request.num_computed_tokens = num_hit
            del self.waiting[i]
            if first:  # first admission: not a retry, not after preemption
                request.num_cached_tokens = num_hit
                request.prefix_miss = miss
                self.kv.miss_counts.record(miss)
                if miss is not None:
                    out.missed.append(request)
                self.kv.record_prefix_query(request, num_hit, lost)
                if self.offload is not None:  # vLLM's external prefix cache: what was looked up past the pool's hits
                    request.num_restored_tokens = self.offload.record_admission(request, num_hit, load)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, num_hit))
            budget -= num_new
        return yielded

    def _refusal(
        self, request: Request, num_new: int, hit_blocks: list[list[Any]], out: SchedulerOutput
    ) -> AdmissionRefused | None:
        """The AdmissionRefused a waiting request earns when the pool lacks blocks for it though the step had room
        (sequences and tokens) and nothing was preempted: what it needed and what was free."""
        if out.preempted or self.suspects or len(self.running) >= self.max_num_seqs:
            return None
        hit_len = len(hit_blocks[0]) if hit_blocks else 0
        entries = -(-(request.num_computed_tokens + hit_len * self.kv.block_size + num_new) // self.kv.block_size)
        needed = self.kv.num_groups * max(entries - hit_len, 0)
        return AdmissionRefused(request.request_id, needed, self.kv.pool.num_free_blocks)

    @staticmethod
    def _drafts_that_fit(request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafted tokens to verify this step: only for a decode (one token to compute), cut to the
        step's token budget."""
        if not request.spec_token_ids or num_new != 1 or request.num_computed_tokens + 1 != request.num_tokens:
            return []
        return request.spec_token_ids[: budget - 1]

    def _grammar_ready(self, request: Request, out: SchedulerOutput) -> bool:
        """Whether `request` may be admitted as far as its grammar goes: it has none or its compile is done. One
        whose compile failed is finished here (leaving the queue, so it never blocks it) and reported in `out`."""
        grammar = self.pending_grammars.get(request.request_id)
        if grammar is None:
            return True
        if not grammar.done():
            return False
        del self.pending_grammars[request.request_id]
        error = grammar.exception()
        if error is None:
            return True
        self.finish(request, RequestStatus.FINISHED_ERROR)
        out.grammar_failed.append((request, error))
        return False

    def pending_grammar_futures(self) -> list[Future[Any]]:
        """The compiles that waiting requests wait for (the engine waits on them when nothing else can run)."""
        return list(self.pending_grammars.values())

    def _next_suspect(self) -> Request | None:
        """The suspect to run now: the one already running (its prefill takes several steps), else the first
        waiting one."""
        for request in self.running:
            if request.request_id in self.suspects:
                return request
        return next((r for r in self.waiting if r.request_id in self.suspects), None)

    def _schedule_alone(self, request: Request) -> SchedulerOutput:
        """A step of `request` only, so that a failure can be pinned on it. Without prefix-cache hits (it
        recomputes everything it has, as after a preemption); newer running requests are preempted if the pool
        is short (one request always fits: the engine checked max-model-len against the pool at start)."""
        out = SchedulerOutput()
        num_new = min(request.num_tokens - request.num_computed_tokens, self.max_num_batched_tokens)
        num_new = self.kv.state_chunk(request, request.num_computed_tokens, num_new)
        while not self.kv.allocate_slots(request, num_new):
            victim = next((r for r in reversed(self.running) if r is not request), None)
            if victim is None:
                return out
            self.running.remove(victim)
            self._preempt(victim, out)
        if request.status is not RequestStatus.RUNNING:
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens))
        return out

    def quarantine(self, out: SchedulerOutput) -> list[Request]:
        """After the step of `out` failed: return the culprit (a suspect that failed alone) for the engine to
        fail, or else send every request of the step back to the front of the waiting queue, blocks freed and
        progress reset (the step may have written partial K/V), as suspects. Not counted as preemptions:
        the KV cache was not short."""
        if len(out.scheduled) == 1 and out.scheduled[0].request.request_id in self.suspects:
            return [out.scheduled[0].request]
        for s in reversed(out.scheduled):
            request = s.request
            if request in self.running:
                self.running.remove(request)
            self.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self.waiting.appendleft(request)
            self.suspects.add(request.request_id)
        return []

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        out.preempted.append(request)
        out.preempted_held[request.request_id] = (request.num_computed_tokens, self.kv.num_blocks_held(request))
        if self.offload is not None:
            self.offload.request_leaving(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self,
        out: SchedulerOutput,
        new_tokens: Mapping[str, Sequence[SampledToken]],
        sink: TokenSink | None = None,
        step_seconds: float = 0.0,
    ) -> int:
        """After the forward pass of `out` succeeded (vLLM's update_from_output): advance each scheduled request's
        progress; hand the offload tier the blocks the step filled; append each request's new tokens (one sampled
        token, or a verified draft's accepted tokens and the target's own) in order, each admitted and recorded by
        `sink`, ending the request at the first stop (EOS, a stop token, max_tokens, the context, a complete or
        refusing grammar); count an accepted draft's tokens as computed and give back the rejected ones' blocks.
        Returns the step's prompt tokens."""
        sink = sink or PlainSink()
        prompt_tokens = 0
        for s in out.scheduled:  # drafted tokens count once verified (below)
            request = s.request
            prompt_tokens += max(0, min(s.start + s.num_tokens, request.num_prompt_tokens) - s.start)
            request.num_computed_tokens = s.start + s.num_tokens - len(s.draft_token_ids)
            if s.completes_sequence:  # a suspect cleared: it got through a whole step of its own
                self.suspects.discard(request.request_id)
        if self.offload is not None:  # write-through: the blocks this step filled, before any is reused
            self.offload.on_step_done(out.scheduled, prompt_tokens, step_seconds)
        now = time.monotonic()
        for s in out.scheduled:
            tokens = new_tokens.get(s.request.request_id)
            if not tokens or s.request.is_finished:  # nothing sampled, or its request failed earlier in this step
                continue
            if self._append(s.request, tokens, sink, now) and s.draft_token_ids:
                s.request.num_computed_tokens += len(tokens) - 1  # the accepted drafts; the last is computed next
                self.kv.rollback(s.request)
        return prompt_tokens

    def _append(self, request: Request, tokens: Sequence[SampledToken], sink: TokenSink, now: float) -> bool:
        """Append tokens in order, stopping at the first that ends the request (finished here). Returns whether the
        request runs on."""
        try:
            for token in tokens:
                if not sink.admit(request, token):  # refused by its grammar: not recorded, the request ends cleanly
                    request.stop_reason = GRAMMAR_DEAD_END
                    self.finish(request, RequestStatus.FINISHED_STOPPED)
                    return False
                request.output_token_ids.append(token.token_id)
                if request.first_token_time is None:
                    request.first_token_time = now
                grammar_done = sink.record(request, token)
                stop = check_stop(request, token.token_id, self.eos_token_ids, self.max_model_len, grammar_done)
                if stop is not None:
                    request.stop_reason = stop[1]
                    request.ends_on_stop_token = stop[0] is RequestStatus.FINISHED_STOPPED
                    self.finish(request, stop[0])
                    return False
        except Exception as exc:  # noqa: BLE001 -- e.g. a grammar matcher past its limits: this request fails alone
            sink.failed(request, exc)
            return False
        return True

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from whichever queue holds it and return its blocks at once."""
        request.status = status
        request.finished_time = time.monotonic()
        self.suspects.discard(request.request_id)
        self.pending_grammars.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.offload is not None:
            self.offload.cancel(request.request_id)
        if status is not RequestStatus.FINISHED_ERROR:
            params = request.sampling_params
            request.pin_outcomes = self.kv.pin_prefix(request, params.kv_pins)
            if self.offload is not None:
                if params.prompt_cache_retention_s > 0:
                    self.offload.retain(request, params.prompt_cache_retention_s)
                self.offload.request_leaving(request)
        self.kv.forget(request)
