"""GrammarCompiler: the one structured-output service of an engine, shared by the engine thread and the server.

Why a service object: the server compiles a request's constraint in its prompt-preparation thread (so that a bad
schema is a 400 before a response starts) and the engine compiles it again when the request arrives (a cache hit);
both go through this object, so both see one cache and one backend. It touches no engine state, so any thread may
call it.

Why lazy: building a backend reads the whole vocabulary (1-3 s for a 262k-token one) and imports xgrammar, which
imports transformers. A server that never sees a structured request never pays for that; the first structured
request pays once, on a compile thread, not on the engine thread.

Why one worker thread for `compile_async`: a cold compile takes up to tens of milliseconds and the request waits in
the queue meanwhile (the scheduler admits it once its future is done); one thread keeps compiles from competing
with the forward pass for the cores, and a cached constraint skips the thread altogether.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvserve.structured.backend import (
    DEFAULT_CACHE_SIZE,
    CompiledGrammar,
    GrammarBackend,
    GrammarVocab,
    make_backend,
)
from kvserve.structured.matcher import GrammarMatcher
from kvserve.structured.params import StructuredOutputsParams
from kvserve.vocab import STRUCTURED_OUTPUTS_BACKENDS, check_choice

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.backend_name = check_choice("--structured-outputs-backend", backend, STRUCTURED_OUTPUTS_BACKENDS)
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
                self._backend = make_backend(self.backend_name, vocab, self._cache_size)
                logger.info(
                    "structured output: %s backend built over %d tokens (stop tokens %s)",
                    self.backend_name,
                    self._vocab_size,
                    list(vocab.stop_token_ids),
                )
            return self._backend

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar (from the cache when seen before). Blocking: a cold compile takes milliseconds
        to tens of them. Raises GrammarCompileError (a ValueError naming the field) for a bad constraint."""
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"expected StructuredOutputsParams, got {type(params).__name__}")
        return self.backend.compile(params)

    def lookup(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar if cached already, else None. Never builds the backend nor compiles."""
        backend = self._backend
        return None if backend is None else backend.lookup(params)

    def compile_async(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """`compile` on the worker thread; a cached grammar comes back as a future that is done already, so that
        a request whose grammar the server compiled is admitted at the next step without waiting for a thread."""
        cached = self.lookup(params)
        if cached is not None:
            done: Future[CompiledGrammar] = Future()
            done.set_result(cached)
            return done
        return self._worker().submit(self.compile, params)

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher for one sequence (about 0.1 ms)."""
        return self.backend.matcher(compiled)

    def close(self) -> None:
        """Stop the worker thread (compiles already queued finish first)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _worker(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
            return self._executor
