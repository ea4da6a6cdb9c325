"""Scheduler: decides, each step, how many tokens of which requests go into the next forward pass."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.request import Request, RequestStatus
from kvserve.kv.block import KVCacheBlock
from kvserve.kv.manager import KVCacheManager


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
    # Waiting requests whose grammar failed to compile: finished (error) by the scheduler, reported by the engine.
    grammar_failed: list[tuple[Request, BaseException]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
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
        self.kv.reap_orphan_loads()
        if self.suspects:
            suspect = self._next_suspect()
            if suspect is not None:
                return self._schedule_alone(suspect)
            self.suspects.clear()  # stale ids only (cannot happen: finish() discards them); never get stuck
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.enable_chunked_prefill and num_new < request.num_tokens - request.num_computed_tokens:
                break
            drafts = self._drafts_that_fit(request, num_new, budget)
            while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts)):
                if drafts:  # no room to verify drafts: a plain decode, preempting nobody for a guess
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append(ScheduledRequest(request, num_new + len(drafts), request.num_computed_tokens, drafts))
            budget -= num_new + len(drafts)
            i += 1

        i = 0  # the first waiting request not passed over (its grammar still compiling)
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[i]
            if self.pending_grammars and not self._grammar_ready(request, out):
                if not request.is_finished:  # still compiling: the requests behind it go first
                    i += 1
                continue
            restored, loaded = 0, False
            if self.kv.loads and request.request_id in self.kv.loads:  # a restore from the offload tier in flight
                load = self.kv.loads[request.request_id]
                if not load.future.done():
                    i += 1  # the requests behind it go first
                    continue
                restored, loaded = self.kv.finish_load(load), True
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            if self.kv.tier is not None and not loaded:  # one restore per admission: a failed one is recomputed
                outcome = self._restore(request, hit_blocks, budget)
                if outcome is None:  # loading from disk: it waits, the others step
                    i += 1
                    continue
                if outcome:
                    restored = outcome
                    hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - num_hit
            if not self.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            first = request.status is RequestStatus.WAITING  # not a retry after preemption
            lost = self.kv.evicted_misses(request, num_hit) if first else 0
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                break
            request.num_computed_tokens = num_hit
            del self.waiting[i]
            if first:  # first admission: not a retry, not after preemption
                request.num_cached_tokens = num_hit
                request.num_restored_tokens = min(restored * self.kv.block_size, num_hit)
                self.kv.record_prefix_query(request, num_hit, lost)
                if self.kv.tier is not None:  # vLLM's external prefix cache: what was looked up past the pool's hits
                    self.kv.external_queries_tokens += request.num_tokens - (num_hit - request.num_restored_tokens)
                    self.kv.external_hits_tokens += request.num_restored_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, num_hit))
            budget -= num_new
        return out

    def _restore(self, request: Request, hit_blocks: list[KVCacheBlock], budget: int) -> int | None:
        """Start restoring the blocks after the pool's hits that the offload tier holds, where that is cheaper than
        recomputing them and the pool can take both them and the request's first chunk after them (else the restored
        blocks could be evicted again before the request is admitted). Returns the blocks restored (0: none tried or
        none restored), or None while a load from disk is running."""
        assert self.kv.tier is not None
        hits = self.kv.tier_hits(request, len(hit_blocks))
        if not hits or not self.kv.tier.cost.worth_restoring(len(hits)):
            return 0
        after = request.num_tokens - (len(hit_blocks) + len(hits)) * self.kv.block_size
        if not self.kv.can_fit(request, len(hits) * self.kv.block_size + min(after, budget), hit_blocks):
            return 0
        load = self.kv.start_load(request, hit_blocks, hits)
        if load is None:
            return 0
        if not load.future.done():
            return None
        return self.kv.finish_load(load)

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
        while not self.kv.allocate_slots(request, num_new):
            victim = next((r for r in reversed(self.running) if r is not request), None)
            if victim is None:
                return out
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
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

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance progress after the forward pass."""
        for s in out.scheduled:  # drafted tokens count once verified (the engine adds the accepted ones)
            s.request.num_computed_tokens = s.start + s.num_tokens - len(s.draft_token_ids)
            if s.completes_sequence:  # a suspect cleared: it got through a whole step of its own
                self.suspects.discard(s.request.request_id)

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
        self.kv.forget(request)
