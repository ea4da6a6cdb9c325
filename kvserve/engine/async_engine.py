"""AsyncLLMEngine: the single-threaded LLMEngine driven by one background thread, for asyncio callers.

Why a thread and not the event loop: a step is a blocking forward pass (tens of ms to seconds), which
would freeze every HTTP connection if it ran on the loop. So the engine thread owns the engine outright:
callers never touch it, they post commands (add, abort, call) to an inbox that the thread drains between
steps, and they receive outputs on a per-request asyncio queue fed through `loop.call_soon_threadsafe`.
The thread sleeps on a condition variable when there is nothing to do (no busy-wait). A fault in one request
(its forward pass, sampling, detokenizing) fails that request alone: `LLMEngine.step` isolates it and returns
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

from kvserve.engine.kv_publisher import KVPublisher
from kvserve.outputs import RequestOutput, merge_deltas
from kvserve.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from kvserve.engine.engine import EngineStats, LLMEngine
    from kvserve.engine.facts import EngineFacts
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 60.0  # a step in progress at shutdown must finish first; this bounds the wait


class EngineDeadError(RuntimeError):
    """The engine is not serving (its loop failed or was shut down): a new request is refused."""


class ServerShuttingDownError(EngineDeadError):
    """The server is shutting down: a new request is refused, and one still running when the grace period
    ends is aborted (its stream ends with this error, so that a client sees why)."""


class EngineFaultError(RuntimeError):
    """The engine loop raised while this request was in flight; the request cannot complete."""


class QueueFullError(RuntimeError):
    """More sequences would wait than `max_queued_requests` allows."""


_StreamItem = RequestOutput | BaseException


class RequestStream:
    """The outputs of one request, in order, as an async iterator. Iteration ends after the finished
    output; leaving the iteration early (break, cancellation, error) aborts the request.

    A consumer that falls behind gets the outputs waiting for it as one: the newest, for cumulative
    outputs (it holds everything); their concatenation, for DELTA outputs (each holds only its part)."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
        kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self._abort = abort
        self._kind = kind
        self._held: _StreamItem | None = None

    def put(self, item: _StreamItem) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def abort(self) -> None:
        if not self.finished:
            self._abort(self.request_id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _next(self) -> _StreamItem:
        """The next output, with those queued behind it coalesced into it; an error queued behind them is
        held back for the next call, so the outputs before it are still delivered."""
        item = self._held if self._held is not None else await self._queue.get()
        self._held = None
        if isinstance(item, BaseException):
            return item
        pending = [item]
        while not self._queue.empty():
            later = self._queue.get_nowait()
            if isinstance(later, BaseException):
                self._held = later
                break
            pending.append(later)
        if self._kind is RequestOutputKind.DELTA:
            return merge_deltas(pending)
        return pending[-1]

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._next()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.abort()


@dataclass(slots=True)
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


_Command = _Add | _Abort | _Call


class AsyncLLMEngine:
    """Runs `engine` in a background thread; `add_request` / `generate` from an asyncio loop.

    `max_queued_requests` bounds the sequences waiting for admission (the engine's waiting queue, which
    holds each of a request's n samples, plus those not yet handed to it); a request (or a batch, which is
    all or nothing) that would go beyond it raises QueueFullError, and one that could never fit ValueError."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int = 1000) -> None:
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._cond = threading.Condition()
        self._inbox: list[_Command] = []
        self._num_pending_seqs = 0  # posted, not yet counted in the published stats' num_waiting
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._stats: EngineStats = engine.stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.kv = KVPublisher(engine, self._notify)  # the KV inspector's snapshots and events, published here

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
        return self.engine.facts

    def metric_collectors(self) -> list[Collector]:
        """None beyond the EngineStats series (see EngineClient)."""
        return []

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer, used by the engine thread; others snapshot it before start() and build copies."""
        return self.engine.tokenizer

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
        prompts x n sequences) or be refused whole, without crowding out other clients in between."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(rid, loop, self.abort, params.output_kind) for rid, _ in requests]
        with self._cond:
            self.check_alive()
            self._reserve(len(requests) * params.n)
            for stream, (_, prompt) in zip(streams, requests):
                self._post(_Add(stream, prompt, params, cache_salt))
        return streams

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

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps (for checks and diagnosis)."""
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
            while True:
                commands = self._next_commands()
                if commands is None:
                    break
                for command in commands:
                    self._apply(command)
                self._stats = self.engine.stats()
                self._settle(commands)
                self.kv.tick(bool(commands))
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._stats = self.engine.stats()
                    for output in outputs:
                        self._deliver(output)
                    self.kv.tick(True)
            self._abort_all()
            self.engine.close()
        except BaseException as exc:
            logger.exception("the engine loop failed; failing %d in-flight requests", len(self._streams))
            self._fail(exc)

    def _next_commands(self) -> list[_Command] | None:
        """Take the inbox, sleeping while idle; None when it is time to stop."""
        with self._cond:
            while not self._inbox and not self._stopping and not self.engine.has_unfinished_requests():
                if self.kv.due():  # a watched snapshot is pending: publish it before sleeping on
                    break
                self._cond.wait(self.kv.wait_timeout())
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
                self.engine.add_request(rid, command.prompt, command.params, cache_salt=command.cache_salt)
            except Exception as e:
                if not isinstance(e, ValueError):
                    logger.exception("add_request(%r) failed", rid)
                command.stream.put(e)
                return
            self._streams[rid] = command.stream
        elif isinstance(command, _Abort):
            output = self.engine.abort_request(command.request_id)
            stream = self._streams.pop(command.request_id, None)
            if stream is not None and output is not None:
                stream.put(output)
        else:
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as e:  # noqa: BLE001 -- the caller gets the error, the loop goes on
                command.future.set_exception(e)

    def _deliver(self, output: RequestOutput) -> None:
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
            self.engine.abort_request(rid)
            stream.put(error)
        self._streams.clear()
        self._stats = self.engine.stats()

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
