"""The replica's side of the KV inspector with `--data-parallel-size N`: its publisher's newer publications for the
ingress, and the watches the ingress holds on it.

Why leases: the ingress watches a replica's publisher only while a page shows that replica, by asking for newer
publications at the publisher's rate; each ask renews its watcher's lease. An ingress that goes away without saying
so (killed, network cut) therefore stops the replica's snapshots within LEASE_S instead of leaving them running, and
a replica that Ray restarted is watched again by the next ask, with nothing to replay. The engine thread's cost is
the publisher's own (one snapshot per publication, within its budget), however many ingresses watch.
"""

from __future__ import annotations

import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from kvserve.engine.inspector import KVSnapshot, tenant_event
from kvserve.engine.kv_publisher import KVPublisher

LEASE_S = 10.0  # a watcher that has not asked for this long is dropped


@dataclass(frozen=True, slots=True)
class KVSince:
    """What the asker already has: the replica incarnation (`epoch`) its numbers belong to, the last snapshot's seq
    and the last event's seq. Another epoch (or "") means nothing: everything is sent."""

    epoch: str = ""
    snapshot_seq: int = 0
    event_seq: int = -1


@dataclass(frozen=True, slots=True)
class KVUpdate:
    """A replica's publication newer than a KVSince: the snapshot (None: none newer) and the events after it."""

    epoch: str
    snapshot: KVSnapshot | None
    events: tuple[dict[str, Any], ...]


class KVFeed:
    """Held by an EngineReplica, used on its actor thread(s)."""

    def __init__(self, publisher: KVPublisher) -> None:
        self.publisher = publisher
        self.epoch = uuid.uuid4().hex  # a restarted replica numbers its snapshots and events from the start again
        self._leases: dict[str, float] = {}  # watcher -> when its lease ends (time.monotonic())
        self._watch = ExitStack()  # holds the publisher's watch while any lease lives
        self._watch_from = 0  # the snapshot seq when the current watch began: older ones are stale

    @property
    def watchers(self) -> list[str]:
        return sorted(self._leases)

    def update(self, since: KVSince, watcher: str | None, include_tokens: bool) -> KVUpdate | None:
        """The publication newer than `since`, None when there is none; `watcher` takes or renews its lease."""
        self.publisher.include_tokens = include_tokens  # the ingress's --ui-redact-text (survives no restart)
        if watcher is not None:
            self._renew(watcher)
        self.expire()
        published = self.publisher.published
        fresh = since.epoch == self.epoch
        snapshot = published.snapshot
        floor = max(self._watch_from, since.snapshot_seq if fresh else 0)
        if snapshot is not None and snapshot.seq <= floor:
            snapshot = None
        events = _after(published.events, since.event_seq if fresh else -1)
        if not include_tokens:  # events drained before the ingress said so are still the operator's view
            events = tuple(tenant_event(e) for e in events)
        if fresh and snapshot is None and not events:
            return None
        return KVUpdate(self.epoch, snapshot, events)

    def unwatch(self, watcher: str) -> None:
        self._leases.pop(watcher, None)
        self.expire()

    def expire(self) -> None:
        """Drop lapsed leases; the publisher is unwatched once none is left (called at every ask and report)."""
        now = time.monotonic()
        for watcher in [w for w, end in self._leases.items() if end < now]:
            del self._leases[watcher]
        if not self._leases:
            self._watch.close()

    def _renew(self, watcher: str) -> None:
        if not self._leases:
            snapshot = self.publisher.published.snapshot
            self._watch_from = snapshot.seq if snapshot is not None else 0
            self._watch.enter_context(self.publisher.watch())
        self._leases[watcher] = time.monotonic() + LEASE_S


def _after(events: tuple[dict[str, Any], ...], seq: int) -> tuple[dict[str, Any], ...]:
    """The events with a seq above `seq` (they are in seq order: scan from the newest)."""
    start = len(events)
    while start and events[start - 1]["seq"] > seq:
        start -= 1
    return events[start:]
