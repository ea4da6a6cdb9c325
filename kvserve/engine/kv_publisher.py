"""KVPublisher: hands the KV inspector's snapshots and events from the engine thread to readers on other threads.

Why this shape: the engine thread owns the engine, so snapshots are built there, between steps, and published as
one immutable value (a single attribute store, atomic under the GIL); readers only ever read that value. Building a
snapshot costs O(num_blocks), so it happens only while someone watches, at most once per `interval_s` (coalesced:
however many steps ran, one snapshot of the latest state), and once more when things settle so the last state is
never left unpublished. KV events are drained from the engine's bounded buffer every iteration (O(new events)), so
that buffer never overflows while the server runs; the last `history` of them are kept for readers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.engine.inspector import KVSnapshot, tenant_event
from kvserve.kv.events import KVEvent, event_to_json

if TYPE_CHECKING:
    from kvserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1  # <= 10 snapshots per second
# At most this fraction of the engine thread's time goes to snapshots: a large pool (a snapshot is O(num_blocks),
# about 13 ms at 7,000 blocks on one CPU core) is published less often rather than slowing decoding down. 1%, not
# 2%: what a snapshot costs the engine thread is paid again by the server's diff and encoding of it, and with 2% the
# open page cost 6% of decode throughput at batch 32 on the 2-core CPU (1%: 2.5-3%, docs/UI.md "Cost").
DEFAULT_MAX_OVERHEAD = 0.01
DEFAULT_HISTORY = 500


@dataclass(frozen=True, slots=True)
class KVPublication:
    """What readers see: the latest snapshot (None until someone has watched) and the recent events, oldest first."""

    snapshot: KVSnapshot | None
    events: tuple[dict[str, Any], ...]


class KVPublisher:
    def __init__(
        self,
        engine: EngineCore,
        wake: Callable[[], None],
        interval_s: float = DEFAULT_INTERVAL_S,
        history: int = DEFAULT_HISTORY,
        include_tokens: bool = True,
        max_overhead: float = DEFAULT_MAX_OVERHEAD,
    ) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.max_overhead = max_overhead
        self._gap_s = interval_s  # the wait before the next snapshot: interval_s, or longer when snapshots are costly
        self.include_tokens = include_tokens
        self._wake = wake
        self._lock = threading.Lock()
        self._watchers = 0
        self._dirty = True  # engine-thread state: something changed since the last snapshot
        self._last_at = 0.0
        self._seq = 0
        self._events: deque[dict[str, Any]] = deque(maxlen=history)  # engine thread only
        self.published = KVPublication(None, ())

    # ---- readers (any thread) ----

    @property
    def num_watchers(self) -> int:
        return self._watchers

    @contextmanager
    def watch(self) -> Iterator[None]:
        """While inside, the engine thread publishes snapshots (the first one at once) and the engine makes KV events
        (KVEventBuffer.enabled: none are made while nobody watches)."""
        with self._lock:
            self._watchers += 1
            self.engine.kv_events.open_reader()
        self._dirty = True
        self._wake()
        try:
            yield
        finally:
            with self._lock:
                self._watchers -= 1
                self.engine.kv_events.close_reader()

    async def latest(self) -> KVPublication:
        """The latest publication (here at once; the KVSource protocol's proxy of a replica's publisher asks it)."""
        return self.published

    # ---- the engine thread ----

    def tick(self, changed: bool) -> None:
        """Called by the engine thread after each command batch or step; publishes when due."""
        drained = self.engine.kv_events.drain()
        if drained:
            self._events.extend(self._event_json(*item) for item in drained)
            self.published = KVPublication(self.published.snapshot, tuple(self._events))
            changed = True
        self._dirty = self._dirty or changed
        if self.due():
            try:
                self._publish()
            except Exception:
                logger.exception("could not build the KV snapshot")
                self._last_at, self._dirty = time.monotonic(), False

    def _event_json(self, seq: int, at: float, event: KVEvent) -> dict[str, Any]:
        data = event_to_json(seq, at, event)
        return data if self.include_tokens else tenant_event(data)

    def due(self) -> bool:
        return self._watchers > 0 and self._dirty and time.monotonic() - self._last_at >= self._gap_s

    def wait_timeout(self) -> float | None:
        """How long the idle engine thread may sleep before a pending snapshot is due (None: until woken)."""
        if self._watchers == 0 or not self._dirty:
            return None
        return max(0.0, self._gap_s - (time.monotonic() - self._last_at))

    def _publish(self) -> None:
        self._seq += 1
        start = time.monotonic()
        # token ids only on demand (GET /v1/kv/blocks/{id}): 10x smaller; a tenant's view when redacted
        data = self.engine.kv_snapshot(False, tenant=not self.include_tokens)
        data["redacted"] = not self.include_tokens
        self.published = KVPublication(KVSnapshot(self._seq, time.time(), data), tuple(self._events))
        self._last_at = time.monotonic()
        self._gap_s = max(self.interval_s, (self._last_at - start) / self.max_overhead)
        self._dirty = False
