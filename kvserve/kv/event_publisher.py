"""ZmqKVEventPublisher: the prefix cache's events on a ZMQ PUB socket, in vLLM's frames and schema.

Why a thread and a bounded queue: the engine thread only hands each event over (`record`, a non-blocking put);
encoding, sending and answering replay requests happen on the publisher's own thread. When that thread falls
behind by `max_queue_size` events, further events are dropped and counted (`dropped`), never waited for; a reader
that sees a gap in the sequence numbers asks the replay socket for what it missed, or resynchronises.

Frames (vLLM's): [topic, sequence number (8 bytes, big-endian), msgpack payload (one KVEventBatch)]. Replay: a
ROUTER socket; a DEALER sends [b"", start sequence number (8 bytes, big-endian)] and receives
[b"", seq, payload] for every buffered batch from that number on, then [b"", -1 (8 bytes, signed), b""].
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvserve.kv.events_config import KVEventsConfig
from kvserve.kv.groups import KVCacheSpec
from kvserve.kv.vllm_events import UNIFORM_GROUPS, event_batch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the idle thread waits for an event before looking at replay requests again
_MAX_BATCH_EVENTS = 4096  # events encoded into one batch at most (a step's events normally arrive together)
_LINGER_MS = 500  # at close, how long the socket may still send what it queued
_BLOCK_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Data-parallel replica `rank` publishes on its own address, as vLLM does: a tcp port plus the rank, an
    ipc/inproc name with a `_dp<rank>` suffix."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport binds (stable side); a concrete host connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bound_address(endpoint: str, bind_host: str | None) -> str:
    """The address a bound endpoint opens: the `*` of `tcp://*:port` becomes bind_host (None: loopback; "*": every
    interface, vLLM's meaning; an IPv6 address in brackets). Every other endpoint is opened as written."""
    if not endpoint.startswith("tcp://*:"):
        return endpoint
    host = bind_host or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return endpoint.replace("*", host, 1)


class ZmqKVEventPublisher:
    def __init__(
        self,
        config: KVEventsConfig,
        block_size: int,
        medium: str,
        data_parallel_rank: int = 0,
        groups: Sequence[KVCacheSpec] = UNIFORM_GROUPS,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self.groups = tuple(groups)  # each KV cache group's spec, which its BlockStored events carry
        endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self._bind = _binds(endpoint)
        self.endpoint = bound_address(endpoint, config.bind_host) if self._bind else endpoint
        self.replay_endpoint = (
            None
            if config.replay_endpoint is None
            else bound_address(offset_endpoint(config.replay_endpoint, data_parallel_rank), config.bind_host)
        )
        self.dropped = 0  # events the engine thread could not hand over (queue full); engine thread only
        self.published = 0  # batches sent; publisher thread only
        self._queue: queue.Queue[KVEvent] = queue.Queue(maxsize=config.max_queue_size)
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._closing = threading.Event()
        self._ctx = zmq.Context()
        self._pub, self._replay = self._open_sockets()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a script that never closes its engine still sends what it queued
        logger.info(
            "publishing KV events on %s%s (vLLM's schema, %s-encoded events)",
            self.endpoint,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
            config.event_encoding,
        )

    def _open_sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        """Made here, on the caller's thread, so that a bad or taken address fails the engine's start; used only
        by the publisher thread from then on."""
        pub = self._ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.set_hwm(self.config.hwm)
            pub.ipv6 = "[" in self.endpoint  # an IPv6 address (zmq opens IPv4 only unless asked)
            (pub.bind if self._bind else pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.ipv6 = "[" in self.replay_endpoint
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            self._ctx.term()
            raise ValueError(
                f"--kv-events-config: cannot open {self.endpoint}"
                f"{' / ' + self.replay_endpoint if self.replay_endpoint else ''}: {e}"
            ) from None
        return pub, replay

    # ---- the engine thread ----

    def record(self, event: KVEvent) -> None:
        """A KVEventBuffer listener: hand a block event to the publisher thread, or count it dropped."""
        if not isinstance(event, _BLOCK_EVENTS):
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every recorded event has been sent (or `timeout` passed); True when all were. For a caller
        that must know the stream caught up (tests, a clean shutdown), never the engine's steps."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 1.0) -> None:
        """Publish what is queued (for up to `timeout` seconds), then close the sockets. Idempotent."""
        self._closing.set()
        self._thread.join(timeout)
        atexit.unregister(self.close)

    # ---- the publisher thread ----

    def _run(self) -> None:
        try:
            seq = 0
            while not (self._closing.is_set() and self._queue.empty()):
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    events = [self._queue.get(timeout=_POLL_S)]
                except queue.Empty:
                    continue
                while len(events) < _MAX_BATCH_EVENTS:
                    try:
                        events.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                batch = event_batch(
                    events, time.time(), self.medium, self.config.event_encoding, self.data_parallel_rank, self.groups
                )
                if batch is not None:
                    payload = self._encoder.encode(batch)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._replay_buffer.append((seq, payload))
                    seq += 1
                    self.published += 1
                for _ in events:
                    self._queue.task_done()
        except Exception:
            logger.exception("the KV event publisher failed; no further KV events are published")
        finally:
            self._pub.close(linger=_LINGER_MS)  # let the last batches leave before the context ends
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()

    def _serve_replay(self) -> None:
        """Answer one replay request: every buffered batch from the requested sequence number on, then the end."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._replay_buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
