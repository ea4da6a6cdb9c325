"""OffloadTier: the engine's side of the tier. It copies full blocks out of the KV cache after the step that computed
them (write-through), finds which of a prompt's next blocks the tier holds, and copies them back into fresh pool
blocks (a restore), in host memory inline and on disk in its own threads, so that the engine step never waits on a
file.

Why write-through rather than store-on-evict: the pool evicts inside allocate() and the block's new owner overwrites
it in the same step, so there is no moment at which an evicted block could still be copied. A block is therefore
copied once it is full and hashed; eviction only drops the pool's copy (vLLM's OffloadingConnector stores the same
way). The copy out of the cache is a memory copy on the engine thread (about 0.1 ms for one of Gemma 3 270M's
576 KiB blocks); everything slower (encoding, checksums, files) runs on the writer thread behind a bounded queue,
and a block that finds the queue full is dropped and counted, never waited for."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.kv.block import TierBlock
from kvserve.kv.cache import LayerKVCache, touch_pages, unique_tensors
from kvserve.kv.events import BlockRemoved, BlockStored, KVEvent
from kvserve.kv.offload.config import KVOffloadConfig
from kvserve.kv.offload.fingerprint import KVFingerprint
from kvserve.kv.offload.index import TierIndex
from kvserve.kv.offload.interface import TierKey, tier_key
from kvserve.kv.offload.layout import BlockLayout, RowCopy
from kvserve.kv.offload.record import RecordError
from kvserve.kv.offload.safedir import UnsafeEntry
from kvserve.kv.offload.stores import DiskStore, HostMemoryStore
from kvserve.units import format_bytes

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


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """The tier at one moment, for metrics, `kvserve doctor` and the inspector."""

    medium: str  # "CPU" (host memory) or "DISK"
    available: bool  # False: the tier stores nothing now (unusable, read-only, or paused after a write error)
    capacity_bytes: int
    bytes_used: int
    num_blocks: int
    block_bytes: int
    stored_blocks: int  # written into the tier by this process
    dropped_blocks: int  # not written: the writer's queue was full, or the tier had failed
    restored_blocks: int
    restore_failures: int  # records that failed a check (corrupt, truncated, of another block) or vanished
    io_errors: int
    restore_seconds_total: float
    restores: int  # restore operations (one per request admitted with tier hits)


class OffloadTier:
    """The tier under one engine's pool, an OffloadingManager (kv/offload/interface.py): its engine-thread methods are
    lookup, prepare_load, complete_load, prepare_store, take_events, stats, view and close; the copies from disk and
    the writes run on its own threads.

    A block is one pool block's bytes (BlockLayout over the cache's distinct tensors: with KV cache groups, the layers
    of one group), keyed by its group and hash, so a restore brings each group only the blocks it needs."""

    def __init__(
        self,
        config: KVOffloadConfig,
        fingerprint: KVFingerprint,
        caches: Sequence[LayerKVCache],
        block_size: int,
        copy_rows: RowCopy | None = None,
    ) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.medium = config.medium
        self.store: HostMemoryStore | DiskStore | None
        self.error: str | None = None  # why the tier is unusable, or why its stores are paused (the last write error)
        self.backoff = StoreBackoff()
        self._unsafe_logged: set[str] = set()  # planted entries the writers met, logged once each
        caches = unique_tensors(caches)
        self.layout = BlockLayout(caches, compress=config.dtype == "int8", copy_rows=copy_rows)
        if config.size_bytes < self.layout.block_bytes:
            raise ValueError(
                f"--kv-offloading-size {format_bytes(config.size_bytes)} holds no block: one takes "
                f"{format_bytes(self.layout.block_bytes)} ({block_size} tokens); pass a size of many blocks, e.g. "
                f"{format_bytes(1000 * self.layout.block_bytes, '.0f').replace(' ', '')}"
            )
        if config.path is None:
            self.store = HostMemoryStore(config.size_bytes, self.layout.block_bytes)
        else:
            try:
                self.store = DiskStore(
                    config.path,
                    fingerprint,
                    config.size_bytes,
                    payload_bytes=self.layout.block_bytes,
                    allow_other_writers=config.allow_other_writers,
                )
            except OSError as e:
                self.store, self.error = None, f"{type(e).__name__}: {e}"
                logger.error(
                    "the KV offload tier at %s cannot be used (%s): serving without it", config.path, self.error
                )
        self.stored_blocks = self.dropped_blocks = self.restored_blocks = 0
        self.restore_failures = self.io_errors = self.restores = 0
        self.restore_seconds_total = 0.0
        self._queued: set[TierKey] = set()  # blocks waiting for the writer (not stored twice)
        # What was stored and evicted since the engine thread last looked (take_events): by the engine thread itself
        # (host memory) or the writers (disk).
        self._written: deque[TierBlock] = deque()
        self._evicted: deque[TierKey] = deque()
        self._events: list[KVEvent] = []  # drained from the two above, for take_events
        self.index = TierIndex()  # what this process knows the tier holds: the inspector's view (kv/offload/index.py)
        # Disk: the writers' queue holds (hash, key, slot) of payloads copied into the ring, a slab of max_queued_bytes
        # allocated (and touched) once, so that a step's stores allocate nothing; a block that finds no free slot is
        # dropped and counted. A writer hands each slot back once its record is written. Two writers (_write_loop):
        # one that runs only on an idle core, and one that joins it while the ring is more than half full (_behind).
        self._queue: queue.Queue[tuple[TierBlock, int] | None] | None = None
        self._ring: torch.Tensor | None = None
        self._free_slots: list[int] = []
        self._lock = threading.Lock()  # the free slots, and the counters the writers update
        self._behind = threading.Event()
        self._writers: list[threading.Thread] = []
        self._loader: ThreadPoolExecutor | None = None
        self._refresher: threading.Thread | None = None
        self._closing = threading.Event()
        self._at_exit: Callable[[], None] | None = None
        if isinstance(self.store, DiskStore) and not self.store.read_only:
            depth = max(4, config.max_queued_bytes // max(self.layout.block_bytes, 1))
            self._ring = torch.empty(depth, self.layout.block_bytes, dtype=torch.uint8)
            self._free_slots = list(range(depth - 1, -1, -1))
            self._queue = queue.Queue()
            for idle in (True, False):
                name = "kvserve-kv-offload-writer" + ("" if idle else "-catch-up")
                writer = threading.Thread(target=self._write_loop, args=(idle,), name=name, daemon=True)
                writer.start()
                self._writers.append(writer)
            # A program that never closes its engine (LLM(...) then exit) still gets its queued blocks written: the
            # writer is a daemon thread, which exit would otherwise stop mid-queue. A weak reference, so that the
            # hook keeps no engine alive.
            self._at_exit = _close_at_exit(weakref.ref(self))
            atexit.register(self._at_exit)
        if isinstance(self.store, DiskStore):
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-offload-loader")
            # Records other processes write (replicas sharing the directory) join the store's index from this thread:
            # the engine thread's lookups never touch the file system.
            self._refresher = threading.Thread(target=self._refresh_loop, name="kvserve-kv-offload-index", daemon=True)
            self._refresher.start()
        if self.store is not None:
            self._touch_memory(caches)
        self._log_start()

    def _refresh_loop(self) -> None:
        assert isinstance(self.store, DiskStore)
        while not self._closing.wait(REFRESH_SECONDS):
            try:
                self.store.refresh()
            except OSError as e:  # a vanished directory: the next look may find it again
                logger.debug("KV offload: refreshing the index failed (%s)", e)

    def refresh_index(self) -> None:
        """Bring a disk tier's index up to date with its directory now (its thread does it every REFRESH_SECONDS)."""
        if isinstance(self.store, DiskStore):
            self.store.refresh()

    @property
    def is_async(self) -> bool:
        """Whether restores run on a thread of their own (from disk): a request then waits a step for its load."""
        return self._loader is not None

    def _touch_memory(self, caches: Sequence[LayerKVCache]) -> None:
        """Map the pool's K/V memory, the host tier's slab and the disk writer's ring now (kv/cache.py touch_pages):
        restores write into fresh pool blocks and stores into fresh slots, and their pages' first-touch faults would
        otherwise land in requests (a restart's first restore, the tier's first fill). vLLM likewise allocates its KV
        cache zeroed and its host tier pinned, up front."""
        start = time.perf_counter()
        tensors = [t for cache in caches for t in (cache.key, cache.value)]
        tensors += [t for t in (getattr(self.store, "slab", None), self._ring) if t is not None]
        touched = touch_pages(tensors)
        logger.info(
            "KV offload tier: %s of cache and tier memory mapped at start in %.2f s",
            format_bytes(touched),
            time.perf_counter() - start,
        )

    # ---- what it holds ---------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the tier stores blocks now: not when its directory is read-only (read, never written), nor while
        stores are paused after a write error (until the backoff's delay has passed)."""
        return self.store is not None and not self.read_only and not self.backoff.paused()

    @property
    def read_only(self) -> bool:
        """A disk tier this process may not write: restores only (DiskStore.read_only)."""
        return isinstance(self.store, DiskStore) and self.store.read_only

    @property
    def readable(self) -> bool:
        """A tier that failed to write may still be read (a read-only directory of earlier runs)."""
        return self.store is not None

    def lookup(self, keys: Sequence[TierKey]) -> int:
        """How many of `keys`, from the first, the tier holds (its stores answer from memory: no I/O)."""
        store = self.store
        if store is None:
            return 0
        for n, key in enumerate(keys):
            if not store.contains(key):
                return n
        return len(keys)

    def _log_start(self) -> None:
        if self.store is None:
            return
        if self.read_only:
            logger.warning(
                "the KV offload tier at %s is read-only for this process: it restores what earlier runs stored and "
                "stores nothing",
                self.config.path,
            )
        cap = self.config.size_bytes
        blocks = cap // self.layout.block_bytes
        usage = self.store.usage()
        where = "host memory" if self.config.path is None else f"disk at {self.store.dir}"  # type: ignore[union-attr]
        logger.info(
            "KV offload tier in %s: %s (%d blocks x %d tokens = %d tokens, %s a block); holds %d blocks (%s)",
            where,
            format_bytes(cap),
            blocks,
            self.block_size,
            blocks * self.block_size,
            format_bytes(self.layout.block_bytes),
            usage.num_blocks,
            format_bytes(usage.bytes_used),
        )

    # ---- stores ----------------------------------------------------------------------------------------

    def prepare_store(self, blocks: Sequence[TierBlock]) -> None:
        """Engine thread, after the step that computed `blocks`: copy those not yet in the tier out of the cache (one
        batched gather) and keep them (host memory) or copy them into the writers' ring (disk; a block that finds the
        ring full is dropped and counted). Each (group, hash) is stored once, however often a step publishes it."""
        if not self.available or self.store is None:
            return
        todo: dict[TierKey, TierBlock] = {}
        for b in blocks:
            key = tier_key(b)
            if self.store.contains(key):
                self._index(b)  # stored already (by an earlier run, another replica): known now
            elif key not in self._queued:
                todo.setdefault(key, b)
        if not todo:
            return
        if isinstance(self.store, HostMemoryStore):
            fits = list(todo.values())[-self.store.capacity_blocks :] if self.store.capacity_blocks else []
            slots, evicted = self.store.reserve([(tier_key(b), b.key) for b in fits])
            self.layout.gather_into([b.block_id for b in fits], self.store.slab, slots)
            with self._lock:  # stats() reads the counters from other threads
                self.dropped_blocks += len(todo) - len(fits)  # more than the whole tier holds: the last ones are kept
                self.stored_blocks += len(fits)
            self._written.extend(fits)
            self._evicted.extend(evicted)
            return
        assert self._queue is not None and self._ring is not None
        with self._lock:
            slots = [self._free_slots.pop() for _ in range(min(len(todo), len(self._free_slots)))]
            self.dropped_blocks += len(todo) - len(slots)  # the writers are that far behind: dropped, never waited for
        kept = list(todo.values())[: len(slots)]
        self.layout.gather_into([b.block_id for b in kept], self._ring, slots)
        for block, slot in zip(kept, slots):
            self._queued.add(tier_key(block))
            self._queue.put_nowait((block, slot))
        if len(self._free_slots) < len(self._ring) // 2:
            self._behind.set()

    def _write_loop(self, idle: bool) -> None:
        """A disk writer: records out of the queue into files, until close() queues None. The idle writer runs
        SCHED_IDLE, taking a core only when nothing else wants one, so it never preempts one of the engine's compute
        threads mid-step, which stalls the whole parallel step (on the no-reuse benchmark, where every block is written
        and none read: 0.93x tier-off with one writer at nice 10, 0.98-1.01x so). The catch-up writer, at nice 10,
        takes records only while the ring is more than half full, so that under steps that leave no core idle the
        tier still writes most blocks (the no-reuse benchmark's saturated batch, the worst case, dropped up to 10%)
        rather than few. Two threads, not one changing its policy: an unprivileged thread cannot leave SCHED_IDLE. A
        write error pauses stores and they are retried with backoff (_write_one); reads go on meanwhile."""
        assert self._queue is not None and self._ring is not None and isinstance(self.store, DiskStore)
        _set_writer_priority(idle)
        half = len(self._ring) // 2
        while True:
            if not idle:
                self._behind.wait()
            item = self._queue.get()
            if item is None:
                return
            block, slot = item
            try:
                self._write_one(block, slot)
            finally:
                with self._lock:
                    self._free_slots.append(slot)
                    if not idle and len(self._free_slots) > half:
                        self._behind.clear()
                self._queued.discard(tier_key(block))

    def _write_one(self, block: TierBlock, slot: int) -> None:
        """A writer: store one queued block, unless stores are paused (then it is dropped). What can go wrong costs as
        little as it must: a block no record can hold, or whose shard is an entry planted at its name (UnsafeEntry),
        is dropped and counted alone (the path logged once); any other OSError (a full disk, a vanished directory)
        pauses every store for the backoff's delay, and the first write that succeeds after it turns them on again."""
        assert isinstance(self.store, DiskStore) and self._ring is not None
        if self.backoff.paused():
            with self._lock:
                self.dropped_blocks += 1
            return
        try:
            written, evicted = self.store.write(tier_key(block), block.key, self._ring[slot])
        except RecordError as e:  # a block no record can hold (a cache salt past MAX_IDENTITY_BYTES): not stored
            with self._lock:
                self.dropped_blocks += 1
            logger.debug("KV offload: block %s not stored (%s)", block.block_hash.hex()[:16], e)
            return
        except UnsafeEntry as e:
            with self._lock:
                self.io_errors += 1
                self.dropped_blocks += 1
                first = str(e.filename) not in self._unsafe_logged
                self._unsafe_logged.add(str(e.filename))
            if first:
                logger.warning("KV offload: %s; blocks of that shard are not stored", e)
            return
        except OSError as e:
            with self._lock:
                self.io_errors += 1
                self.dropped_blocks += 1
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
        with self._lock:
            self.stored_blocks += int(written)
            recovered, self.error = self.error, None
            self.backoff.succeeded()
        if recovered is not None:
            logger.info("the KV offload tier stores blocks again (after %s)", recovered)
        if written:
            self._written.append(block)
        self._evicted.extend(evicted)

    def take_events(self) -> list[KVEvent]:
        """Engine thread: what was stored and evicted since the last call, as KV events with the tier's medium (block
        id -1: no pool block is meant)."""
        self._drain()
        events, self._events = self._events, []
        return events

    def _drain(self) -> None:
        """Engine thread: turn what was stored and evicted (by this thread or the writers) into events for
        take_events, and into the inspector's index (records of other processes become known when this process
        stores or restores them)."""
        while self._written:
            block = self._written.popleft()
            self._index(block)
            parent = block.key.parent.hex() if block.key.parent is not None else None
            tokens = block.key.token_ids
            self._events.append(
                BlockStored(
                    -1, block.block_hash.hex(), parent, tokens, len(tokens), self.medium, group_idx=block.group_id
                )
            )
        while self._evicted:
            group_id, block_hash = self._evicted.popleft()
            if group_id == 0:
                self.index.remove(block_hash)
            self._events.append(BlockRemoved(-1, block_hash.hex(), self.medium, group_idx=group_id))

    def _index(self, block: TierBlock) -> None:
        """The inspector's index of prefixes holds the first group's blocks (a full-attention group's, where the
        model has one: each prefix's whole chain)."""
        if block.group_id == 0:
            self.index.add(block.block_hash, block.key)

    # ---- restores --------------------------------------------------------------------------------------

    def prepare_load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> Future[int]:
        """Copy `blocks` from the tier into their pool blocks, in order, stopping at the first that fails a check or
        is gone; the future's result is how many were restored (a prefix of `blocks`). From host memory the copy runs
        here and the future is done on return; from disk it runs on the loader thread."""
        if self._loader is None:
            future: Future[int] = Future()
            future.set_result(self._load(blocks, cancelled))
            return future
        return self._loader.submit(self._load, blocks, cancelled)

    def _load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> int:
        """Find (host memory) or read and check (disk) the blocks in order up to the first that fails, and copy the
        good ones into their pool blocks (a disk record read in place is there already; the others in one batched
        scatter); returns how many were restored."""
        start = time.perf_counter()
        store = self.store
        found: list[int] = []  # host memory: slab slots
        # Disk: records are read straight into their blocks' slices of the cache where the payload is the cache's own
        # bytes (BlockLayout.reads_in_place), else into staging rows, then scattered (dequantized) into the blocks.
        in_place = self.layout.reads_in_place
        staging = None if in_place or isinstance(store, HostMemoryStore) else self.layout.load_buffer(len(blocks))
        read = staged = 0  # disk: checked records, and how many of them are in staging's first rows
        for block in blocks:
            if cancelled.is_set() or store is None:
                break
            try:
                if isinstance(store, HostMemoryStore):
                    found.append(store.locate(tier_key(block), block.key))
                    continue
                if in_place:
                    store.read_into(tier_key(block), block.key, self.layout.block_views(block.block_id))
                else:
                    assert staging is not None
                    store.read_into(tier_key(block), block.key, [staging[read].numpy().data])
                    staged += 1
                read += 1
            except (RecordError, KeyError) as e:
                with self._lock:
                    self.restore_failures += 1
                logger.info("KV offload: block %s not restored (%s); it is recomputed", block.block_hash.hex()[:16], e)
                break
            except OSError as e:
                with self._lock:
                    self.io_errors += 1
                logger.warning(
                    "KV offload: reading block %s failed (%s); it is recomputed", block.block_hash.hex()[:16], e
                )
                break
            except Exception as e:  # noqa: BLE001 -- one entry's surprise (MemoryError, ...) costs that block alone
                with self._lock:
                    self.restore_failures += 1
                logger.warning(
                    "KV offload: block %s not restored (%s: %s); it is recomputed",
                    block.block_hash.hex()[:16],
                    type(e).__name__,
                    e,
                )
                break
        done = len(found) + read
        if cancelled.is_set():
            done = 0
        elif found:
            assert isinstance(store, HostMemoryStore)
            self.layout.scatter([b.block_id for b in blocks[:done]], store.slab, found)
        elif staged:
            assert staging is not None
            self.layout.scatter([b.block_id for b in blocks[:done]], staging[:staged])
        seconds = time.perf_counter() - start
        with self._lock:
            self.restored_blocks += done
            self.restore_seconds_total += seconds
            self.restores += 1
        return done

    def complete_load(self, blocks: Sequence[TierBlock]) -> None:
        """Engine thread: the restored blocks are in the pool; the inspector's index knows them now."""
        for block in blocks:
            self._index(block)

    @property
    def seconds_per_restored_block(self) -> float | None:
        """The mean restore cost per block so far (None before the first), for the restore cost model."""
        with self._lock:
            return self.restore_seconds_total / self.restored_blocks if self.restored_blocks else None

    # ---- the rest --------------------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        """The counters as one consistent snapshot (taken under the lock the threads write them under)."""
        usage = self.store.usage() if self.store is not None else None
        # Records the disk store's scans refused count as failed checks too (a planted or damaged file).
        refused = self.store.refused_records if isinstance(self.store, DiskStore) else 0
        with self._lock:
            return OffloadStats(
                medium=self.medium,
                available=self.available,
                capacity_bytes=self.config.size_bytes,
                bytes_used=usage.bytes_used if usage else 0,
                num_blocks=usage.num_blocks if usage else 0,
                block_bytes=self.layout.block_bytes,
                stored_blocks=self.stored_blocks,
                dropped_blocks=self.dropped_blocks,
                restored_blocks=self.restored_blocks,
                restore_failures=self.restore_failures + refused,
                io_errors=self.io_errors,
                restore_seconds_total=self.restore_seconds_total,
                restores=self.restores,
            )

    def view(self, in_pool: Callable[[bytes], bool], include_tokens: bool, limit: int = 64) -> dict[str, Any]:
        """The KV inspector's view of the tier (engine thread): what it holds, and which prefixes as far as this
        process knows them (TierIndex)."""
        self._drain()
        stats = self.stats()
        return {
            "medium": stats.medium,
            "available": stats.available,
            "num_blocks": stats.num_blocks,
            "bytes_used": stats.bytes_used,
            "capacity_bytes": stats.capacity_bytes,
            "indexed_blocks": len(self.index),
            "prefixes": self.index.prefixes(self.block_size, in_pool, limit, include_tokens),
        }

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the writer has written what is queued (tests, and a clean shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queued and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        self._closing.set()
        if self._refresher is not None:
            self._refresher.join(timeout=5)
            self._refresher = None
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._queue is not None and self._writers:
            self.flush()
            for _ in self._writers:
                self._queue.put(None)
            self._behind.set()  # the catch-up writer waits for it before it reads the queue
            for writer in self._writers:
                writer.join(timeout=30)
            self._writers = []
            self._queue = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if isinstance(self.store, DiskStore):
            self.store.close()


def _close_at_exit(tier: weakref.ref[OffloadTier]) -> Callable[[], None]:
    def close() -> None:
        live = tier()
        if live is not None:
            live.close()

    return close


def _set_writer_priority(idle: bool) -> None:
    """This thread's scheduling, for a disk writer (see OffloadTier._write_loop): SCHED_IDLE (where it is refused,
    nice 19), or nice 10. Linux, where a thread has its own; elsewhere the thread runs as it is."""
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
