"""What the tier asks of where its blocks live (TierBackend: host memory, kv/offload/host_tier.py; a directory,
kv/offload/disk_tier.py), and the two pieces both backends share: the counters their threads update, and the restore
loop (blocks in order, up to the first that fails, each failure counted by its kind).

Why a backend protocol: the tier (kv/offload/tier.py) decides what to store and restore for the engine; how a block
gets into and out of a store differs (a slab copy on the engine thread, or a ring and writer threads; an in-place
copy, or a file read on a loader thread), and the tier must not branch on which store it has."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.kv.block import TierBlock
from kvserve.kv.offload.interface import BlockStore, TierKey
from kvserve.kv.offload.record import RecordError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TierCounters:
    """What the tier did, updated by the engine thread and the backend's threads under one lock, and what they stored
    and evicted since the engine thread last looked (deques: appended by any thread, drained by the engine's)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    stored_blocks: int = 0
    dropped_blocks: int = 0
    restored_blocks: int = 0
    restore_failures: int = 0
    io_errors: int = 0
    restores: int = 0
    restore_seconds_total: float = 0.0
    written: deque[TierBlock] = field(default_factory=deque)
    evicted: deque[TierKey] = field(default_factory=deque)

    def add(self, **counts: float) -> None:
        """Add to counters by name, under the lock (stats() reads them from other threads)."""
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


class TierBackend(Protocol):
    """A tier's store and how blocks move into and out of it."""

    @property
    def store(self) -> BlockStore:
        """Where the blocks live (what lookups ask, from memory)."""
        ...

    is_async: bool  # restores run on a thread of the backend's: a request waits a step for its load
    read_only: bool  # restores only (a directory this process may not write)
    error: str | None  # the last write error, while stores are paused after it

    def queued(self, key: TierKey) -> bool:
        """Whether the block is on its way into the store (not stored twice)."""
        ...

    def put(self, blocks: Sequence[TierBlock]) -> None:
        """Engine thread, after the step that computed them: copy the blocks out of the cache now (they may be reused
        by the next step) and store them, at once or through writers; what finds no room is dropped and counted."""
        ...

    def load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> Future[int]:
        """Copy the blocks into their pool blocks in order, up to the first that fails; the future's result is how
        many were restored."""
        ...

    def memory(self) -> list[torch.Tensor]:
        """The backend's own buffers, to be mapped at start (kv/cache.py touch_pages)."""
        ...

    retains: bool  # whether `retain` keeps blocks past eviction (a disk tier; host memory does not)

    def retain(self, keys: Sequence[TierKey], until: float) -> None:
        """Keep these blocks stored until `until` (time.time()), passed over by eviction meanwhile (OpenAI's
        prompt_cache_retention); applied after their writes when those are still queued."""
        ...

    def where(self) -> str:
        """Where the blocks live, for the start-up log."""
        ...

    def refused_records(self) -> int:
        """Entries its scans found that no good record is (planted or damaged files): failed checks too."""
        ...

    def refresh(self) -> None:
        """Bring what `store.contains` answers up to date with what other processes stored (no-op in memory)."""
        ...

    def flush(self, timeout: float) -> None:
        """Wait until what is queued is stored (tests, a clean shutdown)."""
        ...

    def close(self) -> None: ...


def restore_in_order(
    blocks: Sequence[TierBlock],
    cancelled: threading.Event,
    fetch: Callable[[TierBlock], None],
    finish: Callable[[int], None],
    counters: TierCounters,
) -> int:
    """`fetch` each block in order (find or read and check it) up to the first that fails, then `finish(n)` the first
    n (copy them into their pool blocks); returns n, 0 when cancelled. A record that fails a check or is gone counts as
    a restore failure, an OSError as an I/O error, and anything else one entry raises (a MemoryError, ...) as a
    failure of that block alone: the blocks before it stay restored. The restore's time and count go into
    `counters`."""
    start = time.perf_counter()
    done = 0
    for block in blocks:
        if cancelled.is_set():
            break
        try:
            fetch(block)
        except (RecordError, KeyError) as e:
            counters.add(restore_failures=1)
            logger.info("KV offload: block %s not restored (%s); it is recomputed", block.block_hash.hex()[:16], e)
            break
        except OSError as e:
            counters.add(io_errors=1)
            logger.warning("KV offload: reading block %s failed (%s); it is recomputed", block.block_hash.hex()[:16], e)
            break
        except Exception as e:  # noqa: BLE001 -- one entry's surprise (MemoryError, ...) costs that block alone
            counters.add(restore_failures=1)
            logger.warning(
                "KV offload: block %s not restored (%s: %s); it is recomputed",
                block.block_hash.hex()[:16],
                type(e).__name__,
                e,
            )
            break
        done += 1
    if cancelled.is_set():
        done = 0
    elif done:
        finish(done)
    counters.add(restored_blocks=done, restore_seconds_total=time.perf_counter() - start, restores=1)
    return done


def done_future(result: int) -> Future[int]:
    future: Future[int] = Future()
    future.set_result(result)
    return future
