"""DiskTier: a tier in a directory (the TierBackend of kv/offload/backend.py), so that it survives restarts and is
shared by the processes that use it. The engine thread only copies a step's blocks out of the cache into a ring
allocated once (a block that finds the ring full is dropped and counted, never waited for); writer threads turn them
into records (kv/offload/stores.py's DiskStore: checksummed, renamed into place), a loader thread reads records back
into pool blocks, and an index thread brings the store's in-memory index of records up to date with what other
processes wrote, so that no engine-thread call touches the file system."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.kv.block import TierBlock
from kvserve.kv.offload.backend import TierCounters, done_future, restore_in_order
from kvserve.kv.offload.config import KVOffloadConfig
from kvserve.kv.offload.fingerprint import KVFingerprint
from kvserve.kv.offload.interface import TierKey, tier_key
from kvserve.kv.offload.layout import BlockLayout
from kvserve.kv.offload.record import RecordError
from kvserve.kv.offload.safedir import UnsafeEntry
from kvserve.kv.offload.stores import DiskStore

logger = logging.getLogger(__name__)

# How often a disk tier's index looks for records other processes wrote or evicted (DiskStore.refresh).
REFRESH_SECONDS = 1.0
# A disk tier's stores pause after a write error: first for this long, doubling while errors go on, at most the last.
RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 300.0


@dataclass(slots=True)
class StoreBackoff:
    """When a disk tier's stores may be tried again after a write error. Why retry rather than stop for good: a full
    disk empties, a remounted directory comes back, and a server that runs for weeks should not need a restart to
    store again; why back off: every attempt on a full disk costs a failed write per block, so the pauses grow (1 s,
    2 s, ... 5 min) while the errors go on, as a storage engine retries a failed background write (RocksDB's
    auto-resume after a no-space error) and a client retries a busy server. A write that succeeds resets it.
    `clock` is injectable so that tests need no waiting."""

    clock: Callable[[], float] = time.monotonic
    delay: float = 0.0  # the current pause (0: no error since the last success)
    resume_at: float = 0.0

    def paused(self) -> bool:
        return self.clock() < self.resume_at

    def failed(self) -> float:
        """A write failed: pause for the next delay; returns it."""
        self.delay = min(RETRY_MAX_SECONDS, self.delay * 2) if self.delay else RETRY_FIRST_SECONDS
        self.resume_at = self.clock() + self.delay
        return self.delay

    def succeeded(self) -> None:
        self.delay = self.resume_at = 0.0


class _RetainNow:
    """The writers' queue item that applies the pending retains (DiskTier.retain)."""


RETAIN_NOW = _RetainNow()


class DiskTier:
    is_async = True
    retains = True  # records outlive the process: eviction passes over a retained one (DiskStore.retain)

    def __init__(
        self,
        config: KVOffloadConfig,
        fingerprint: KVFingerprint,
        layout: BlockLayout,
        counters: TierCounters,
        backoff: StoreBackoff,
    ) -> None:
        assert config.path is not None
        self.store = DiskStore(
            config.path,
            fingerprint,
            config.size_bytes,
            payload_bytes=layout.block_bytes,
            allow_other_writers=config.allow_other_writers,
        )
        self.layout = layout
        self.counters = counters
        self.backoff = backoff
        self.read_only = self.store.read_only
        self.error: str | None = None  # the last write error, while stores are paused after it
        self._unsafe_logged: set[str] = set()  # planted entries the writers met, logged once each
        self._queued: set[TierKey] = set()  # blocks waiting for a writer (not stored twice)
        # The writers' queue holds (block, slot) of payloads copied into the ring, a slab of max_queued_bytes allocated
        # (and touched) once, so that a step's stores allocate nothing; a block that finds no free slot is dropped and
        # counted. A writer hands each slot back once its record is written. Two writers (_write_loop): one that runs
        # only on an idle core, and one that joins it while the ring is more than half full (_behind).
        depth = 0 if self.read_only else max(4, config.max_queued_bytes // max(layout.block_bytes, 1))
        self._ring = torch.empty(depth, layout.block_bytes, dtype=torch.uint8)
        self._free_slots = list(range(depth - 1, -1, -1))
        self._queue: queue.Queue[tuple[TierBlock, int] | _RetainNow | None] = queue.Queue()
        self._retain: dict[TierKey, float] = {}  # blocks to retain until (time.time()), not yet applied
        self._behind = threading.Event()
        self._closing = threading.Event()
        self._writers: list[threading.Thread] = []
        self._at_exit: Callable[[], None] | None = None
        if not self.read_only:
            for idle in (True, False):
                name = "kvserve-kv-offload-writer" + ("" if idle else "-catch-up")
                writer = threading.Thread(target=self._write_loop, args=(idle,), name=name, daemon=True)
                writer.start()
                self._writers.append(writer)
            # A program that never closes its engine (LLM(...) then exit) still gets its queued blocks written: the
            # writers are daemon threads, which exit would otherwise stop mid-queue. A weak reference, so that the
            # hook keeps no engine alive.
            self._at_exit = _close_at_exit(weakref.ref(self))
            atexit.register(self._at_exit)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-offload-loader")
        # Records other processes write (replicas sharing the directory) join the store's index from this thread.
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvserve-kv-offload-index", daemon=True)
        self._refresher.start()

    # ---- stores ----------------------------------------------------------------------------------------

    def queued(self, key: TierKey) -> bool:
        return key in self._queued

    def put(self, blocks: Sequence[TierBlock]) -> None:
        """Into the writers' ring (a block that finds it full is dropped and counted: the writers are that far behind,
        never waited for); a paused tier (a write error) or a read-only one takes nothing."""
        if self.read_only or self.backoff.paused():
            return
        with self.counters.lock:
            slots = [self._free_slots.pop() for _ in range(min(len(blocks), len(self._free_slots)))]
            self.counters.dropped_blocks += len(blocks) - len(slots)
        kept = list(blocks)[: len(slots)]
        self.layout.gather_into([b.block_id for b in kept], self._ring, slots)
        for block, slot in zip(kept, slots):
            self._queued.add(tier_key(block))
            self._queue.put_nowait((block, slot))
        if len(self._free_slots) < len(self._ring) // 2:
            self._behind.set()

    def _write_loop(self, idle: bool) -> None:
        """A writer: records out of the queue into files, until close() queues None. The idle writer runs SCHED_IDLE,
        taking a core only when nothing else wants one, so it never preempts one of the engine's compute threads
        mid-step, which stalls the whole parallel step (on the no-reuse benchmark, where every block is written and
        none read: 0.93x tier-off with one writer at nice 10, 0.98-1.01x so). The catch-up writer, at nice 10, takes
        records only while the ring is more than half full, so that under steps that leave no core idle the tier still
        writes most blocks (the no-reuse benchmark's saturated batch, the worst case, dropped up to 10%) rather than
        few. Two threads, not one changing its policy: an unprivileged thread cannot leave SCHED_IDLE. A write error
        pauses stores and they are retried with backoff (_write_one); reads go on meanwhile."""
        _set_writer_priority(idle)
        half = len(self._ring) // 2
        while True:
            if not idle:
                self._behind.wait()
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _RetainNow):
                self._apply_retains()
                continue
            block, slot = item
            try:
                self._write_one(block, slot)
            finally:
                with self.counters.lock:
                    self._free_slots.append(slot)
                    if not idle and len(self._free_slots) > half:
                        self._behind.clear()
                self._queued.discard(tier_key(block))
                with self.counters.lock:  # retained while it was queued: now that it is written (or dropped)
                    until = self._retain.pop(tier_key(block), None)
                if until is not None:
                    self._retain_one(tier_key(block), until)

    def _write_one(self, block: TierBlock, slot: int) -> None:
        """Store one queued block, unless stores are paused (then it is dropped). What can go wrong costs as little as
        it must: a block no record can hold, or whose shard is an entry planted at its name (UnsafeEntry), is dropped
        and counted alone (the path logged once); any other OSError (a full disk, a vanished directory) pauses every
        store for the backoff's delay, and the first write that succeeds after it turns them on again."""
        counters = self.counters
        if self.backoff.paused():
            counters.add(dropped_blocks=1)
            return
        try:
            written, evicted = self.store.write(tier_key(block), block.key, self._ring[slot])
        except RecordError as e:  # a block no record can hold (an identity past MAX_IDENTITY_BYTES): not stored
            counters.add(dropped_blocks=1)
            logger.debug("KV offload: block %s not stored (%s)", block.block_hash.hex()[:16], e)
            return
        except UnsafeEntry as e:
            with counters.lock:
                counters.io_errors += 1
                counters.dropped_blocks += 1
                first = str(e.filename) not in self._unsafe_logged
                self._unsafe_logged.add(str(e.filename))
            if first:
                logger.warning("KV offload: %s; blocks of that shard are not stored", e)
            return
        except OSError as e:
            with counters.lock:
                counters.io_errors += 1
                counters.dropped_blocks += 1
                starts = self.error is None
                self.error = f"{type(e).__name__}: {e}"
                delay = self.backoff.failed()
            log = logger.error if starts else logger.debug
            log(
                "the KV offload tier stops storing blocks for %.0f s (%s); requests are served as without it",
                delay,
                self.error,
            )
            return
        with counters.lock:
            counters.stored_blocks += int(written)
            recovered, self.error = self.error, None
            self.backoff.succeeded()
        if recovered is not None:
            logger.info("the KV offload tier stores blocks again (after %s)", recovered)
        if written:
            counters.written.append(block)
        counters.evicted.extend(evicted)

    # ---- retention -------------------------------------------------------------------------------------

    def retain(self, keys: Sequence[TierKey], until: float) -> None:
        """Engine thread: keep these blocks' records until `until`. A writer applies it (never the engine thread: it
        touches files): now for records already written, after its write for a block still queued."""
        if self.read_only:
            return
        with self.counters.lock:
            for key in keys:
                self._retain[key] = max(self._retain.get(key, 0.0), until)
        self._queue.put_nowait(RETAIN_NOW)

    def _apply_retains(self) -> None:
        """A writer: set the retained records' times; those still queued are left to their write (_write_one)."""
        with self.counters.lock:
            todo = {k: t for k, t in self._retain.items() if k not in self._queued}
            for key in todo:
                del self._retain[key]
        for key, until in todo.items():
            self._retain_one(key, until)

    def _retain_one(self, key: TierKey, until: float) -> None:
        try:
            self.store.retain(key, until)
        except OSError as e:  # a vanished directory: the record is gone anyway
            logger.debug("KV offload: could not retain %s: %s", key[1].hex()[:16], e)

    # ---- restores --------------------------------------------------------------------------------------

    def load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> Future[int]:
        """On the loader thread (the request waits a step; the others run on)."""
        if self._closing.is_set():
            return done_future(0)
        return self._loader.submit(self._load, blocks, cancelled)

    def _load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> int:
        """Read and check the records in order: straight into their blocks' slices of the cache where the payload is
        the cache's own bytes (BlockLayout.reads_in_place), else into staging rows, then scattered (dequantized)."""
        layout = self.layout
        if layout.reads_in_place:
            fetch = lambda block: self.store.read_into(  # noqa: E731
                tier_key(block), block.key, layout.block_views(block.block_id)
            )
            return restore_in_order(blocks, cancelled, fetch, lambda n: None, self.counters)
        staging = layout.load_buffer(len(blocks))
        read: list[TierBlock] = []

        def fetch_staged(block: TierBlock) -> None:
            self.store.read_into(tier_key(block), block.key, [staging[len(read)].numpy().data])
            read.append(block)

        def finish(n: int) -> None:
            layout.scatter([b.block_id for b in blocks[:n]], staging[:n])

        return restore_in_order(blocks, cancelled, fetch_staged, finish, self.counters)

    # ---- the rest --------------------------------------------------------------------------------------

    def memory(self) -> list[torch.Tensor]:
        return [self._ring]

    def where(self) -> str:
        return f"disk at {self.store.dir}"

    def refused_records(self) -> int:
        return self.store.refused_records

    def _refresh_loop(self) -> None:
        while not self._closing.wait(REFRESH_SECONDS):
            try:
                self.store.refresh()
            except OSError as e:  # a vanished directory: the next look may find it again
                logger.debug("KV offload: refreshing the index failed (%s)", e)

    def refresh(self) -> None:
        self.store.refresh()

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._queued and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._refresher.join(timeout=5)
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._writers:
            self.flush(30.0)
            for _ in self._writers:
                self._queue.put(None)
            self._behind.set()  # the catch-up writer waits for it before it reads the queue
            for writer in self._writers:
                writer.join(timeout=30)
            self._writers = []
        self._loader.shutdown(wait=True)
        self.store.close()


def _close_at_exit(tier: weakref.ref[DiskTier]) -> Callable[[], None]:
    def close() -> None:
        live = tier()
        if live is not None:
            live.close()

    return close


def _set_writer_priority(idle: bool) -> None:
    """This thread's scheduling, for a writer (see DiskTier._write_loop): SCHED_IDLE (where it is refused, nice 19),
    or nice 10. Linux, where a thread has its own; elsewhere the thread runs as it is."""
    tid = threading.get_native_id()
    try:
        if idle:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                return
            except OSError:
                pass
        os.setpriority(os.PRIO_PROCESS, tid, 19 if idle else 10)
    except (AttributeError, OSError):
        pass
