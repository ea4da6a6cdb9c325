"""The KV inspector with `--data-parallel-size N`: in the ingress, one stand-in per replica for what the inspector's
routes and stream hub use of an AsyncLLMEngine (kvserve/engine/inspected.py), so they show any replica with the
same code as one process.

Why a proxy publisher that follows the replica's own: the replica's engine thread keeps building snapshots exactly
as in one process (only while watched, at most 10 a second, within its 2% budget), and the ingress copies each new
publication over Ray at that same rate while a page shows the replica. What crosses per ask is only what is new:
the snapshot when there is a newer one, and the events after the last one held (kv_feed.py). The proxy numbers
snapshots and events on from the replica's, so a replica that Ray restarted (whose numbers start again) still
yields increasing numbers, which the stream hub relies on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvserve.cluster.kv_feed import KVSince, KVUpdate
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.inspector import KVSnapshot
from kvserve.engine.kv_publisher import DEFAULT_HISTORY, DEFAULT_INTERVAL_S, KVPublication

if TYPE_CHECKING:
    from kvserve.cluster.engine import ClusterEngine, ReplicaState
    from kvserve.engine.core import EngineCore
    from kvserve.engine.inspected import InspectedEngine

logger = logging.getLogger(__name__)


class RemoteKVPublisher:
    """A replica's KVPublisher as the ingress's readers see it (the KVSource protocol). Used on the event loop."""

    def __init__(
        self,
        replica: ReplicaState,
        include_tokens: bool,
        poll_s: float = DEFAULT_INTERVAL_S,
        history: int = DEFAULT_HISTORY,
    ) -> None:
        self.replica = replica
        self.include_tokens = include_tokens
        self.poll_s = poll_s  # the publisher's own rate: asking more often would find nothing new
        self.watcher = uuid.uuid4().hex  # this proxy's lease on the replica's publisher
        self.published = KVPublication(None, ())
        self._events: deque[dict[str, Any]] = deque(maxlen=history)
        self._epoch = ""  # the replica incarnation the numbers below follow ("" before the first answer)
        self._retired: set[str] = set()  # earlier incarnations: a late answer from one is ignored
        self._snapshot_base = 0  # added to the incarnation's numbers: ours go on increasing across restarts
        self._event_base = 0
        self._snapshot_seq = 0  # the last snapshot and event held, in our numbers
        self._event_seq = -1
        self._watchers = 0
        self._follower: asyncio.Task[None] | None = None

    @property
    def num_watchers(self) -> int:
        return self._watchers

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """While inside, follow the replica's publications (and so keep its publisher watched)."""
        self._watchers += 1
        if self._follower is None:
            self._follower = asyncio.get_running_loop().create_task(self._follow())
        try:
            yield
        finally:
            self._watchers -= 1
            if not self._watchers and self._follower is not None:
                self._follower.cancel()
                self._follower = None
                with contextlib.suppress(Exception):  # a replica that is down has no watch to end (its lease lapses)
                    self.replica.handle.kv_unwatch.remote(self.watcher)

    async def latest(self) -> KVPublication:
        """Ask the replica now (without watching): the snapshot route's recent events."""
        self.apply(await self.replica.handle.kv_publication.remote(self._since(), None, self.include_tokens))
        return self.published

    async def _follow(self) -> None:
        while True:
            try:
                update = await self.replica.handle.kv_publication.remote(
                    self._since(), self.watcher, self.include_tokens
                )
            except asyncio.CancelledError:
                raise
            # Down or restarting: its streams end (the view is not running); ask again.
            except Exception as e:  # noqa: BLE001 -- any failure of the remote call means the replica is down
                logger.debug("no KV publication from %s: %s", self.replica.name, e)
            else:
                self.apply(update)
            await asyncio.sleep(self.poll_s)

    def _since(self) -> KVSince:
        return KVSince(self._epoch, self._snapshot_seq - self._snapshot_base, self._event_seq - self._event_base)

    def apply(self, update: KVUpdate | None) -> None:
        """Take in an answer (idempotent: what is not newer than what is held is dropped)."""
        if update is None or update.epoch in self._retired:
            return
        if update.epoch != self._epoch:  # the first answer, or a restarted replica numbering from the start
            if self._epoch:
                self._retired.add(self._epoch)
            self._epoch = update.epoch
            self._snapshot_base, self._event_base = self._snapshot_seq, self._event_seq + 1
        base = self._event_base
        events = [e if not base else {**e, "seq": e["seq"] + base} for e in update.events]
        events = [e for e in events if e["seq"] > self._event_seq]
        snapshot = self.published.snapshot
        new = update.snapshot
        if new is not None and new.seq + self._snapshot_base > self._snapshot_seq:
            self._snapshot_seq = new.seq + self._snapshot_base
            snapshot = new if not self._snapshot_base else KVSnapshot(self._snapshot_seq, new.taken_at, new.data)
        if events:
            self._events.extend(events)
            self._event_seq = events[-1]["seq"]
        if events or snapshot is not self.published.snapshot:
            self.published = KVPublication(snapshot, tuple(self._events))


class ReplicaKVView:
    """One replica as the KV inspector sees an engine (the InspectedEngine protocol)."""

    def __init__(self, cluster: ClusterEngine, replica: ReplicaState, include_tokens: bool) -> None:
        self.cluster = cluster
        self.replica = replica
        self.kv_publisher = RemoteKVPublisher(replica, include_tokens)

    @property
    def is_running(self) -> bool:
        return self.cluster.is_running and self.replica.up

    def check_alive(self) -> None:
        self.cluster.check_alive()
        if not self.replica.up:
            raise EngineDeadError(
                f"replica {self.replica.name} is down (Ray is restarting it); retry later or choose another"
            )

    def call(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future:
        """`fn(engine)` on this replica's engine thread; its own exception (a ValueError for a 404) comes back as
        raised there, not wrapped in Ray's."""
        self.check_alive()
        result: concurrent.futures.Future = concurrent.futures.Future()
        remote = self.replica.handle.call.remote(fn).future()
        remote.add_done_callback(lambda done: _settle(result, done))
        return result


def _settle(result: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
    if done.cancelled():
        result.cancel()
        return
    error = done.exception()
    if error is None:
        result.set_result(done.result())
        return
    cause = getattr(error, "cause", None)
    result.set_exception(cause if isinstance(cause, BaseException) else error)


def replica_views(cluster: ClusterEngine, include_tokens: bool) -> dict[str, InspectedEngine]:
    """Each replica's stand-in, by name, in the replicas' order."""
    return {name: ReplicaKVView(cluster, replica, include_tokens) for name, replica in cluster.replicas.items()}
