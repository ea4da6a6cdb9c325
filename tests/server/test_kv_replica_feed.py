"""The KV inspector's replica feed and its ingress proxy without Ray (#18 with --data-parallel-size N): a watch held by
leases, only what is newer crossing, stale snapshots withheld, token ids redacted, and the proxy's numbers increasing
across a replica's restart (whose own numbers start again); and one process as the one replica of the data routes.
tests/server/test_cluster.py runs them over Ray with two replicas."""

from __future__ import annotations

import types
from typing import Any

import pytest
from server_support import API_KEY, ServerFactory

from kvserve.cluster import kv_feed
from kvserve.cluster.kv_feed import KVFeed, KVSince, KVUpdate
from kvserve.cluster.kv_view import RemoteKVPublisher
from kvserve.engine.inspector import KVSnapshot
from kvserve.engine.kv_publisher import KVPublication, KVPublisher

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _snapshot(seq: int) -> KVSnapshot:
    return KVSnapshot(seq, 1000.0 + seq, {"seq_marker": seq})


def _event(seq: int) -> dict[str, Any]:
    return {"kind": "block_stored", "seq": seq, "time": 1.0, "block_id": seq, "token_ids": [seq, seq]}


def _publisher() -> KVPublisher:
    events = types.SimpleNamespace(open_reader=lambda: None, close_reader=lambda: None)  # watch() opens a reader
    engine = types.SimpleNamespace(kv_events=events)
    publisher = KVPublisher(engine=engine, wake=lambda: None)  # type: ignore[arg-type]  # watch() needs kv_events only
    publisher.published = KVPublication(_snapshot(3), tuple(_event(i) for i in range(3)))
    return publisher


def test_feed_sends_only_what_is_newer_and_holds_the_watch_by_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    publisher = _publisher()
    feed = KVFeed(publisher)
    first = feed.update(KVSince(), "w1", include_tokens=True)
    assert publisher.num_watchers == 1 and feed.watchers == ["w1"]
    assert first is not None and first.snapshot is None  # seq 3 was taken before the watch: stale
    assert [e["seq"] for e in first.events] == [0, 1, 2] and first.events[0]["token_ids"] == [0, 0]
    since = KVSince(first.epoch, 0, 2)
    assert feed.update(since, "w1", include_tokens=True) is None  # nothing newer
    publisher.published = KVPublication(_snapshot(4), tuple(_event(i) for i in range(4)))
    update = feed.update(since, "w2", include_tokens=False)
    assert update is not None and update.snapshot is not None and update.snapshot.seq == 4
    assert [e["seq"] for e in update.events] == [3] and update.events[0]["token_ids"] is None  # redacted
    assert publisher.num_watchers == 1 and feed.watchers == ["w1", "w2"]  # one watch for all watchers
    feed.update(KVSince("another-epoch", 4, 3), None, include_tokens=True)
    feed.unwatch("w1")
    assert publisher.num_watchers == 1
    now = kv_feed.time.monotonic()
    monkeypatch.setattr(kv_feed.time, "monotonic", lambda: now + kv_feed.LEASE_S + 1)
    feed.expire()  # w2 stopped asking: its lease lapsed, and with it the watch
    assert feed.watchers == [] and publisher.num_watchers == 0


def test_a_watcher_from_another_epoch_gets_everything() -> None:
    feed = KVFeed(_publisher())
    update = feed.update(KVSince("old-incarnation", 99, 99), None, include_tokens=True)
    assert update is not None and update.snapshot is not None and update.snapshot.seq == 3
    assert len(update.events) == 3


def test_proxy_numbers_go_on_increasing_across_a_restart() -> None:
    proxy = RemoteKVPublisher(types.SimpleNamespace(name="replica-0"), include_tokens=True)  # type: ignore[arg-type]
    proxy.apply(KVUpdate("a", _snapshot(2), tuple(_event(i) for i in range(3))))
    first = proxy.published
    assert first.snapshot is not None and first.snapshot.seq == 2 and [e["seq"] for e in first.events] == [0, 1, 2]
    proxy.apply(KVUpdate("a", _snapshot(2), (_event(2),)))  # an answer to a repeated ask: nothing new
    assert proxy.published is first
    proxy.apply(KVUpdate("b", _snapshot(1), (_event(0), _event(1))))  # restarted: its numbers start again
    after = proxy.published
    assert after.snapshot is not None and after.snapshot.seq == 3 and after.snapshot.data == {"seq_marker": 1}
    assert [e["seq"] for e in after.events] == [0, 1, 2, 3, 4]
    assert proxy._since() == KVSince("b", 1, 1)  # asks in the replica's own numbers
    proxy.apply(KVUpdate("a", _snapshot(5), (_event(5),)))  # late, from the old incarnation
    assert proxy.published is after


def test_one_process_is_replica_0(make_server: ServerFactory) -> None:
    """The routes' replica choice in one process: one replica, named as the first of N, behind the key."""
    server = make_server(api_key=API_KEY)
    with server.client() as client:
        assert client.get("/v1/kv/replicas").status_code == 401
        assert client.get("/v1/kv/replicas", headers=AUTH).json() == [{"name": "replica-0", "up": True}]
        named = client.get("/v1/kv/snapshot", params={"replica": "replica-0"}, headers=AUTH)
        assert named.status_code == 200 and named.headers["x-kvserve-replica"] == "replica-0"
        assert named.json()["replica"] == "replica-0" and named.json()["pool"]["num_blocks"] == 256
        unknown = client.get("/v1/kv/stream", params={"replica": "replica-1"}, headers=AUTH)
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "replica"
