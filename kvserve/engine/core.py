"""EngineCore: token ids in, token ids out, one scheduler step at a time (vLLM v1's EngineCore).

A step is schedule -> run -> post-process, as nano-vllm's engine: the scheduler picks the flat batch, the runner
runs one forward pass, and each sampled (or verified) token is appended with its stop checks. The core owns the
KV cache, the scheduler, the model runner, the sampler and the per-sequence grammar matchers; it runs no tokenizer:
prompts arrive as token ids and outputs leave as token ids (engine/core_outputs.py), and the front end
(engine/output_processor.py: LLMEngine, AsyncLLMEngine's streams) detokenizes, applies stop strings and writes
logprob text, handing a stop string's hit back as `abort_request(request_id, index)`. Single-threaded: whoever
drives it (LLMEngine, or the async engine's thread) calls it from one thread.
"""

from __future__ import annotations

import bisect
import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING, Any

import torch

from kvserve.engine.core_outputs import EngineCoreOutput
from kvserve.engine.facts import validate_request
from kvserve.engine.inspector import EngineEventRecorder, build_snapshot
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampledToken, prompt_logprobs
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequences import SequenceGroup, SequenceState, SequenceTable
from kvserve.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats
from kvserve.kv.hashing import check_cache_salt_length
from kvserve.kv.manager import KVCacheManager
from kvserve.outputs import Logprob, logprob_entry
from kvserve.spec_decode.verify import verify_draft

if TYPE_CHECKING:
    from kvserve.engine.core_builder import CoreParts
    from kvserve.kv.offload.connector import OffloadConnector
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.compiler import GrammarCompiler
    from kvserve.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a grammar still compiling (instead of returning at once and being
# called again in a busy loop that would take the GIL from the compile thread).
_GRAMMAR_WAIT_S = 0.02
# How long after a KV snapshot was asked for the engine keeps making KV events (for the next snapshot's list).
_EVENT_LEASE_S = 300.0


def check_cache_salt(cache_salt: str | None) -> None:
    """The salt joins the prefix-cache hashes as UTF-8 bytes, so a string that has none (a lone surrogate, from
    a JSON "\\ud800") is bad input here, not a UnicodeEncodeError on the engine thread at the first lookup."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    check_cache_salt_length(cache_salt)
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"cache_salt must be valid UTF-8 text: it holds an unpaired surrogate at position {e.start}"
        ) from None


class EngineCore:
    """Owns the KV cache, the scheduler, the runner and the requests' engine-side state. Built by
    engine/build.py (which loads the model and sizes the cache); `config` is the resolved, frozen config."""

    def __init__(self, parts: CoreParts, grammar: GrammarCompiler) -> None:
        """Take the parts engine/core_builder.py built (build_engine_core)."""
        self.config, self.model_config, self.device = parts.config, parts.model_config, parts.device
        self.kv_config, self.cache_plan = parts.kv_config, parts.cache_plan
        self.max_model_len = parts.cache_plan.max_model_len
        self.layout = parts.kv_config.groups  # the KV cache groups (kv/groups.py)
        self.kv_events = parts.kv_events
        self.pool = parts.pool
        self.kv_event_publisher = parts.kv_event_publisher
        self.kv_manager = parts.kv_manager
        self.runner = parts.runner
        self.offload, self.state_offload = parts.offload, parts.state_offload  # the tier, and a hybrid model's
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.spec = parts.spec
        self.facts = parts.facts
        self.eos_token_ids = parts.facts.eos_token_ids
        self.grammar = grammar  # shared with the front end, which compiles a request's grammar before sending it
        self.requests = SequenceTable()
        self.event_recorder = EngineEventRecorder(self.kv_events, self.requests.user_request_id)
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.step_sizes = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # steps by their tokens (the stats' histogram)
        self.step_tokens_total = 0
        logger.info(parts.cache_plan.describe())

    def close(self) -> None:
        """Release what outlives a step: the KV event publisher's thread and sockets (flushing what is queued), the
        offload tier's writer (what is queued is written first), and the grammar compiler's threads and worker
        processes (a compile in flight is stopped, not waited for: at exit a thread in a long compile held the
        process for tens of seconds; a sibling sharing it starts them again)."""
        if self.offload is not None:
            self.offload.close()
        if self.state_offload is not None:
            self.state_offload.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        self.grammar.close()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Validate and queue a request of token ids; raises ValueError with a clear message for bad input."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_cache_salt(cache_salt)
        validate_request(self.facts, prompt_token_ids, params)
        max_new = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is None or params.max_tokens > max_new:
            params = params.clone(max_tokens=max_new)
        group = self.requests.build(request_id, list(prompt_token_ids), params, cache_salt, None)
        if params.structured_outputs is not None:  # compiled off this thread; the scheduler admits it when done
            group.grammar = self.grammar.compile_async(params.structured_outputs)
        self.requests.register(group)
        for seq in group.sequences:
            self.scheduler.add(seq.request, group.grammar)

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
        """Abort a request and free its blocks at once; returns its final output. An unknown or finished id does
        nothing."""
        group = self.requests.groups.get(request_id)
        if group is None:
            return None
        held = sum(self.kv_manager.num_blocks_held(s.request) for s in group.sequences)
        self.event_recorder.record_abort(request_id, held)
        self._finish_group(group, RequestStatus.FINISHED_ABORTED)
        self._drop(group)
        return group.take_output()

    def stop_sequence(self, request_id: str, index: int) -> None:
        """End sample `index` of a request as stopped: the front end found a stop string in its text (vLLM's
        OutputProcessor hands those back as aborts). Its blocks are freed at once; its siblings run on. The front end
        has the sequence's final output already, so none is returned (a last one, if this ends the request, is
        dropped)."""
        group = self.requests.groups.get(request_id)
        if group is None:
            return
        for seq in group.sequences:
            if seq.index == index and not seq.request.is_finished:
                self.scheduler.finish(seq.request, RequestStatus.FINISHED_STOPPED)
        if group.finished:
            self._drop(group)

    def has_unfinished_requests(self) -> bool:
        """Requests to step for, or the restore of a request that left while its copy ran: the step that follows the
        copy gives its blocks back (OffloadConnector.reap_orphan_loads), so the loops that step while this is true
        (the server's, `LLM.generate`'s) do not go idle holding them."""
        connector = self.scheduler.offload
        return bool(self.requests) or (connector is not None and bool(connector.orphan_loads))

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        connector = self.scheduler.offload
        spec: dict[str, Any] = {}
        if self.spec is not None:
            totals = self.spec.stats
            spec = {
                "spec_decode_num_drafts": totals.num_drafts,
                "spec_decode_num_draft_tokens": totals.num_draft_tokens,
                "spec_decode_num_accepted_tokens": totals.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": tuple(totals.num_accepted_tokens_per_pos),
            }
        pins = self.kv_manager.pins
        slots, snapshots = self.kv_manager.state_slots, self.kv_manager.state_snapshots  # hybrid models only
        return EngineStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            block_size=self.config.block_size,
            kv_cache_usage=self.pool.usage,
            prefix_cache_queries_tokens=self.kv_manager.prefix_stats.queries_total,
            prefix_cache_hits_tokens=self.kv_manager.prefix_stats.hits_total,
            prefix_cache_hit_rate=self.kv_manager.prefix_stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.num_prompt_tokens_total,
            generation_tokens_total=self.num_generation_tokens_total,
            iteration_tokens_counts=tuple(self.step_sizes),
            iteration_tokens_sum=self.step_tokens_total,
            offload=None if self.offload is None else self.offload.stats(),
            external_prefix_cache_queries_tokens=0 if connector is None else connector.external_queries_tokens,
            external_prefix_cache_hits_tokens=0 if connector is None else connector.external_hits_tokens,
            prefix_cache_evicted_misses_tokens=self.kv_manager.prefix_stats.evicted_misses_total,
            kv_pinned_prefixes=len(pins.pins),
            kv_pinned_blocks=pins.num_pinned_blocks,
            state_slots_used=0 if slots is None else len(slots.held),
            state_snapshots=0 if snapshots is None else len(snapshots),
            state_snapshots_saved=0 if snapshots is None else snapshots.num_saved,
            state_snapshots_restored=0 if snapshots is None else snapshots.num_restored,
            state_snapshots_evicted=0 if snapshots is None else snapshots.num_evictions,
            kv_pins_created=pins.stats.created,
            kv_pins_expired=pins.stats.expired,
            kv_pins_displaced=pins.stats.displaced,
            kv_pins_refused=pins.stats.refused,
            kv_pins_tenant_capped=pins.stats.tenant_capped,
            kv_retention_capped=0 if connector is None else connector.retention_capped,
            prefix_cache_miss_reasons=self.kv_manager.miss_counts.snapshot(),
            **spec,
        )

    # ---- the step: schedule, run, post-process ---------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run one forward pass, sample, and return the requests that advanced or finished. A fault in
        the forward pass, the sampler or one request's post-processing fails one request, never the step's
        caller (see _on_step_failed); only a fault outside any request (the scheduler's) raises."""
        if self.spec is not None:
            running = self.scheduler.running
            grammars = {rid: self.requests.sequences[rid].matcher for rid in self.requests.constrained}
            self.spec.propose(running, grammars, self.max_model_len, len(running))
        out = self._schedule()
        failed = self._grammar_failures(out)
        if self.offload is not None:
            tier_events = self.offload.take_events()
            if self.state_offload is not None:
                tier_events += self.state_offload.take_events()
            if self.kv_events.enabled:
                for event in tier_events:
                    self.kv_events.append(event)
        if out.is_empty:
            return failed
        started = time.perf_counter()
        try:
            result = self.runner.execute(out)
            sampled = self._sample(result.logits, result.sample_requests) if result.sample_requests else []
            verified = {
                s.request.request_id: verify_draft(
                    self.sampler,
                    s.request,
                    s.draft_token_ids,
                    result.spec_logits[s.request.request_id],
                    self.requests.sequences[s.request.request_id].matcher,
                )
                for s in out.scheduled
                if s.request.request_id in result.spec_logits
            }
        except Exception as exc:  # noqa: BLE001 -- pinned on one request, not the engine (see _on_step_failed)
            return failed + self._on_step_failed(out, exc)
        except BaseException:
            self._drop_failed_step()
            raise
        touched: dict[str, SequenceGroup] = {}
        for rid, (first, logits) in result.prompt_logits.items():
            seq = self.requests.sequences[rid]
            try:
                self._add_prompt_logprobs(self.requests.group_of(seq), first, logits)
            except Exception as exc:  # noqa: BLE001 -- this request's own fault: it fails alone
                touched[seq.group_id] = self._fail(seq, exc)
        new_tokens: dict[str, list[SampledToken]] = dict(verified)
        new_tokens.update((r.request_id, [t]) for r, t in zip(result.sample_requests, sampled))
        for s in out.scheduled:
            rid = s.request.request_id
            if rid in new_tokens:
                seq = self.requests.sequences[rid]
                touched[seq.group_id] = self.requests.group_of(seq)
                if rid in verified and self.spec is not None and not s.request.is_finished:
                    self.spec.record(s.request, len(s.draft_token_ids), len(verified[rid]) - 1)
        sink = _EngineTokenSink(self, touched)
        prompt_tokens = self.scheduler.update_from_output(out, new_tokens, sink, time.perf_counter() - started)
        self.step_sizes[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, out.num_tokens)] += 1
        self.step_tokens_total += out.num_tokens
        self.num_prompt_tokens_total += prompt_tokens
        outputs = [group.take_output() for group in touched.values()]
        for group in touched.values():
            if group.finished:
                self._drop(group)
        return failed + outputs

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step; when nothing can run only because grammars are still compiling, wait a moment
        for one (the caller would otherwise call again at once, in a busy loop)."""
        out = self.scheduler.schedule()
        connector = self.scheduler.offload
        loads = connector is not None and bool(connector.loads)
        if out.is_empty and not out.grammar_failed and (self.scheduler.pending_grammars or loads):
            futures = [*self.scheduler.pending_grammar_futures(), *(connector.load_futures() if connector else [])]
            wait(futures, timeout=_GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
            out = self.scheduler.schedule()
        self.event_recorder.after_schedule(out, self.scheduler)
        return out

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """The sampler, given the rows' grammar matchers only when some live sequence has a grammar."""
        if not self.requests.constrained:
            return self.sampler(logits, requests)
        return self.sampler(logits, requests, [self._matcher(self.requests.sequences[r.request_id]) for r in requests])

    def _add_prompt_logprobs(self, group: SequenceGroup, first: int, logits: torch.Tensor) -> None:
        assert group.prompt_logprobs is not None
        ids = group.prompt_token_ids
        judged = ids[first + 1 : first + 1 + logits.shape[0]]
        entries = prompt_logprobs(logits, judged, group.params.prompt_logprobs or 0)
        for offset, entry in enumerate(entries):
            if first + 1 + offset == len(group.prompt_logprobs):  # a recompute after preemption adds nothing twice
                group.prompt_logprobs.append({tid: Logprob(lp.logprob, lp.rank) for tid, lp in entry.items()})

    # ---- grammars -------------------------------------------------------------------------------

    def _matcher(self, seq: SequenceState) -> GrammarMatcher | None:
        """The sequence's grammar matcher (None: unconstrained), made when it first samples: its grammar is compiled
        by then (the scheduler admitted it). One whose matcher cannot be made fails alone (its row is then sampled
        unconstrained and dropped)."""
        rid = seq.request.request_id
        if seq.matcher is None and rid in self.requests.constrained and not seq.request.is_finished:
            grammar = self.requests.group_of(seq).grammar
            try:
                if grammar is None or not grammar.done():
                    raise RuntimeError("a constrained sequence was scheduled before its grammar compiled")
                matcher = self.grammar.matcher(grammar.result())
                for tid in seq.request.output_token_ids:  # the state of its output so far (after a preemption)
                    if not _advance_grammar(matcher, tid):
                        raise RuntimeError(f"the grammar refused token {tid} of the sequence's own output")
                seq.matcher = matcher
            except Exception as exc:  # noqa: BLE001 -- this request's own fault: it fails alone
                self._fail(seq, exc)
        return seq.matcher

    def _grammar_failures(self, out: SchedulerOutput) -> list[EngineCoreOutput]:
        """Outputs of the requests whose grammar failed to compile (the scheduler has finished them)."""
        outputs = []
        for request, error in out.grammar_failed:
            seq = self.requests.sequences.get(request.request_id)
            if seq is None:  # a sibling of a sequence reported before it in this list
                continue
            group = self.requests.group_of(seq)
            group.error = f"the request's grammar failed to compile: {error}"
            logger.info("request %r: %s", group.request_id, group.error)
            self._finish_group(group, RequestStatus.FINISHED_ABORTED)
            outputs.append(group.take_output())
            self._drop(group)
        return outputs

    # ---- faults and endings ---------------------------------------------------------------------

    def _on_step_failed(self, out: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """One request's fault must not end everyone's requests, nor the engine. The step's requests go back to
        waiting (recomputed, as after a preemption: the step may have written partial K/V) as suspects that
        the scheduler runs alone; a suspect that fails alone is the culprit and fails by itself, with an
        error output. Requests the failed step did not touch keep their progress."""
        self._drop_failed_step()
        culprits = self.scheduler.quarantine(out)
        if not culprits:
            logger.warning(
                "a step of %d requests failed (%s: %s); running each alone to find the culprit",
                len(out.scheduled),
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            return []
        outputs = []
        for request in culprits:
            group = self._fail(self.requests.sequences[request.request_id], exc)
            outputs.append(group.take_output())
            self._drop(group)
        return outputs

    def _drop_failed_step(self) -> None:
        """What a failed step computed may be partial: the offload tier stores none of it, and the prefix cache (whose
        blocks the step's requests published before it ran) is dropped."""
        if self.scheduler.offload is not None:
            self.scheduler.offload.on_step_failed()
        self.kv_manager.reset_prefix_cache()

    def _fail(self, culprit: SequenceState, exc: Exception) -> SequenceGroup:
        """Finish `culprit` with an error and its unfinished siblings as aborted (the request cannot complete
        without it), freeing their blocks at once. Returns the group, now finished, for its output."""
        group = self.requests.group_of(culprit)
        logger.error(
            "request %r failed and is ended alone: %s: %s",
            group.request_id,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        group.error = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        self.scheduler.finish(culprit.request, RequestStatus.FINISHED_ERROR)
        self._finish_group(group, RequestStatus.FINISHED_ABORTED)
        return group

    def _finish_group(self, group: SequenceGroup, status: RequestStatus) -> None:
        for seq in group.sequences:
            if not seq.request.is_finished:
                self.scheduler.finish(seq.request, status)

    def _drop(self, group: SequenceGroup) -> None:
        """Let go of a finished group's sequences, once (and the drafter of their per-request state)."""
        for request in self.requests.drop(group):
            if self.spec is not None:
                self.spec.on_finished(request)

    # ---- diagnosis ------------------------------------------------------------------------------

    def kv_snapshot(self, include_tokens: bool = True, tenant: bool | None = None) -> dict[str, Any]:
        """The KV inspector's view of the pool, requests and prefix cache: fresh plain values sharing nothing with
        the engine (call it on the engine thread; see engine/inspector.py for the schema, and `tenant`). Whoever asks
        gets the KV events of the next minutes too (KVEventBuffer.lease): none are made while nobody reads them."""
        self.kv_events.lease(_EVENT_LEASE_S)
        return build_snapshot(self, include_tokens, tenant)

    def check_invariants(self) -> None:
        """The pool is whole: every block free or referenced, and references match requests' holdings.

        A public debug API, kept in the package on purpose (the tests call it after every step, and a user chasing
        a leak can too): raises AssertionError naming the first broken block. O(blocks); call it between steps on
        the thread that steps the engine (behind a server: `async_engine.call(EngineCore.check_invariants)`)."""
        check_kv_invariants(self.kv_manager, self.scheduler.offload)


class _EngineTokenSink:
    """The engine's side of appending a step's tokens (Scheduler.update_from_output): each sequence's grammar, its
    logprobs and the engine's token count; a request that faults fails alone (its group joins the step's outputs)."""

    def __init__(self, core: EngineCore, touched: dict[str, SequenceGroup]) -> None:
        self.core = core
        self.touched = touched

    def admit(self, request: Request, token: SampledToken) -> bool:
        """A grammar refusing a token its mask allowed has no way on from here (a dead end): the sequence ends with
        what it has, which the grammar allowed, never with a token it refuses."""
        seq = self.core.requests.sequences[request.request_id]
        if seq.matcher is not None and not _advance_grammar(seq.matcher, token.token_id):
            logger.info(
                "request %r: its grammar refused token %d, which its mask allowed: ended", seq.group_id, token.token_id
            )
            return False
        return True

    def record(self, request: Request, token: SampledToken) -> bool:
        seq = self.core.requests.sequences[request.request_id]
        self.core.num_generation_tokens_total += 1
        if (  # all three are set together, when logprobs were asked
            seq.logprobs is not None
            and token.logprob is not None
            and token.rank is not None
            and token.top_logprobs is not None
        ):
            seq.logprobs.append(logprob_entry(token.token_id, token.logprob, token.rank, token.top_logprobs))
        return seq.matcher is not None and seq.matcher.is_terminated()

    def failed(self, request: Request, exc: Exception) -> None:
        seq = self.core.requests.sequences[request.request_id]
        self.touched[seq.group_id] = self.core._fail(seq, exc)


def check_kv_invariants(kv: KVCacheManager, offload: OffloadConnector | None = None) -> None:
    """The pool is whole (BlockPool.check_invariants), every block's references are its holders (requests' tables in
    every group, restores in flight, pins), each held block sits in the table of the group that allocated it, and free +
    referenced == usable (raises AssertionError naming the first broken block)."""
    kv.pool.check_invariants()
    counts: dict[int, int] = {}
    for rid, group, block in kv.held_blocks():
        counts[block.block_id] = counts.get(block.block_id, 0) + 1
        if block.group_id != group:
            raise AssertionError(f"{block} sits in request {rid}'s table of group {group}")
    for block in offload.held_blocks() if offload is not None else []:
        counts[block.block_id] = counts.get(block.block_id, 0) + 1
    for block in kv.pins.held_blocks():
        counts[block.block_id] = counts.get(block.block_id, 0) + 1
    for block in kv.pool.blocks:
        if block.ref_cnt != counts.get(block.block_id, 0):
            raise AssertionError(f"{block} has ref_cnt {block.ref_cnt} but {counts.get(block.block_id, 0)} holders")
    referenced = sum(1 for b in kv.pool.blocks if b.ref_cnt > 0)
    if kv.pool.num_free_blocks + referenced != kv.pool.num_usable_blocks:
        raise AssertionError(f"{kv.pool.num_free_blocks} free + {referenced} referenced != {kv.pool.num_usable_blocks}")
    slots = kv.state_slots
    if slots is not None:  # a state slot is held exactly by the requests that hold blocks (kv/state.py)
        if set(slots.held) != set(kv.requests):
            raise AssertionError(f"state slots held by {sorted(slots.held)}, blocks by {sorted(kv.requests)}")
        if slots.num_free + len(slots.held) != slots.num_slots or len(set(slots.held.values())) != len(slots.held):
            raise AssertionError(f"state slots: {slots.num_free} free + {len(slots.held)} held != {slots.num_slots}")
    kv.check_state()


def _advance_grammar(matcher: GrammarMatcher, token_id: int) -> bool:
    """Feed one sampled token to the sequence's grammar; False when it refuses the token. A matcher that hit its
    own limit (llguidance's parser fuel) is a fault of this request: raised, it fails the request alone."""
    if not matcher.accept_token(token_id):
        return False
    error = matcher.error()
    if error is not None:
        raise RuntimeError(f"the grammar matcher failed: {error}")
    return True
