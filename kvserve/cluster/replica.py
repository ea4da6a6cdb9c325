"""One kvserve engine in its own process, as a Ray actor: the replicas of `--data-parallel-size N`.

Why an actor around the ordinary AsyncLLMEngine: a replica is exactly the single-process engine (same
scheduler, KV cache, batching), so N replicas behave like N servers; Ray places the processes, restarts one
that dies (the actor is created with max_restarts) and carries the requests and their output streams (an async
generator method is a Ray streaming generator). What the ingress needs besides streams comes from `report()`:
the replica's load and the KV events of its prefix cache since the last report, which feed the router's index.
The KV inspector's page, when it shows this replica, follows its publisher through `kv_publication` (kv_feed.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.cluster.kv_feed import KVFeed, KVSince, KVUpdate
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.engine import EngineStats, LLMEngine
from kvserve.engine.facts import EngineFacts
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

EVENT_BACKLOG = 65536  # block events kept between two reports; beyond it the report carries a full resync


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica's state for the ingress: its stats, and its prefix cache's changes since the last report.
    `resync`, when not None, is the whole set of cached block hashes (events were dropped in between): the
    ingress replaces what it knew, then applies `events`."""

    stats: EngineStats
    events: list[KVEvent]
    resync: list[str] | None
    running: bool


class EngineReplica:
    """An AsyncLLMEngine in this process, with the methods the ingress calls remotely."""

    def __init__(self, config: EngineConfig, max_queued_requests: int) -> None:
        self.engine = AsyncLLMEngine(LLMEngine.from_config(config), max_queued_requests=max_queued_requests)
        self._events: deque[KVEvent] = deque()
        self._dropped = False
        self.engine.engine.kv_events.listeners.append(self._on_event)
        self.kv = KVFeed(self.engine.kv)  # the KV inspector's publications, for the ingress (cluster/kv_view.py)
        self.engine.start()

    def _on_event(self, event: KVEvent) -> None:
        """On the engine thread: keep prefix-cache events for the next report (bounded)."""
        if isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            if len(self._events) >= EVENT_BACKLOG:
                self._dropped = True
                self._events.popleft()
            self._events.append(event)

    def facts(self) -> tuple[EngineFacts, int]:
        """The engine's facts without its grammar compiler (a handle to this process's threads, not data), and
        the logits width the ingress builds its own compiler for."""
        facts = self.engine.facts
        grammar = facts.grammar
        return dataclasses.replace(facts, grammar=None), (grammar.vocab_size if grammar else facts.vocab_size)

    async def report(self) -> ReplicaReport:
        self.kv.expire()  # the ingress reports every 50 ms: lapsed inspector watches end here too
        events = []
        while self._events:
            events.append(self._events.popleft())
        resync = None
        if self._dropped:
            self._dropped = False
            resync = await asyncio.wrap_future(self.engine.call(_cached_hashes))
        return ReplicaReport(self.engine.stats(), events, resync, self.engine.is_running)

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine produces them (the consumer's pace coalesces them, as in one
        process); its errors are raised here and reach the ingress as the generator's error."""
        (stream,) = self.engine.add_requests([(request_id, prompt)], params, cache_salt)
        async for output in stream:
            yield output

    async def kv_publication(self, since: KVSince, watcher: str | None, include_tokens: bool) -> KVUpdate | None:
        """The KV inspector's publication newer than `since` (None: nothing newer); a `watcher` keeps this
        replica's publisher watched while it keeps asking (kv_feed.py). Async, like `report`, so that the feed
        is only ever used on the actor's event loop."""
        return self.kv.update(since, watcher, include_tokens)

    async def kv_unwatch(self, watcher: str) -> None:
        self.kv.unwatch(watcher)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    async def shutdown(self) -> None:
        await self.engine.shutdown_async()


def _cached_hashes(engine: LLMEngine) -> list[str]:
    return [block_hash.hex() for block_hash in engine.pool.cached]
