"""KVStreamHub: turns the engine's KV publications into the live stream's frames, once for all open streams.

A stream gets one full snapshot when it opens, then one delta per update (engine/inspector_delta.py), each carrying
the KV events published since the previous update. A stream that fell behind (its client reads slower than
updates come, so the hub's short history no longer holds what it missed) gets a fresh full snapshot instead, and
a reconnecting client starts with one.

Why the delta is computed here, not on the engine thread: the engine thread builds one snapshot per publication
however many streams are open (the publisher bounds that cost); diffing two published snapshots needs no engine
state, since they are immutable plain values. Done here it happens once per update for all streams, in a worker
thread for a large pool, where it overlaps the engine's model execution (which releases the GIL) instead of
lengthening a decode step, and the engine thread's work per publication stays what the publisher's budget accounts
for. Encoding is likewise done once per update and shared: a delta frame as the update is made, a full snapshot
frame only when some stream needs one (at most once per update), both off the event loop when large, so the loop
keeps serving requests while a 7,000-block pool's megabyte of JSON is written.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvserve.engine.inspected import InspectedEngine
from kvserve.engine.inspector import KVSnapshot
from kvserve.engine.inspector_delta import diff_snapshots

T = TypeVar("T")
logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often the hub looks for a newer publication (the engine publishes at most this often)
KEEPALIVE_S = 15.0  # an SSE comment after this long without data keeps proxies from closing the stream
HISTORY = 16  # delta frames kept for streams that are a little behind; further behind: a full snapshot
LARGE_POOL = 2048  # from this many blocks, diffing and encoding run in a worker thread, not on the event loop


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def off_loop(large: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread when the work is large (so the event loop keeps serving), else inline (a
    thread hop costs more than a small encoding)."""
    return await asyncio.to_thread(fn, *args) if large else fn(*args)


@dataclass(frozen=True, slots=True)
class _State:
    """The hub's current update: number `seq`, the snapshot it brings the state to and the events published so
    far (the full snapshot frame of this update carries them, so a new client's log starts filled)."""

    seq: int
    snapshot: KVSnapshot
    events: tuple[dict[str, Any], ...]


def _delta_frame(seq: int, old: KVSnapshot, new: KVSnapshot, events: list[dict[str, Any]]) -> str:
    delta = diff_snapshots(old.data, new.data) if new is not old else {}
    return sse("delta", {"seq": seq, "base": seq - 1, "time": new.taken_at, **delta, "events": events})


def _full_frame(state: _State) -> str:
    return sse(
        "snapshot",
        {"seq": state.seq, "time": state.snapshot.taken_at, **state.snapshot.data, "events": list(state.events)},
    )


def _is_large(snapshot: KVSnapshot) -> bool:
    return int(snapshot.data["pool"]["num_blocks"]) >= LARGE_POOL


class KVStreamHub:
    """One per app and engine shown (each replica of a replica set has its own), used only on its event loop. While
    at least one stream is open, a pump task watches the engine's publisher (so that it publishes) and makes one
    update per new publication."""

    def __init__(
        self, engine: InspectedEngine, closing: asyncio.Event, poll_s: float = POLL_S, history: int = HISTORY
    ) -> None:
        self.engine = engine
        self.closing = closing
        self.poll_s = poll_s
        self.state: _State | None = None
        self.deltas: deque[tuple[int, str]] = deque(maxlen=history)  # (seq, frame), oldest first
        self.num_full_frames = 0  # full snapshot frames encoded (tests check they are shared)
        self._seq = 0
        self._streams = 0
        self._pump: asyncio.Task[None] | None = None
        self._updated = asyncio.Event()  # replaced after each update: waiters hold the one that will be set
        self._full: tuple[int, asyncio.Future[str]] | None = None

    @property
    def running(self) -> bool:
        return not self.closing.is_set() and self.engine.is_running

    # ---- the pump ----

    async def _run_pump(self) -> None:
        publisher = self.engine.kv_publisher
        start = publisher.published.snapshot
        since = start.seq if start is not None else 0  # an older snapshot is stale: wait for the watch's first
        try:
            with publisher.watch():
                while self._streams and self.running:
                    published = publisher.published
                    snapshot = published.snapshot
                    if snapshot is not None and snapshot.seq > since:
                        try:
                            await self._update(snapshot, published.events)
                        except Exception:
                            logger.exception("could not make the KV stream's update; streams restart from a snapshot")
                            self.state, since = None, snapshot.seq
                            self.deltas.clear()
                    await asyncio.sleep(self.poll_s)
        finally:
            self.state, self._full, self._pump = None, None, None
            self.deltas.clear()
            self._wake()

    async def _update(self, snapshot: KVSnapshot, events: tuple[dict[str, Any], ...]) -> None:
        state = self.state
        if state is None:
            self._set(_State(self._next_seq(), snapshot, events))
            return
        last = state.events[-1]["seq"] if state.events else -1
        new_events = [e for e in events if e["seq"] > last]
        if snapshot is state.snapshot and not new_events:
            return
        seq = self._next_seq()
        frame = await off_loop(_is_large(snapshot), _delta_frame, seq, state.snapshot, snapshot, new_events)
        self.deltas.append((seq, frame))
        self._set(_State(seq, snapshot, events))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _set(self, state: _State) -> None:
        self.state = state
        self._wake()

    def _wake(self) -> None:
        self._updated.set()
        self._updated = asyncio.Event()

    # ---- streams ----

    async def _full_frame(self, state: _State) -> tuple[int, str]:
        """The full snapshot frame of `state`, encoded once however many streams ask for it."""
        if self._full is None or self._full[0] != state.seq:
            future: asyncio.Future[str] = asyncio.ensure_future(off_loop(_is_large(state.snapshot), _full_frame, state))
            self._full = (state.seq, future)
            self.num_full_frames += 1
        return state.seq, await asyncio.shield(self._full[1])

    def _missed(self, sent: int) -> list[tuple[int, str]] | None:
        """The delta frames after update `sent`, or None when the history no longer holds them all."""
        if not sent or not self.deltas or self.deltas[0][0] > sent + 1:
            return None
        return [(seq, frame) for seq, frame in self.deltas if seq > sent]

    async def stream(self) -> AsyncGenerator[str, None]:
        """One client's frames: a full snapshot, then the deltas, until the client leaves or the server stops."""
        self._streams += 1
        if self._pump is None:
            self._pump = asyncio.create_task(self._run_pump())
        try:
            yield ": kvserve kv stream\n\n"
            sent = 0  # the last update this client has (0: none yet)
            while self.running:
                state = self.state
                if state is None or state.seq <= sent:
                    try:
                        await asyncio.wait_for(self._updated.wait(), KEEPALIVE_S)
                    except TimeoutError:
                        yield ": keepalive\n\n"
                    continue
                missed = self._missed(sent)
                if missed is None:  # a new client, or one too far behind: the current state in full
                    sent, frame = await self._full_frame(state)
                    yield frame
                    continue
                for seq, frame in missed:
                    yield frame
                    sent = seq
        finally:
            self._streams -= 1
