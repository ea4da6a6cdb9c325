"""What the server uses of an engine: one process's AsyncLLMEngine, or a ClusterEngine of replicas on Ray.

Why a Protocol: the FastAPI app, its handlers and its transport are written once against this, so a replica
set serves exactly the same API (routes, fields, errors, auth, limits) as one process."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from kvserve.engine.async_engine import RequestStream
    from kvserve.engine.core import EngineCore
    from kvserve.engine.facts import EngineFacts
    from kvserve.engine.stats import EngineStats
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.compiler import GrammarCompiler


class EngineClient(Protocol):
    @property
    def facts(self) -> EngineFacts:
        """Fixed limits and settings, safe to read on the event loop."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The front end's tokenizer: its streams detokenize with it, on the serving event loop, and the server's
        logprob texts share it there (the engine thread runs none). The server's preparation thread builds its own
        from `tokenizer.snapshot()`, before start(): one tokenizer object per thread that uses one."""

    @property
    def grammar(self) -> GrammarCompiler:
        """The structured-output compiler (thread-safe): the server compiles a request's constraint with it on its
        preparation thread, so that a bad one is a 400 before the response starts (the engine then hits the cache)."""

    @property
    def is_running(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    def check_alive(self) -> None:
        """Raise EngineDeadError (or ServerShuttingDownError) when no request can be served."""

    def stats(self) -> EngineStats: ...

    def start(self) -> None:
        """Called on the serving event loop when the app starts."""

    def stop(self) -> None:
        """Refuse new requests and end those in flight (safe on the event loop, returns at once)."""

    async def shutdown_async(self, timeout: float = ...) -> None: ...

    def add_requests(
        self, requests: Sequence[tuple[str, str | list[int]]], params: SamplingParams, cache_salt: str | None = None
    ) -> list[RequestStream]: ...

    def abort(self, request_id: str) -> None: ...

    def call(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future[Any]: ...

    def metric_collectors(self) -> list[Collector]:
        """Collectors of the engine's own series beyond the EngineStats ones, registered by the server."""
