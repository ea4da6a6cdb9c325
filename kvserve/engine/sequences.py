"""The engine core's table of requests: each user request is a group of n sequences (one Request each).

Why a table of its own: n > 1 fans one request out into n scheduler requests that share a prompt (and its blocks,
through the prefix cache), fail together and finish together, and every step must map a scheduler request back to
its group. Keeping that mapping, the internal ids and the per-sequence output marks here leaves the core's step loop
(engine/core.py) to schedule, run and post-process only."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.core_outputs import EngineCoreOutput, PositionLogprobs, SequenceDelta
from kvserve.engine.request import Request
from kvserve.engine.stats import RequestMetrics

if TYPE_CHECKING:
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.backend import CompiledGrammar
    from kvserve.structured.matcher import GrammarMatcher


@dataclass(slots=True)
class SequenceState:
    """Engine-side state of one of a request's n sequences."""

    request: Request
    group_id: str
    index: int
    logprobs: list[PositionLogprobs] | None = None  # the positions not handed out yet (logprobs asked: a list)
    num_emitted: int = 0  # output tokens already handed out
    finish_emitted: bool = False
    # Its own grammar state (n > 1: one each), made when it first samples; it follows output_token_ids, which
    # preemption keeps (recompute), so it is never rolled back here.
    matcher: GrammarMatcher | None = None

    @property
    def has_news(self) -> bool:
        """Tokens not handed out yet, or a finish not reported yet."""
        request = self.request
        return len(request.output_token_ids) > self.num_emitted or (request.is_finished and not self.finish_emitted)

    def take_delta(self) -> SequenceDelta:
        """What this sequence gained since its previous output; marks it handed out."""
        request = self.request
        tokens = request.output_token_ids[self.num_emitted :]
        logprobs = self.logprobs
        if logprobs is not None:
            self.logprobs = []
        finish = request.status.value if request.is_finished else None
        self.num_emitted, self.finish_emitted = len(request.output_token_ids), request.is_finished
        ends_on_stop = request.ends_on_stop_token and bool(tokens)
        return SequenceDelta(self.index, tokens, logprobs, finish, request.stop_reason, ends_on_stop)


@dataclass(slots=True)
class SequenceGroup:
    """One user request: a prompt, its parameters and its n sequences."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False  # the prompt's logprobs go out once, in the first output
    error: str | None = None  # set when one of its sequences failed (finish_reason "error")
    grammar: Future[CompiledGrammar] | None = None  # its constraint compiling (or compiled), shared by its sequences

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)

    def take_output(self) -> EngineCoreOutput:
        """The group's news since its previous output: the sequences that advanced or finished (every one not yet
        reported, once the group is finished), the prompt's logprobs once."""
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt_logprobs, self.sent_prompt_logprobs = self.prompt_logprobs, True
        first = self.sequences[0].request
        return EngineCoreOutput(
            request_id=self.request_id,
            sequences=[s.take_delta() for s in self.sequences if s.has_news],
            finished=self.finished,
            num_cached_tokens=min(s.request.num_cached_tokens for s in self.sequences),
            metrics=RequestMetrics(
                first.arrival_time,
                first.first_scheduled_time,
                first.first_token_time,
                first.finished_time,
                first.num_preemptions,
            ),
            prompt_logprobs=prompt_logprobs,
            error=self.error,
            num_restored_tokens=min(s.request.num_restored_tokens for s in self.sequences),
            prefix_miss=first.prefix_miss,
            pin_outcomes=first.pin_outcomes,
        )


class SequenceTable:
    """The live groups by user request id and their sequences by internal id (the scheduler's and the KV manager's
    key). Sequences with a grammar are counted apart, so that the sampler masks nothing when none has one."""

    def __init__(self) -> None:
        self.groups: dict[str, SequenceGroup] = {}
        self.sequences: dict[str, SequenceState] = {}
        self.constrained: set[str] = set()  # internal ids of live sequences with a grammar
        self._num_added = 0  # numbers the internal ids, so that they never collide

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter(self.groups.values())

    def build(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        grammar: Future[CompiledGrammar] | None,
    ) -> SequenceGroup:
        """A new group of params.n sequences (each with its own sampling parameters: a seed per sample), not yet
        registered: `register` makes it live, so that a failure in between leaves no trace."""
        group = SequenceGroup(request_id, prompt_token_ids, params, grammar=grammar)
        for index in range(params.n):
            child = params if params.n == 1 else params.child(index)
            request = Request(self._new_id(request_id, index), prompt_token_ids, child, cache_salt=cache_salt)
            seq = SequenceState(request, request_id, index)
            if child.logprobs is not None:
                seq.logprobs = []
            group.sequences.append(seq)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        ids = [seq.request.request_id for seq in group.sequences]
        if len(set(ids)) != len(ids) or any(i in self.sequences for i in ids):
            raise RuntimeError(f"internal sequence ids {ids} of request {request_id!r} are not unique")
        return group

    def register(self, group: SequenceGroup) -> None:
        self.groups[group.request_id] = group
        for seq in group.sequences:
            self.sequences[seq.request.request_id] = seq
            if group.grammar is not None:
                self.constrained.add(seq.request.request_id)

    def _new_id(self, request_id: str, index: int) -> str:
        """The engine-internal id of sample `index` of `request_id`. Why not the user's id (or "id#index"): user
        ids are arbitrary strings, so request "x" with n=2 and a request named "x#0" collided. A serial number
        leads, ended by the first ":", so two sequences never share an id whatever the user ids hold; the user's id
        follows only for the logs."""
        self._num_added += 1
        return f"{self._num_added}:{request_id}#{index}"

    def group_of(self, seq: SequenceState) -> SequenceGroup:
        return self.groups[seq.group_id]

    def user_request_id(self, sequence_id: str) -> str:
        seq = self.sequences.get(sequence_id)
        return seq.group_id if seq is not None else sequence_id

    def drop(self, group: SequenceGroup) -> list[Request]:
        """Forget a finished (or aborted) group; returns the requests that were still known, once each."""
        self.groups.pop(group.request_id, None)
        forgotten = []
        for seq in group.sequences:
            rid = seq.request.request_id
            self.constrained.discard(rid)
            if self.sequences.pop(rid, None) is not None:
                forgotten.append(seq.request)
        return forgotten
