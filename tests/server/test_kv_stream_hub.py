"""The live stream's hub on its own, fed real snapshots of a tiny engine by a stand-in publisher: a full snapshot
first, then deltas that rebuild each published snapshot; one encoding per update shared by all streams; a stream
that falls behind gets a fresh snapshot; large pools are diffed and encoded in a worker thread."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kv_workload import random_snapshots

from kvserve.engine import inspector_delta
from kvserve.engine.inspector import KVSnapshot
from kvserve.engine.inspector_delta import apply_delta
from kvserve.engine.kv_publisher import KVPublication
from kvserve.server import kv_stream
from kvserve.server.kv_stream import KVStreamHub

POLL_S = 0.005


class StandInPublisher:
    def __init__(self) -> None:
        self.published = KVPublication(None, ())
        self.watchers = 0
        self._seq = 0
        self._events: list[dict[str, Any]] = []

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Like KVPublisher.watch: a watch starts with a fresh snapshot."""
        self.watchers += 1
        if self.published.snapshot is not None:
            self.publish(self.published.snapshot.data)
        try:
            yield
        finally:
            self.watchers -= 1

    def publish(self, data: dict[str, Any], num_events: int = 0) -> None:
        self._seq += 1
        for _ in range(num_events):
            self._events.append(
                {"kind": "aborted", "request_id": "x", "blocks_freed": 0, "seq": len(self._events), "time": 0.0}
            )
        self.published = KVPublication(KVSnapshot(self._seq, float(self._seq), data), tuple(self._events))


class StandInEngine:
    def __init__(self) -> None:
        self.kv_publisher = StandInPublisher()
        self.is_running = True


def _parse(frame: str) -> tuple[str, dict[str, Any]]:
    head, data = frame.strip().split("\n")
    return head.removeprefix("event: "), json.loads(data.removeprefix("data: "))


async def _next_frame(stream: AsyncIterator[str]) -> tuple[str, dict[str, Any]]:
    while True:
        frame = await asyncio.wait_for(anext(stream), 5)
        if not frame.startswith(":"):
            return _parse(frame)


async def _settle(hub: KVStreamHub, seq: int) -> None:
    while hub.state is None or hub.state.seq < seq:
        await asyncio.sleep(POLL_S)


@pytest.fixture(scope="module")
def snaps(tiny_model_dir: Path) -> list[dict[str, Any]]:
    """As JSON has them (tuples become lists), to compare with what the frames rebuild."""
    return json.loads(json.dumps(random_snapshots(tiny_model_dir, seed=7, rounds=12)))


def _hub(history: int = 16) -> tuple[KVStreamHub, StandInEngine, asyncio.Event]:
    engine, closing = StandInEngine(), asyncio.Event()
    return KVStreamHub(engine, closing, poll_s=POLL_S, history=history), engine, closing  # type: ignore[arg-type]


def test_streams_share_frames_and_rebuild_each_snapshot(snaps: list[dict[str, Any]]) -> None:
    async def run() -> None:
        hub, engine, closing = _hub()
        engine.kv_publisher.publish(snaps[0])
        a, b = hub.stream(), hub.stream()
        first_a, first_b = await _next_frame(a), await _next_frame(b)
        assert first_a == first_b and first_a[0] == "snapshot"
        assert hub.num_full_frames == 1 and engine.kv_publisher.watchers == 1
        state_a, state_b = first_a[1], first_b[1]
        for snap in snaps[1:]:
            engine.kv_publisher.publish(snap, num_events=1)
            (kind_a, delta_a), (kind_b, delta_b) = await _next_frame(a), await _next_frame(b)
            assert kind_a == kind_b == "delta" and delta_a == delta_b and len(delta_a["events"]) == 1
            state_a, state_b = apply_delta(state_a, delta_a), apply_delta(state_b, delta_b)
            assert {k: state_a[k] for k in snap} == snap
        assert hub.num_full_frames == 1  # no stream needed a second full snapshot
        closing.set()
        await a.aclose()
        await b.aclose()
        await asyncio.sleep(5 * POLL_S)
        assert engine.kv_publisher.watchers == 0

    asyncio.run(run())


def test_a_stream_that_falls_behind_gets_a_fresh_snapshot(snaps: list[dict[str, Any]]) -> None:
    async def run() -> None:
        hub, engine, closing = _hub(history=2)
        engine.kv_publisher.publish(snaps[0])
        slow, quick = hub.stream(), hub.stream()
        await _next_frame(slow)
        await _next_frame(quick)
        engine.kv_publisher.publish(snaps[1])
        assert (await _next_frame(slow))[0] == "delta"  # one update behind: the history has it
        for snap in snaps[2:6]:
            engine.kv_publisher.publish(snap)
            await _settle(hub, hub.state.seq + 1 if hub.state else 1)
            assert (await _next_frame(quick))[0] == "delta"
        kind, data = await _next_frame(slow)  # four updates behind, history of two: a full snapshot
        assert kind == "snapshot" and data["seq"] == hub.state.seq  # type: ignore[union-attr]
        assert {k: data[k] for k in snaps[5]} == snaps[5]
        closing.set()
        await slow.aclose()
        await quick.aclose()

    asyncio.run(run())


def test_large_pools_are_diffed_and_encoded_off_the_loop(
    snaps: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    real = inspector_delta.diff_snapshots

    def diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return real(old, new)

    monkeypatch.setattr(kv_stream, "diff_snapshots", diff)

    async def run(large_from: int) -> None:
        monkeypatch.setattr(kv_stream, "LARGE_POOL", large_from)
        hub, engine, closing = _hub()
        engine.kv_publisher.publish(snaps[0])
        stream = hub.stream()
        await _next_frame(stream)
        engine.kv_publisher.publish(snaps[1])
        assert (await _next_frame(stream))[0] == "delta"
        closing.set()
        await stream.aclose()

    asyncio.run(run(large_from=1))
    asyncio.run(run(large_from=10**9))
    assert threads[0] != threading.main_thread().name and threads[1] == threading.main_thread().name
