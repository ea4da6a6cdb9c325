"""AsyncLLMEngine: an LLMEngine's core driven by one background thread, its text work beside asyncio callers.

Why a thread and not the event loop: a step is a blocking forward pass (tens of ms to seconds), which
would freeze every HTTP connection if it ran on the loop. So the engine thread owns the engine core outright:
callers never touch it, they post commands (add, abort, stop, call) to an inbox that the thread drains between
steps, and they receive its token-id outputs on a per-request asyncio queue fed through `loop.call_soon_threadsafe`.
The engine thread runs no tokenizer: a string prompt is encoded by the caller, and each request's stream turns the
core's outputs into text on the consumer's loop (engine/output_processor.py), handing a stop string's hit back to
the core as a `stop_sequence` command. That tokenizer (the LLMEngine's) is the front end's, used on that loop only.
The thread sleeps on a condition variable when there is nothing to do (no busy-wait). A fault in one request
(its forward pass, sampling, grammar) fails that request alone: `EngineCore.step` isolates it and returns
an error output, which ends that request's stream with `EngineFaultError` while the others go on. Only a fault
outside any request (`step` itself raising, e.g. in the scheduler) kills the loop: then every in-flight
request fails with `EngineFaultError`, the engine is marked dead, and new requests are refused with
`EngineDeadError`, so nothing ever hangs on a dead engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.engine.core_outputs import EngineCoreOutput
from kvserve.engine.kv_publisher import KVPublisher
from kvserve.engine.output_processor import RequestState
from kvserve.outputs import RequestOutput

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.facts import EngineFacts
    from kvserve.engine.stats import EngineStats
    from kvserve.kv.events import KVEvent
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


def build_for_engine_thread(config: EngineConfig) -> LLMEngine:
    """LLMEngine.from_config on a thread that ends with the build, for an engine an AsyncLLMEngine will step on its
    own thread. Why: the build's OpenMP parallel regions (weight packing, the first forward passes) give the thread
    that runs them a libgomp thread pool, which lives as long as that thread; the engine thread then starts a second
    one, and once a process has more OpenMP threads than CPUs libgomp stops spin-waiting between parallel regions
    (its throttled spin count), so every region of every step pays for sleeping threads to be woken: on 2 cores
    `kvserve bench hybrid-chat --shape lfm2-350m --max-num-partial-prefills 1 --activation-quantization int8` gave
    rounds 2-4 TTFT p50 of 672 / 692 / 660 ms with the main thread's pool left alive, 511 / 594 / 556 ms without
    (docs/BENCHMARKS.md). A pool whose thread has ended is released with it."""
    from kvserve.engine.engine import LLMEngine

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-build") as builder:
        return builder.submit(LLMEngine.from_config, config).result()


_JOIN_TIMEOUT_S = 60.0  # a step in progress at shutdown must finish first; this bounds the wait
# After a step that scheduled nothing (requests unfinished, none runnable): how long the loop waits for a command before
# stepping again. Commands (an add, an abort) wake it at once; what changes without one (a grammar compile or a restore
# finishing) the core waits for itself (core._schedule), so this only bounds a loop with nothing to do (#43 item 13).
_IDLE_STEP_WAIT_S = 0.01


class EngineDeadError(RuntimeError):
    """The engine is not serving (its loop failed or was shut down): a new request is refused."""


class ServerShuttingDownError(EngineDeadError):
    """The server is shutting down: a new request is refused, and one still running when the grace period
    ends is aborted (its stream ends with this error, so that a client sees why)."""


class EngineFaultError(RuntimeError):
    """The engine loop raised while this request was in flight; the request cannot complete."""


class QueueFullError(RuntimeError):
    """More sequences would wait than `max_queued_requests` allows."""


_StreamItem = EngineCoreOutput | BaseException


class _Stream:
    """The core outputs of one request, queued from the engine thread for one asyncio consumer. Leaving the
    iteration early (break, cancellation, error) aborts the request in the core."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self._abort = abort
        self._core_finished = False  # the core holds nothing of it any more: no abort to send

    def put(self, item: _StreamItem) -> None:
        """Called from the engine thread (or, for a replica's outputs, on the loop)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def abort(self) -> None:
        if not self._core_finished:
            self._core_finished = True
            self._abort(self.request_id)

    async def _pending(self) -> list[EngineCoreOutput]:
        """The next core output and those queued behind it. An error raises once the outputs before it are used: it
        is held back for the next call."""
        item = await self._queue.get()
        pending: list[EngineCoreOutput] = []
        while True:
            if isinstance(item, BaseException):
                if pending:
                    self._queue.put_nowait(item)  # after what is queued: nothing is, between here and the next get
                    break
                self.finished = self._core_finished = True
                raise item
            pending.append(item)
            self._core_finished = self._core_finished or item.finished
            if self._queue.empty():
                break
            item = self._queue.get_nowait()
        return pending


class CoreStream(_Stream):
    """A request's core outputs as they come (token ids, no text): what a replica hands its ingress, which is the
    front end that detokenizes them (kvserve/cluster/)."""

    def __aiter__(self) -> AsyncIterator[EngineCoreOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[EngineCoreOutput]:
        try:
            while not self.finished:
                for output in await self._pending():
                    self.finished = output.finished
                    yield output
        finally:
            self.abort()


class RequestStream(_Stream):
    """The outputs of one request as text, in order, as an async iterator: the core's outputs put through the
    request's RequestState on the consumer's loop. Iteration ends after the finished output.

    A consumer that falls behind gets the outputs waiting for it as one (their concatenation for DELTA outputs,
    the newest for cumulative ones). A sample that a stop string ends is handed back to the core (`stop`)."""

    def __init__(
        self,
        state: RequestState,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
        stop: Callable[[str, int], None],
    ) -> None:
        super().__init__(state.request_id, loop, abort)
        self.state = state
        self._stop = stop

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                for core_output in await self._pending():
                    for index in self.state.absorb(core_output):
                        self._stop(self.request_id, index)
                    if self.state.failed:  # its text failed here: it fails alone (the abort below frees it)
                        self.finished = True
                        raise EngineFaultError(self.state.error)
                output = self.state.take_output()
                self.finished = self.state.finished
                if output is not None:
                    yield output
        finally:
            self.abort()


@dataclass(slots=True)
class _Add:
    stream: _Stream
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stop:
    """A stop string ended sample `index` (found by the front end): the core stops it and frees its blocks."""

    request_id: str
    index: int


@dataclass(slots=True)
class _Call:
    fn: Callable[[EngineCore], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


_Command = _Add | _Abort | _Stop | _Call


class AsyncLLMEngine:
    """Runs `engine`'s core in a background thread; `add_request` / `generate` from an asyncio loop, on which the
    engine's tokenizer serves the requests' text work from then on (the LLMEngine itself is not used again).

    `max_queued_requests` bounds the sequences waiting for admission (the engine's waiting queue, which
    holds each of a request's n samples, plus those not yet handed to it); a request (or a batch, which is
    all or nothing) that would go beyond it raises QueueFullError, and one that could never fit ValueError."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queued_requests: int = 1000,
        kv_event_listeners: Sequence[Callable[[KVEvent], None]] = (),
    ) -> None:
        """`kv_event_listeners` see every KV event of the core's pool on the engine thread, as it happens; each
        must return at once (a replica keeps them for its ingress's router)."""
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.core = engine.core
        self.tokenizer: Tokenizer = (
            engine.tokenizer
        )  # the front end's: encodes string prompts and detokenizes, on the loop
        self.max_queued_requests = max_queued_requests
        self._cond = threading.Condition()
        self._inbox: list[_Command] = []
        self._num_pending_seqs = 0  # posted, not yet counted in the published stats' num_waiting
        self._streams: dict[str, _Stream] = {}  # owned by the engine thread
        self._stats: EngineStats = self.core.stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.core.kv_events.listeners.extend(kv_event_listeners)
        self.kv_publisher = KVPublisher(self.core, self._notify)  # the KV inspector's snapshots and events

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Begin stopping without waiting (safe on the event loop): new requests are refused, and after the
        current step the thread aborts every remaining request, whose stream ends with
        ServerShuttingDownError, and exits. The server calls it when its shutdown grace period runs out."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def shutdown(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Abort every remaining request and stop the thread (blocks until the current step ends)."""
        self.stop()
        with self._cond:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    async def shutdown_async(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        await asyncio.to_thread(self.shutdown, timeout)

    @property
    def is_running(self) -> bool:
        """True while the loop serves requests: started, not stopped, not failed."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopping and self._error is None

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the loop, if one did."""
        return self._error

    def stats(self) -> EngineStats:
        """The engine's stats as of the last step or command (a snapshot published by the thread)."""
        return self._stats

    @property
    def facts(self) -> EngineFacts:
        """The engine's fixed limits and settings: immutable, so safe to read from the event loop."""
        return self.core.facts

    @property
    def grammar(self) -> GrammarCompiler:
        """The structured-output service the core compiles with (thread-safe): a front end that compiles a
        request's constraint first fails it fast and leaves the core a cache hit."""
        return self.core.grammar

    def metric_collectors(self) -> list[Collector]:
        """None beyond the EngineStats series (see EngineClient)."""
        return []

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request and return its output stream. Must be called on the event loop that will
        consume the stream. Raises EngineDeadError or QueueFullError at once; the engine's own
        validation errors (ValueError) arrive as the stream's first item."""
        (stream,) = self.add_requests([(request_id, prompt)], params, cache_salt)
        return stream

    def add_requests(
        self,
        requests: Sequence[tuple[str, str | list[int]]],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """Queue (request id, prompt) pairs that share `params`, all or none, and return their streams.
        Why all or none: one HTTP request with many prompts must either fit in the queue whole (counted as
        prompts x n sequences) or be refused whole, without crowding out other clients in between. A string prompt
        is encoded here, on the caller's loop (the server sends token ids, prepared on its own thread)."""
        loop = asyncio.get_running_loop()
        prompts = [
            (rid, None, prompt) if isinstance(prompt, list) else (rid, prompt, self.tokenizer.encode(prompt))
            for rid, prompt in requests
        ]
        streams = [
            RequestStream(RequestState(self.tokenizer, rid, text, ids, params), loop, self.abort, self.stop_sequence)
            for rid, text, ids in prompts
        ]
        self._post_all(streams, [ids for _, _, ids in prompts], params, cache_salt)
        return streams

    def add_core_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> CoreStream:
        """Queue one request of token ids whose outputs stay token ids (a replica's: its ingress detokenizes)."""
        stream = CoreStream(request_id, asyncio.get_running_loop(), self.abort)
        self._post_all([stream], [list(prompt_token_ids)], params, cache_salt)
        return stream

    def _post_all(
        self, streams: Sequence[_Stream], prompts: Sequence[list[int]], params: SamplingParams, cache_salt: str | None
    ) -> None:
        with self._cond:
            self.check_alive()
            self._reserve(len(streams) * params.n)
            for stream, ids in zip(streams, prompts):
                self._post(_Add(stream, ids, params, cache_salt))

    @property
    def num_queued_seqs(self) -> int:
        """Sequences counted against max_queued_requests now: waiting in the engine or not yet handed to it.
        Public: the queue depth that admission control sees, for a caller's own load shedding or metrics
        (EngineStats.num_waiting leaves out what the engine thread has not taken from its inbox yet)."""
        with self._cond:  # re-entrant (a Condition's default lock is an RLock): _reserve reads it locked
            return self._num_pending_seqs + self._stats.num_waiting

    def _reserve(self, num_seqs: int) -> None:
        """Count `num_seqs` new sequences against max_queued_requests (called with the lock held)."""
        if num_seqs > self.max_queued_requests:
            raise ValueError(
                f"this request asks for {num_seqs} sequences (prompts x n), more than the server queues at once "
                f"(--max-num-queued-reqs {self.max_queued_requests}); send fewer prompts or a smaller n"
            )
        queued = self.num_queued_seqs
        if queued + num_seqs > self.max_queued_requests:
            raise QueueFullError(
                f"the server is at capacity: {queued} sequences are already waiting and this request adds "
                f"{num_seqs} (--max-num-queued-reqs {self.max_queued_requests}); retry later"
            )
        self._num_pending_seqs += num_seqs

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; cancelling or closing the consumer aborts the request
        (at once: the stream's own generator would only be finalized later, by the garbage collector)."""
        stream = self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, from anywhere); its blocks are freed before the next step."""
        with self._cond:
            if self._error is None:
                self._post(_Abort(request_id))

    def stop_sequence(self, request_id: str, index: int) -> None:
        """Stop sample `index` of a request whose text hit a stop string (its stream found it); thread-safe."""
        with self._cond:
            if self._error is None:
                self._post(_Stop(request_id, index))

    def call(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn(core)` on the engine thread between steps (for checks and diagnosis)."""
        command = _Call(fn)
        with self._cond:
            self.check_alive()
            self._post(command)
        return command.future

    def check_alive(self) -> None:
        """Raise EngineDeadError unless the loop is serving."""
        if self._error is not None:
            raise EngineDeadError(f"the engine has failed and is not serving: {self._error!r}")
        if self._stopping:
            raise ServerShuttingDownError("the server is shutting down and accepts no new requests")
        if self._thread is None:
            raise EngineDeadError("the engine is not running (it has not been started)")

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    def _post(self, command: _Command) -> None:
        self._inbox.append(command)
        self._cond.notify()

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            idle = False  # the last step scheduled nothing
            while True:
                commands = self._next_commands(idle)
                if commands is None:
                    break
                for command in commands:
                    self._apply(command)
                self._stats = self.core.stats()
                self._settle(commands)
                self.kv_publisher.tick(bool(commands))
                idle = False
                if self.core.has_unfinished_requests():
                    ran_before = self._stats.iteration_tokens_sum
                    outputs = self.core.step()
                    self._stats = self.core.stats()
                    idle = not outputs and self._stats.iteration_tokens_sum == ran_before
                    for output in outputs:
                        self._deliver(output)
                    self.kv_publisher.tick(True)
            self._abort_all()
            self.core.close()
        except BaseException as exc:
            logger.exception("the engine loop failed; failing %d in-flight requests", len(self._streams))
            self._fail(exc)

    def _next_commands(self, idle: bool = False) -> list[_Command] | None:
        """Take the inbox, sleeping while idle; None when it is time to stop. After a step that scheduled nothing
        (`idle`), wait a moment for a command first: stepping again at once would spin a core at 100% while the
        requests wait for something only a command can change."""
        with self._cond:
            if idle and not self._inbox and not self._stopping:
                timeout = self.kv_publisher.wait_timeout()
                self._cond.wait(_IDLE_STEP_WAIT_S if timeout is None else min(timeout, _IDLE_STEP_WAIT_S))
            while not self._inbox and not self._stopping and not self.core.has_unfinished_requests():
                if self.kv_publisher.due():  # a watched snapshot is pending: publish it before sleeping on
                    break
                self._cond.wait(self.kv_publisher.wait_timeout())
            if self._stopping:
                commands, self._inbox = self._inbox, []
                self._num_pending_seqs = 0
                for command in commands:
                    self._refuse(command, ServerShuttingDownError("the server is shutting down"))
                return None
            commands, self._inbox = self._inbox, []
            return commands

    def _settle(self, commands: list[_Command]) -> None:
        """Stop counting applied adds as pending, now that the published stats count them as waiting (in
        this order, so that add_request never sees a moment where they are counted in neither)."""
        with self._cond:
            self._num_pending_seqs -= sum(c.params.n for c in commands if isinstance(c, _Add))

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            rid = command.stream.request_id
            try:
                self.core.add_request(rid, command.prompt_token_ids, command.params, cache_salt=command.cache_salt)
            except Exception as e:
                if not isinstance(e, ValueError):
                    logger.exception("add_request(%r) failed", rid)
                command.stream.put(e)
                return
            self._streams[rid] = command.stream
        elif isinstance(command, _Abort):
            output = self.core.abort_request(command.request_id)
            stream = self._streams.pop(command.request_id, None)
            if stream is not None and output is not None:
                stream.put(output)
        elif isinstance(command, _Stop):
            self.core.stop_sequence(command.request_id, command.index)
            if command.request_id not in self.core.requests:
                self._streams.pop(command.request_id, None)  # that was its last sample: the stream has ended
        else:
            try:
                command.future.set_result(command.fn(self.core))
            except Exception as e:  # noqa: BLE001 -- the caller gets the error, the loop goes on
                command.future.set_exception(e)

    def _deliver(self, output: EngineCoreOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.error is not None:  # this request failed alone (the engine serves on): its stream ends in error
            del self._streams[output.request_id]
            stream.put(EngineFaultError(output.error))
            return
        stream.put(output)
        if output.finished:
            del self._streams[output.request_id]

    def _abort_all(self) -> None:
        """At shutdown: abort what is left (freeing its blocks) and tell each stream why it ends."""
        error = ServerShuttingDownError(
            "the server is shutting down: this request was aborted when the "
            "shutdown grace period (--shutdown-grace-seconds) ran out; retry it"
        )
        for rid, stream in list(self._streams.items()):
            self.core.abort_request(rid)
            stream.put(error)
        self._streams.clear()
        self._stats = self.core.stats()

    @staticmethod
    def _refuse(command: _Command, error: BaseException) -> None:
        if isinstance(command, _Add):
            command.stream.put(error)
        elif isinstance(command, _Call):
            command.future.set_exception(error)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            commands, self._inbox = self._inbox, []
            self._num_pending_seqs = 0
        fault = EngineFaultError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        fault.__cause__ = exc
        for stream in self._streams.values():
            stream.put(fault)
        self._streams.clear()
        for command in commands:
            self._refuse(command, fault)
