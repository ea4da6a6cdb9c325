"""The two interfaces of the KV offload tier: what the scheduler's side sees of a tier (OffloadingManager, vLLM's
verbs), and what the tier sees of a store (BlockStore: host memory or a directory).

Why interfaces: the scheduler must never know whether blocks live in RAM or in files, nor wait on either (the engine
thread touches no file system: a disk tier answers lookups from its in-memory index and copies on its own threads),
and the tier must treat both stores alike instead of branching on their types. A block in the tier is keyed by its KV
cache group and chained hash (TierKey): each group keeps its own K/V of a prefix (kv/groups.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from kvserve.kv.block import TierBlock
from kvserve.kv.events import KVEvent

# (KV cache group, chained block hash): one stored block.
TierKey = tuple[int, bytes]


def tier_key(block: TierBlock) -> TierKey:
    return block.group_id, block.block_hash


class OffloadingManager(Protocol):
    """The tier as the scheduler's side (kv/offload/connector.py) uses it; engine thread only, never blocking."""

    @property
    def readable(self) -> bool:
        """Whether restores may be tried (a tier whose stores failed may still be read)."""
        ...

    def lookup(self, keys: Sequence[TierKey]) -> int:
        """How many of `keys`, from the first, the tier holds (as far as its index knows: no I/O)."""
        ...

    def prepare_load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> Future[int]:
        """Start copying `blocks` from the tier into their pool blocks, in order; the future's result is how many were
        restored (a prefix of `blocks`: the copy stops at the first block that fails a check or is gone). Done on
        return for a tier in memory."""
        ...

    def complete_load(self, blocks: Sequence[TierBlock]) -> None:
        """The restored blocks (a finished load's prefix) are in the pool now: index them, count them."""
        ...

    def prepare_store(self, blocks: Sequence[TierBlock]) -> None:
        """After the step that computed `blocks` succeeded: copy those the tier lacks out of the cache now (they may be
        reused by the next step) and keep them, at once (memory) or through a writer (disk); a block the tier has no
        room for is dropped and counted, never waited for."""
        ...

    @property
    def retains(self) -> bool:
        """Whether `retain` keeps blocks past eviction (a disk tier this process writes)."""
        ...

    def retain(self, keys: Sequence[TierKey], until: float) -> None:
        """Keep these blocks stored until `until` (time.time()), passed over by eviction (prompt_cache_retention)."""
        ...

    def take_events(self) -> list[KVEvent]:
        """What the tier stored and evicted since the last call, as KV events (BlockStored / BlockRemoved with the
        tier's medium), for the engine's event stream."""
        ...


@dataclass(frozen=True, slots=True)
class StoreUsage:
    num_blocks: int
    bytes_used: int


class BlockStore(Protocol):
    """Where a tier's blocks live, least recently used first out once the budget is reached. `contains` answers from
    memory (a directory's store keeps an index of its files); reads and writes may do I/O, on the tier's threads."""

    medium: str  # vLLM's word for it in KV events: "CPU" (host memory) or "DISK"

    def contains(self, key: TierKey) -> bool: ...

    def usage(self) -> StoreUsage: ...
