"""OffloadTier: the engine's side of the tier. It copies full blocks out of the KV cache after the step that computed
them (write-through), finds which of a prompt's next blocks the tier holds, and copies them back into fresh pool
blocks (a restore), through a backend (kv/offload/backend.py): host memory inline (host_tier.py), a directory on its
own threads (disk_tier.py), so that the engine step never waits on a file.

Why write-through rather than store-on-evict: the pool evicts inside allocate() and the block's new owner overwrites
it in the same step, so there is no moment at which an evicted block could still be copied. A block is therefore
copied once it is full and hashed; eviction only drops the pool's copy (vLLM's OffloadingConnector stores the same
way). The copy out of the cache is a memory copy on the engine thread (about 0.1 ms for one of Gemma 3 270M's
576 KiB blocks); everything slower (encoding, checksums, files) runs on the disk backend's writer threads behind a
bounded ring, and a block that finds the ring full is dropped and counted, never waited for."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvserve.kv.block import TierBlock
from kvserve.kv.cache import LayerKVCache, touch_pages, unique_tensors
from kvserve.kv.events import BlockRemoved, BlockStored, KVEvent
from kvserve.kv.offload.backend import TierBackend, TierCounters, done_future
from kvserve.kv.offload.config import KVOffloadConfig
from kvserve.kv.offload.disk_tier import DiskTier, StoreBackoff
from kvserve.kv.offload.fingerprint import KVFingerprint
from kvserve.kv.offload.host_tier import HostTier
from kvserve.kv.offload.index import TierIndex
from kvserve.kv.offload.interface import BlockStore, TierKey, tier_key
from kvserve.kv.offload.layout import BlockLayout, RowCopy
from kvserve.units import format_bytes

logger = logging.getLogger(__name__)


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
    lookup, prepare_load, complete_load, prepare_store, take_events, stats, view and close. It decides what is stored
    (each (group, hash) once) and keeps the events, the inspector's index and the counters; its backend (TierBackend)
    moves the bytes, and the tier never asks which backend it has.

    A block is one pool block's bytes (BlockLayout over the cache's distinct tensors: with KV cache groups, the layers
    of one group), keyed by its group and hash, so a restore brings each group only the blocks it needs."""

    def __init__(
        self,
        config: KVOffloadConfig,
        fingerprint: KVFingerprint,
        layout: BlockLayout,
        block_size: int,
        snapshots: bool = False,
    ) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.medium = config.medium
        # What a record holds: a pool block's K/V, or (a state tier, beside a hybrid model's KV tier) one state
        # snapshot of every state layer, keyed by the block it ends at (kv/state.py).
        self.snapshots = snapshots
        self.counters = TierCounters()
        self.backoff = StoreBackoff()  # a disk backend's pauses after write errors (always clear in memory)
        self._init_error: str | None = None  # why the tier is unusable (its directory could not be used)
        self.layout = layout
        if config.size_bytes < self.layout.block_bytes:
            what = "state snapshot" if snapshots else f"block ({block_size} tokens)"
            raise ValueError(
                f"--kv-offloading-size {format_bytes(config.size_bytes)} holds no {what}: one takes "
                f"{format_bytes(self.layout.block_bytes)}; pass a size of many blocks, e.g. "
                f"{format_bytes(1000 * self.layout.block_bytes, '.0f').replace(' ', '')}"
            )
        self.backend: TierBackend | None = None
        if config.path is None:
            self.backend = HostTier(config.size_bytes, self.layout, self.counters)
        else:
            try:
                self.backend = DiskTier(config, fingerprint, self.layout, self.counters, self.backoff)
            except OSError as e:
                self._init_error = f"{type(e).__name__}: {e}"
                logger.error(
                    "the KV offload tier at %s cannot be used (%s): serving without it", config.path, self._init_error
                )
        self._events: list[KVEvent] = []  # drained from the counters' written and evicted, for take_events
        self.index = TierIndex()  # what this process knows the tier holds: the inspector's view (kv/offload/index.py)
        if self.backend is not None:
            self._touch_memory(self.backend)
        self._log_start()

    @classmethod
    def for_kv_caches(
        cls,
        config: KVOffloadConfig,
        fingerprint: KVFingerprint,
        caches: Sequence[LayerKVCache],
        block_size: int,
        copy_rows: RowCopy | None = None,
    ) -> OffloadTier:
        """The tier of a pool's blocks: a record is one block of every layer of its KV cache group."""
        layout = BlockLayout(unique_tensors(caches), compress=config.dtype == "int8", copy_rows=copy_rows)
        return cls(config, fingerprint, layout, block_size)

    @property
    def store(self) -> BlockStore | None:
        """Where the blocks live (None: the tier could not be used)."""
        return self.backend.store if self.backend is not None else None

    @property
    def error(self) -> str | None:
        """Why the tier is unusable, or why its stores are paused (the last write error)."""
        return self._init_error or (self.backend.error if self.backend is not None else None)

    def refresh_index(self) -> None:
        """Bring a disk tier's index up to date with its directory now (its thread does it every REFRESH_SECONDS)."""
        if self.backend is not None:
            self.backend.refresh()

    @property
    def is_async(self) -> bool:
        """Whether restores run on a thread of their own (from disk): a request then waits a step for its load."""
        return self.backend is not None and self.backend.is_async

    def _touch_memory(self, backend: TierBackend) -> None:
        """Map the pool's K/V memory and the backend's buffers (the host tier's slab, the disk writers' ring) now
        (kv/cache.py touch_pages): restores write into fresh pool blocks and stores into fresh slots, and their pages'
        first-touch faults would otherwise land in requests (a restart's first restore, the tier's first fill). vLLM
        likewise allocates its KV cache zeroed and its host tier pinned, up front."""
        start = time.perf_counter()
        tensors = [*self.layout.tensors, *backend.memory()]
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
        return self.backend is not None and not self.backend.read_only and not self.backoff.paused()

    @property
    def read_only(self) -> bool:
        """A disk tier this process may not write: restores only (DiskStore.read_only)."""
        return self.backend is not None and self.backend.read_only

    @property
    def readable(self) -> bool:
        """A tier that failed to write may still be read (a read-only directory of earlier runs)."""
        return self.backend is not None

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
        if self.backend is None:
            return
        if self.read_only:
            logger.warning(
                "the KV offload tier at %s is read-only for this process: it restores what earlier runs stored and "
                "stores nothing",
                self.config.path,
            )
        cap = self.config.size_bytes
        blocks = cap // self.layout.block_bytes
        usage = self.backend.store.usage()
        if self.snapshots:
            logger.info(
                "KV offload tier's state snapshots in %s: %s (%d snapshots, %s each); holds %d (%s)",
                self.backend.where(),
                format_bytes(cap),
                blocks,
                format_bytes(self.layout.block_bytes),
                usage.num_blocks,
                format_bytes(usage.bytes_used),
            )
            return
        logger.info(
            "KV offload tier in %s: %s (%d blocks x %d tokens = %d tokens, %s a block); holds %d blocks (%s)",
            self.backend.where(),
            format_bytes(cap),
            blocks,
            self.block_size,
            blocks * self.block_size,
            format_bytes(self.layout.block_bytes),
            usage.num_blocks,
            format_bytes(usage.bytes_used),
        )

    # ---- stores ----------------------------------------------------------------------------------------

    @property
    def retains(self) -> bool:
        """Whether `retain` keeps blocks (a disk tier this process writes)."""
        return self.backend is not None and self.backend.retains and not self.backend.read_only

    def retain(self, keys: Sequence[TierKey], until: float) -> None:
        """Engine thread: keep these blocks past eviction until `until` (time.time()); the backend applies it on its
        own threads (OpenAI's prompt_cache_retention)."""
        if self.retains and self.backend is not None:
            self.backend.retain(keys, until)

    def prepare_store(self, blocks: Sequence[TierBlock]) -> None:
        """Engine thread, after the step that computed `blocks`: hand the backend those not yet in the tier nor on
        their way (it copies them out of the cache in one batched gather, into host memory or the disk writers' ring).
        Each (group, hash) is stored once, however often a step publishes it."""
        backend = self.backend
        if backend is None or not self.available:
            return
        todo: dict[TierKey, TierBlock] = {}
        for b in blocks:
            key = tier_key(b)
            if backend.store.contains(key):
                self._index(b)  # stored already (by an earlier run, another replica): known now
            elif not backend.queued(key):
                todo.setdefault(key, b)
        if todo:
            backend.put(list(todo.values()))

    def take_events(self) -> list[KVEvent]:
        """Engine thread: what was stored and evicted since the last call, as KV events with the tier's medium (block
        id -1: no pool block is meant)."""
        self._drain()
        events, self._events = self._events, []
        return events

    def _drain(self) -> None:
        """Engine thread: turn what was stored and evicted (by this thread or the backend's) into events for
        take_events, and into the inspector's index (records of other processes become known when this process
        stores or restores them)."""
        written, evicted = self.counters.written, self.counters.evicted
        while written:
            block = written.popleft()
            self._index(block)
            parent = block.key.parent.hex() if block.key.parent is not None else None
            tokens = block.key.token_ids
            self._events.append(
                BlockStored(
                    -1, block.block_hash.hex(), parent, tokens, len(tokens), self.medium, group_idx=block.group_id
                )
            )
        while evicted:
            group_id, block_hash = evicted.popleft()
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
        if self.backend is None:
            return done_future(0)
        return self.backend.load(blocks, cancelled)

    def complete_load(self, blocks: Sequence[TierBlock]) -> None:
        """Engine thread: the restored blocks are in the pool; the inspector's index knows them now."""
        for block in blocks:
            self._index(block)

    @property
    def seconds_per_restored_block(self) -> float | None:
        """The mean restore cost per block so far (None before the first), for the restore cost model."""
        c = self.counters
        with c.lock:
            return c.restore_seconds_total / c.restored_blocks if c.restored_blocks else None

    # The counters, as attributes of the tier (tests and the bench read them; stats() is the consistent snapshot).
    stored_blocks = property(lambda self: self.counters.stored_blocks)
    dropped_blocks = property(lambda self: self.counters.dropped_blocks)
    restored_blocks = property(lambda self: self.counters.restored_blocks)
    restore_failures = property(lambda self: self.counters.restore_failures)
    io_errors = property(lambda self: self.counters.io_errors)
    restores = property(lambda self: self.counters.restores)

    # ---- the rest --------------------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        """The counters as one consistent snapshot (taken under the lock the threads write them under)."""
        backend = self.backend
        usage = backend.store.usage() if backend is not None else None
        # Records the disk store's scans refused count as failed checks too (a planted or damaged file).
        refused = backend.refused_records() if backend is not None else 0
        c = self.counters
        with c.lock:
            return OffloadStats(
                medium=self.medium,
                available=self.available,
                capacity_bytes=self.config.size_bytes,
                bytes_used=usage.bytes_used if usage else 0,
                num_blocks=usage.num_blocks if usage else 0,
                block_bytes=self.layout.block_bytes,
                stored_blocks=c.stored_blocks,
                dropped_blocks=c.dropped_blocks,
                restored_blocks=c.restored_blocks,
                restore_failures=c.restore_failures + refused,
                io_errors=c.io_errors,
                restore_seconds_total=c.restore_seconds_total,
                restores=c.restores,
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
        """Wait until what is queued is stored (tests, and a clean shutdown)."""
        if self.backend is not None:
            self.backend.flush(timeout)

    def close(self) -> None:
        """Store what is queued, then stop the backend's threads."""
        if self.backend is not None:
            self.backend.close()
