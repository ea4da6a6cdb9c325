"""One kvserve engine in its own process, as a Ray actor: the replicas of `--data-parallel-size N`.

Why an actor around the ordinary AsyncLLMEngine: a replica is exactly the single-process engine (same
scheduler, KV cache, batching), so N replicas behave like N servers; Ray places the processes, restarts one
that dies (the actor is created with max_restarts) and carries the requests and their output streams (an async
generator method is a Ray streaming generator). A replica is an engine core only: its outputs stay token ids, and
the ingress is the front end that detokenizes them and applies stop strings (vLLM's data parallelism has one
front end for N engine cores too). What the ingress needs besides streams comes from `report()`:
the replica's load and the KV events of its prefix cache since the last report, which feed the router's index.
The KV inspector's page, when it shows this replica, follows its publisher through `kv_publication` (kv_feed.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.cluster.kv_feed import KVFeed, KVSince, KVUpdate
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine, build_for_engine_thread
from kvserve.engine.core import EngineCore
from kvserve.engine.core_outputs import EngineCoreOutput
from kvserve.engine.facts import EngineFacts
from kvserve.engine.stats import EngineStats
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
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
        self._events: deque[KVEvent] = deque()
        self._dropped = False
        self.engine = AsyncLLMEngine(
            build_for_engine_thread(config),
            max_queued_requests=max_queued_requests,
            kv_event_listeners=[self._on_event],
        )
        # The KV inspector's publications, for the ingress (cluster/kv_view.py).
        self.kv_feed = KVFeed(self.engine.kv_publisher)
        self.engine.start()

    def _on_event(self, event: KVEvent) -> None:
        """On the engine thread: keep prefix-cache events for the next report (bounded). The router indexes KV cache
        group 0's blocks (a full-attention group where the model has one: each prefix's whole chain), so the other
        groups' events are not sent (docs/SCALE_OUT.md)."""
        if isinstance(event, (BlockStored, BlockRemoved)) and event.group_idx != 0:
            return
        if isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            if len(self._events) >= EVENT_BACKLOG:
                self._dropped = True
                self._events.popleft()
            self._events.append(event)

    def facts(self) -> EngineFacts:
        """The engine's fixed facts (the ingress builds its own grammar compiler for their logits width)."""
        return self.engine.facts

    async def report(self) -> ReplicaReport:
        self.kv_feed.expire()  # the ingress reports every 50 ms: lapsed inspector watches end here too
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
    ) -> AsyncIterator[EngineCoreOutput]:
        """The request's core outputs (token ids) as the engine produces them; its errors are raised here and reach
        the ingress as the generator's error."""
        stream = self.engine.add_core_request(request_id, prompt, params, cache_salt)
        async for output in stream:
            yield output

    async def kv_publication(self, since: KVSince, watcher: str | None, include_tokens: bool) -> KVUpdate | None:
        """The KV inspector's publication newer than `since` (None: nothing newer); a `watcher` keeps this
        replica's publisher watched while it keeps asking (kv_feed.py). Async, like `report`, so that the feed
        is only ever used on the actor's event loop."""
        return self.kv_feed.update(since, watcher, include_tokens)

    async def kv_unwatch(self, watcher: str) -> None:
        self.kv_feed.unwatch(watcher)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stop_sequence(self, request_id: str, index: int) -> None:
        """A stop string the ingress found ended sample `index`: the core stops it and frees its blocks."""
        self.engine.stop_sequence(request_id, index)

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    async def shutdown(self) -> None:
        await self.engine.shutdown_async()


def _cached_hashes(engine: EngineCore) -> list[str]:
    return [block_hash.hex() for block_hash in engine.pool.cached[0]]
