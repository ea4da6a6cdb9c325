"""KV events: what entered and left the prefix cache, and what the engine did to requests' blocks.

Why a bounded buffer: the pool and the engine append on the engine thread and a reader (the KV inspector page,
later a router's index or a ZMQ publisher) drains between steps; a reader that falls behind loses the oldest events
(counted in `dropped`), it never makes the engine thread wait or grow without bound. Event names and fields follow
vLLM's KV events (BlockStored, BlockRemoved, AllBlocksCleared) so that the same stream can feed vLLM-style readers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_EVENT_CAPACITY = 4096


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block entered the prefix cache under its chained hash."""

    block_id: int
    block_hash: str  # hex
    parent_block_hash: str | None  # hex; None for a sequence's first block
    token_ids: tuple[int, ...]
    block_size: int
    # None: the engine's block pool. An offload tier's blocks (block_id -1: no pool block) carry its medium in vLLM's
    # words, "CPU" (host memory) or "DISK", as vLLM's offloading connector marks them.
    medium: str | None = None
    group_idx: int = 0  # the KV cache group (kv/groups.py): each group keeps its own blocks of a prefix
    kind: str = "block_stored"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block lost its hash: it was reused for other tokens (evicted)."""

    block_id: int
    block_hash: str
    medium: str | None = None  # as BlockStored's
    group_idx: int = 0
    kind: str = "block_removed"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset_prefix_cache)."""

    kind: str = "all_blocks_cleared"


@dataclass(frozen=True, slots=True)
class Preempted:
    """A running request lost its blocks and will recompute `tokens_lost` tokens."""

    request_id: str
    tokens_lost: int
    blocks_freed: int
    kind: str = "preempted"


@dataclass(frozen=True, slots=True)
class Aborted:
    """A request was aborted (client gone or cancelled); its blocks were freed."""

    request_id: str
    blocks_freed: int
    kind: str = "aborted"


@dataclass(frozen=True, slots=True)
class AdmissionRefused:
    """The first waiting request could not be admitted although the batch had room: the pool lacked blocks."""

    request_id: str
    blocks_needed: int
    blocks_free: int
    kind: str = "admission_refused"


@dataclass(frozen=True, slots=True)
class PrefixMissed:
    """A request's prefix hit stopped short of its prompt at `at_token`, for `reason` (kv/misses.py); the
    operator's view (every reason, another salt's too)."""

    request_id: str
    reason: str
    at_token: int
    prompt_tokens: int
    diverged_at_token: int | None = None
    kind: str = "prefix_missed"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | Preempted | Aborted | AdmissionRefused | PrefixMissed


@dataclass(slots=True)
class KVEventBuffer:
    """A bounded FIFO of (sequence number, wall time, event). Appends are O(1); when full the oldest is dropped.

    `listeners` see every event as it is appended, on the engine thread, whoever drains the buffer (the ZMQ
    publisher of kv/event_publisher.py is one): each must return at once, never wait.

    Events are made only while someone wants them (`enabled`): a listener, a reader that opened the buffer (the KV
    inspector while a page watches, a test), or a lease (someone asked for a snapshot lately: its recent events come
    with the next one). With KV cache groups a published block is an event per group, so a long prefill makes
    hundreds a step, which nobody pays for when nobody reads them."""

    capacity: int = DEFAULT_EVENT_CAPACITY
    next_seq: int = 0
    dropped: int = 0
    listeners: list[Callable[[KVEvent], None]] = field(default_factory=list)
    readers: int = 0  # open_reader / close_reader
    lease_until: float = 0.0  # time.monotonic() until which events are made for someone who asked lately
    _items: deque[tuple[int, float, KVEvent]] = field(default_factory=deque)

    @property
    def enabled(self) -> bool:
        """Whether events are wanted: whoever makes one checks first (the buffer drops one made anyway)."""
        return self.readers > 0 or bool(self.listeners) or time.monotonic() < self.lease_until

    def lease(self, seconds: float) -> None:
        """Make events for the next `seconds` (a snapshot was asked for: the next one shows what happened since)."""
        self.lease_until = max(self.lease_until, time.monotonic() + seconds)

    def open_reader(self) -> None:
        """A reader starts draining: events are made from now on."""
        self.readers += 1

    def close_reader(self) -> None:
        self.readers = max(0, self.readers - 1)

    def append(self, event: KVEvent) -> None:
        if not self.enabled:
            return
        for listener in self.listeners:
            listener(event)
        if len(self._items) >= self.capacity:
            self._items.popleft()
            self.dropped += 1
        self._items.append((self.next_seq, time.time(), event))
        self.next_seq += 1

    def drain(self) -> list[tuple[int, float, KVEvent]]:
        """Everything buffered, oldest first, leaving the buffer empty (the engine thread's call)."""
        items = list(self._items)
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)


def event_to_json(seq: int, at: float, event: KVEvent) -> dict[str, Any]:
    """One event as a JSON-ready dict: its fields plus `seq` (gap-free unless events were dropped) and `time`.

    Every field is a plain value (token_ids a tuple of ints), so the dict is built field by field: dataclasses.asdict
    copies each token id recursively, which cost the engine thread about 2 ms a step when a restore or a long
    prefill published some 70 blocks (every step converts its events, watched or not)."""
    data = {f.name: getattr(event, f.name) for f in fields(event)}
    if "token_ids" in data:
        data["token_ids"] = list(data["token_ids"])
    data["seq"], data["time"] = seq, at
    return data
