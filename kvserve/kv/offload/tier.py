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
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.kv.block import TierBlock
from kvserve.kv.cache import LayerKVCache
from kvserve.kv.events import BlockRemoved, BlockStored, KVEventBuffer
from kvserve.kv.hashing import BlockKey
from kvserve.kv.offload.config import KVOffloadConfig
from kvserve.kv.offload.fingerprint import KVFingerprint
from kvserve.kv.offload.record import RecordError
from kvserve.kv.offload.stores import DiskStore, HostMemoryStore
from kvserve.kv.quant import KV_QUANT_FORMATS, compute_scales, dequantize, quantize
from kvserve.units import format_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """The tier at one moment, for metrics, `kvserve doctor` and the inspector."""

    medium: str  # "CPU" (host memory) or "DISK"
    available: bool  # False: the tier failed (an unwritable or full directory) and stores nothing more
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


class BlockLayout:
    """How one block's K/V (and 8-bit scales) across every layer is laid out as one flat payload of bytes: each
    layer's key, value, key scales, value scales in turn, each that tensor's [block_size, ...] slice of the block.

    `compress` (--kv-offloading-dtype int8, for a cache that is not 8-bit already): each K and V slice is stored as
    int8 with a float32 scale per token and KV head (kv/quant.py's int8 format, as --kv-cache-dtype int8 stores it),
    about 4x fewer bytes than float32; a restore dequantizes into the cache's dtype, so it is close, not bit-exact."""

    def __init__(self, caches: Sequence[LayerKVCache], compress: bool = False) -> None:
        tensors: list[torch.Tensor] = []
        for cache in caches:
            tensors += [cache.key, cache.value]
            if cache.key_scale is not None and cache.value_scale is not None:
                tensors += [cache.key_scale, cache.value_scale]
        self.tensors = tensors
        self.compress = compress and not any(c.is_quantized for c in caches)
        self.format = KV_QUANT_FORMATS["int8"]
        # Compressed: per slice, its int8 values (one byte each) then a float32 scale per token and head.
        self.sizes = [
            t[0].numel() + 4 * t[0].numel() // t.shape[-1] if self.compress else t[0].numel() * t.element_size()
            for t in tensors
        ]
        self.block_bytes = sum(self.sizes)

    def gather(self, block_id: int) -> torch.Tensor:
        """A copy of the block as a uint8 tensor of block_bytes (on the host)."""
        if not self.compress:
            return torch.cat([_bytes_of(t[block_id]).cpu() for t in self.tensors])
        parts = []
        for t in self.tensors:
            x = t[block_id].float().cpu()
            scale = compute_scales(x, self.format)
            parts += [_bytes_of(quantize(x, scale, self.format)), _bytes_of(scale.contiguous())]
        return torch.cat(parts)

    def scatter(self, block_id: int, payload: torch.Tensor) -> None:
        """Write a payload of block_bytes into the block."""
        if payload.numel() != self.block_bytes:
            raise RecordError(f"payload of {payload.numel()} bytes, a block holds {self.block_bytes}")
        offset = 0
        for t, size in zip(self.tensors, self.sizes):
            part = payload[offset : offset + size]
            if self.compress:
                target = t[block_id]
                values = target.numel()
                q = part[:values].view(torch.int8).view(target.shape)
                scale = part[values:].view(torch.float32).view(*target.shape[:-1], 1)
                target.copy_(dequantize(q, scale, target.dtype))
            else:
                _bytes_of(t[block_id]).copy_(part)
            offset += size


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


class RestoreCostModel:
    """Whether restoring n blocks is cheaper than recomputing their tokens: measured rates, not guesses. Restoring
    costs n times the measured seconds per restored block, plus, from disk, the step the request waits through for
    its load; recomputing costs n x block_size tokens at the measured prefill seconds per token. Until both are
    measured, restore (a restore from memory copies bytes: it is cheaper than a forward pass on any model)."""

    def __init__(self, block_size: int, is_async: bool) -> None:
        self.block_size = block_size
        self.is_async = is_async
        self.restore_s_per_block: float | None = None
        self.prefill_s_per_token: float | None = None
        self.step_s: float | None = None

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.8 * old + 0.2 * new

    def observe_restore(self, num_blocks: int, seconds: float) -> None:
        if num_blocks:
            self.restore_s_per_block = self._ema(self.restore_s_per_block, seconds / num_blocks)

    def observe_step(self, num_prompt_tokens: int, seconds: float) -> None:
        """A finished step: its prompt tokens (only steps mostly of prefill measure the prefill rate)."""
        self.step_s = self._ema(self.step_s, seconds)
        if num_prompt_tokens >= 64:
            self.prefill_s_per_token = self._ema(self.prefill_s_per_token, seconds / num_prompt_tokens)

    def worth_restoring(self, num_blocks: int) -> bool:
        if self.restore_s_per_block is None or self.prefill_s_per_token is None:
            return True
        restore = num_blocks * self.restore_s_per_block + (self.step_s or 0.0 if self.is_async else 0.0)
        return restore < num_blocks * self.block_size * self.prefill_s_per_token


class OffloadTier:
    """The tier under one engine's pool. Engine-thread methods: contains, store, load, stats, close."""

    def __init__(
        self,
        config: KVOffloadConfig,
        fingerprint: KVFingerprint,
        caches: Sequence[LayerKVCache],
        block_size: int,
        events: KVEventBuffer | None = None,
    ) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.layout = BlockLayout(caches, compress=config.dtype == "int8")
        self.block_size = block_size
        self.events = events
        self.medium = config.medium
        self.store: HostMemoryStore | DiskStore | None
        self.error: str | None = None
        if config.path is None:
            self.store = HostMemoryStore(config.size_bytes)
        else:
            try:
                self.store = DiskStore(config.path, fingerprint, config.size_bytes)
            except OSError as e:
                self.store, self.error = None, f"{type(e).__name__}: {e}"
                logger.error(
                    "the KV offload tier at %s cannot be used (%s): serving without it", config.path, self.error
                )
        self.cost = RestoreCostModel(block_size, is_async=isinstance(self.store, DiskStore))
        self.stored_blocks = self.dropped_blocks = self.restored_blocks = 0
        self.restore_failures = self.io_errors = self.restores = 0
        self.restore_seconds_total = 0.0
        self._queued: set[bytes] = set()  # hashes waiting for the writer (not stored twice)
        # What the writer thread stored and evicted since the engine thread last looked (poll_events).
        self._written: deque[TierBlock] = deque()
        self._evicted: deque[bytes] = deque()
        self._queue: queue.Queue[tuple[bytes, BlockKey, torch.Tensor] | None] | None = None
        self._writer: threading.Thread | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._at_exit: Callable[[], None] | None = None
        if isinstance(self.store, DiskStore):
            depth = max(4, config.max_queued_bytes // max(self.layout.block_bytes, 1))
            self._queue = queue.Queue(maxsize=depth)
            self._writer = threading.Thread(target=self._write_loop, name="kvserve-kv-offload-writer", daemon=True)
            self._writer.start()
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-offload-loader")
            # A program that never closes its engine (LLM(...) then exit) still gets its queued blocks written: the
            # writer is a daemon thread, which exit would otherwise stop mid-queue. A weak reference, so that the
            # hook keeps no engine alive.
            self._at_exit = _close_at_exit(weakref.ref(self))
            atexit.register(self._at_exit)
        self._log_start()

    # ---- what it holds ---------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.store is not None and self.error is None

    @property
    def readable(self) -> bool:
        """A tier that failed to write may still be read (a read-only directory of earlier runs)."""
        return self.store is not None

    def contains(self, block_hash: bytes) -> bool:
        return self.store is not None and self.store.contains(block_hash)

    def _log_start(self) -> None:
        if self.store is None:
            return
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

    def store_blocks(self, blocks: Sequence[TierBlock]) -> None:
        """Engine thread, after the step that computed `blocks`: copy each one not yet in the tier out of the cache and
        keep it (host memory) or queue it for the writer (disk; dropped and counted when the queue is full)."""
        if not self.available or self.store is None:
            return
        for block in blocks:
            if block.block_hash in self._queued or self.store.contains(block.block_hash):
                continue
            payload = self.layout.gather(block.block_id)
            if isinstance(self.store, HostMemoryStore):
                stored, evicted = self.store.write(block.block_hash, block.key, payload)
                if stored:
                    self.stored_blocks += 1
                    self._stored_event(block)
                else:
                    self.dropped_blocks += 1
                self._removed_events(evicted)
                continue
            assert self._queue is not None
            try:
                self._queue.put_nowait((block.block_hash, block.key, payload))
                self._queued.add(block.block_hash)
            except queue.Full:
                self.dropped_blocks += 1

    def _write_loop(self) -> None:
        """The disk writer: records out of the queue into files, until close() queues None. The first OSError (a full
        disk, a read-only or vanished directory) turns the tier's stores off, logged once; reads go on."""
        assert self._queue is not None and isinstance(self.store, DiskStore)
        while True:
            item = self._queue.get()
            if item is None:
                return
            block_hash, key, payload = item
            try:
                if self.error is None:
                    written, evicted = self.store.write(block_hash, key, payload)
                    if written:
                        self.stored_blocks += 1
                        self._written.append(TierBlock(-1, block_hash, key))
                    self._evicted.extend(evicted)
                else:
                    self.dropped_blocks += 1
            except OSError as e:
                self.io_errors += 1
                self.dropped_blocks += 1
                if self.error is None:
                    self.error = f"{type(e).__name__}: {e}"
                    logger.error(
                        "the KV offload tier stops storing blocks (%s); requests are served as without it", self.error
                    )
            finally:
                self._queued.discard(block_hash)

    def poll_events(self) -> None:
        """Engine thread: publish the writer's stores and evictions as KV events (the buffer is the engine thread's)."""
        while self._written:
            self._stored_event(self._written.popleft())
        evicted = []
        while self._evicted:
            evicted.append(self._evicted.popleft())
        self._removed_events(evicted)

    def _stored_event(self, block: TierBlock) -> None:
        if self.events is not None:
            parent = block.key.parent.hex() if block.key.parent is not None else None
            tokens = block.key.token_ids
            self.events.append(BlockStored(-1, block.block_hash.hex(), parent, tokens, len(tokens), self.medium))

    def _removed_events(self, hashes: list[bytes]) -> None:
        if self.events is not None:
            for block_hash in hashes:
                self.events.append(BlockRemoved(-1, block_hash.hex(), self.medium))

    # ---- restores --------------------------------------------------------------------------------------

    def load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> Future[int]:
        """Copy `blocks` from the tier into their pool blocks, in order, stopping at the first that fails a check or
        is gone; the future's result is how many were restored (a prefix of `blocks`). From host memory the copy runs
        here and the future is done on return; from disk it runs on the loader thread."""
        if self._loader is None:
            future: Future[int] = Future()
            future.set_result(self._load(blocks, cancelled))
            return future
        return self._loader.submit(self._load, blocks, cancelled)

    def _load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> int:
        start = time.perf_counter()
        done = 0
        store = self.store
        for block in blocks:
            if cancelled.is_set() or store is None:
                break
            try:
                payload = store.read(block.block_hash, block.key)
                self.layout.scatter(block.block_id, payload)
            except (RecordError, KeyError) as e:
                self.restore_failures += 1
                logger.info("KV offload: block %s not restored (%s); it is recomputed", block.block_hash.hex()[:16], e)
                break
            except OSError as e:
                self.io_errors += 1
                logger.warning(
                    "KV offload: reading block %s failed (%s); it is recomputed", block.block_hash.hex()[:16], e
                )
                break
            done += 1
        seconds = time.perf_counter() - start
        self.cost.observe_restore(done, seconds)
        self.restored_blocks += done
        self.restore_seconds_total += seconds
        self.restores += 1
        return done

    # ---- the rest --------------------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        usage = self.store.usage() if self.store is not None else None
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
            restore_failures=self.restore_failures,
            io_errors=self.io_errors,
            restore_seconds_total=self.restore_seconds_total,
            restores=self.restores,
        )

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the writer has written what is queued (tests, and a clean shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queued and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._queue is not None and self._writer is not None:
            self.flush()
            self._queue.put(None)
            self._writer.join(timeout=30)
            self._queue = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None


def _close_at_exit(tier: weakref.ref[OffloadTier]) -> Callable[[], None]:
    def close() -> None:
        live = tier()
        if live is not None:
            live.close()

    return close
