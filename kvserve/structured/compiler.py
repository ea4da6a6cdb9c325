"""GrammarCompiler: the one structured-output service of an engine, shared by the engine thread and the server.

Why a service object: the server compiles a request's constraint on the compile pool (so that a bad schema is a
400 before a response starts) and the engine compiles it again when the request arrives (a cache hit);
both go through this object, so both see one cache and one backend. It touches no engine state, so any thread may
call it.

Why lazy: building a backend reads the whole vocabulary (1-3 s for a 262k-token one) and imports xgrammar, which
imports transformers. A server that never sees a structured request never pays for that; the first structured
request pays once, on a compile thread, not on the engine thread.

Why a pool of its own, bounded: compiles are the one request-controlled work whose cost has no natural bound, so
they run on `max_concurrent_compiles` threads of their own (never the prompt-preparation thread, so prompts,
/tokenize and chat templates never wait behind a compile), with at most `max_queued_compiles` more waiting (beyond
that, GrammarBusy: a 503), each within its budgets (--structured-outputs-config, structured/config.py): a source
over `max_grammar_bytes` is refused before compiling, and an xgrammar compile runs in a worker process that is
killed past `max_compile_seconds` or when its caller gives up (structured/compile_workers.py). A cached constraint
skips all of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.structured.backend import (
    DEFAULT_CACHE_SIZE,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarCompileLimit,
    GrammarVocab,
    make_backend,
)
from kvserve.structured.compile_workers import CompileAbandoned
from kvserve.structured.config import StructuredOutputsConfig
from kvserve.structured.matcher import GrammarMatcher
from kvserve.structured.params import ConstraintKind, StructuredOutputsParams, with_whitespace_default
from kvserve.structured.schema_check import outside_reference
from kvserve.vocab import STRUCTURED_OUTPUTS_BACKENDS, check_choice

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


class GrammarBusy(RuntimeError):
    """More compiles are running and waiting than --structured-outputs-config allows: retry later (a 503)."""


class GrammarCompiler:
    """Compiles constraints (cached, by StructuredOutputsParams.key) and makes per-sequence matchers.

    tokenizer, vocab_size (the model's logits width) and stop_token_ids (the engine's EOS ids: the tokens a
    complete grammar allows) fix what the backend reads; backend is `--structured-outputs-backend`.
    Thread-safe: the backend is built once under a lock, its compile cache is thread-safe, and matchers are
    per sequence (used by the engine thread only). The tokenizer is read once, when the backend is built: its
    vocabulary and JSON, through the Rust tokenizer's read-only calls, on the thread of the first compile. A
    private copy would cost about a second at every start (or hold a second 262k vocabulary) for that one read."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        backend: str = "auto",
        cache_size: int = DEFAULT_CACHE_SIZE,
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.backend_name = check_choice("--structured-outputs-backend", backend, STRUCTURED_OUTPUTS_BACKENDS)
        self.config = config or StructuredOutputsConfig()
        self._jobs: set[Future[Any]] = set()  # submitted and not finished (running or queued)
        self._jobs_lock = threading.Lock()  # not self._lock: that one is held while the backend builds (seconds)
        self._tokenizer = tokenizer
        self._vocab_size = int(vocab_size)
        self._stop_token_ids = tuple(stop_token_ids)
        self._cache_size = cache_size
        self._backend: GrammarBackend | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        """The width of the logits rows its masks cover (the model's, which may exceed the tokenizer's)."""
        return self._vocab_size

    @property
    def is_built(self) -> bool:
        """Whether the backend exists yet (built by the first compile)."""
        return self._backend is not None

    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend, built on first use (seconds for a large vocabulary: call it off the engine thread)."""
        with self._lock:
            if self._backend is None:
                vocab = GrammarVocab.from_tokenizer(self._tokenizer, self._vocab_size, self._stop_token_ids)
                self._backend = make_backend(self.backend_name, vocab, self._cache_size, self.config)
                logger.info(
                    "structured output: %s backend built over %d tokens (stop tokens %s)",
                    self.backend_name,
                    self._vocab_size,
                    list(vocab.stop_token_ids),
                )
            return self._backend

    def compile(self, params: StructuredOutputsParams, caller: Future[Any] | None = None) -> CompiledGrammar:
        """The compiled grammar (from the cache when seen before), within the budgets. Blocking, on the caller's
        thread: a cold compile takes milliseconds to seconds. Raises GrammarCompileError (a ValueError naming the
        field) for a bad constraint, GrammarCompileLimit for one over a budget; CompileAbandoned once `caller` (the
        future of the job this compile is part of) is cancelled."""
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"expected StructuredOutputsParams, got {type(params).__name__}")
        params = self.resolve(params)
        limit = self.config.max_grammar_bytes
        if params.source_bytes > limit:
            raise GrammarCompileLimit(
                params.field_name,
                "constraint too large",
                f"{params.source_bytes} bytes, over max_grammar_bytes {limit} (--structured-outputs-config)",
            )
        if params.kind is ConstraintKind.JSON:
            outside = outside_reference(params.schema)
            if outside is not None:
                raise GrammarCompileError(
                    params.field_name,
                    "invalid JSON schema",
                    f"$ref {outside[1]!r} at {outside[0]} points outside the schema; kvserve follows references "
                    "inside it only ('#/$defs/...'), and downloads nothing",
                )
        return self.backend.compile(params, caller)

    @property
    def num_compiles_in_flight(self) -> int:
        """Compiles running or queued on the pool (the kvserve:grammar_compiles_in_flight gauge)."""
        with self._jobs_lock:
            return len(self._jobs)

    def lookup(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar if cached already, else None. Never builds the backend nor compiles."""
        backend = self._backend
        return None if backend is None else backend.lookup(self.resolve(params))

    def resolve(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """`params` with the server's whitespace default applied where the request left it open."""
        return with_whitespace_default(params, self.config.disable_any_whitespace)

    def run_async(self, job: Callable[[Future[T]], T]) -> Future[T]:
        """`job(its own future)` on the compile pool (a server's compiles for one request: each tool's schema, the
        constraint), counted against the queue bound: GrammarBusy when it is full. Cancelling the future abandons
        the job, killing a compile it is in (the job passes its future to `compile`)."""
        future: Future[T] = Future()
        with self._jobs_lock:
            limit = self.config.max_concurrent_compiles + self.config.max_queued_compiles
            if len(self._jobs) >= limit:
                raise GrammarBusy(
                    f"{len(self._jobs)} grammar compiles are running or waiting, the most --structured-outputs-config "
                    f"allows (max_concurrent_compiles + max_queued_compiles = {limit}); retry later"
                )
            self._jobs.add(future)
        self._worker().submit(self._run, job, future)
        return future

    def _run(self, job: Callable[[Future[T]], T], future: Future[T]) -> None:
        """One job on a compile thread. Its future stays pending while it runs, so that cancel() still works (the
        job sees it and stops); the result of a cancelled one is dropped. Its slot is freed before its outcome is
        set: the client that outcome answers may send its next constraint at once, and must find the slot free."""
        try:
            outcome = _outcome(job, future)
        finally:
            with self._jobs_lock:
                self._jobs.discard(future)
        if outcome is not None:
            _settle(future, *outcome)

    def compile_async(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """`compile` on the compile pool; a cached grammar comes back as a future that is done already, so that
        a request whose grammar the server compiled is admitted at the next step without waiting for a thread."""
        params = self.resolve(params)  # here, so that the compile thread goes straight to its compile
        cached = self.lookup(params)
        if cached is not None:
            done: Future[CompiledGrammar] = Future()
            done.set_result(cached)
            return done
        return self.run_async(lambda future: self.compile(params, future))

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher for one sequence (about 0.1 ms)."""
        return self.backend.matcher(compiled)

    def close(self) -> None:
        """Stop at once: queued and running compiles are cancelled (their worker processes killed), the threads
        let go. A later compile starts them again (a sibling engine may still share this compiler)."""
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
        with self._lock:
            executor, self._executor = self._executor, None
            backend = self._backend
        if backend is not None:
            backend.close()
        if executor is not None:
            executor.shutdown(wait=False)

    def _worker(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.config.max_concurrent_compiles, thread_name_prefix="kvserve-grammar"
                )
            return self._executor


def _outcome(job: Callable[[Future[T]], T], future: Future[T]) -> tuple[T | None, BaseException | None] | None:
    """(result, error) of running `job`; None when its caller gave up first (nobody wants it)."""
    if future.cancelled():
        return None
    try:
        return job(future), None
    except CompileAbandoned:
        return None
    except BaseException as error:  # noqa: BLE001 -- handed to whoever waits on the future
        return None, error


def _settle(future: Future[T], result: T | None = None, error: BaseException | None = None) -> None:
    """Set a job's outcome unless its caller cancelled it meanwhile (then nobody wants it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass
