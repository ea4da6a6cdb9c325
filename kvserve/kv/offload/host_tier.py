"""HostTier: a tier in this process's memory (the TierBackend of kv/offload/backend.py). Stores and restores are
memory copies on the engine thread between steps (one batched call for all of a step's blocks, kv/offload/layout.py),
so a restore is done when it is asked for."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from kvserve.kv.block import TierBlock
from kvserve.kv.offload.backend import TierCounters, done_future, restore_in_order
from kvserve.kv.offload.interface import TierKey, tier_key
from kvserve.kv.offload.layout import BlockLayout
from kvserve.kv.offload.stores import HostMemoryStore


class HostTier:
    is_async = False
    read_only = False
    retains = False  # a process's memory outlives no restart: prompt_cache_retention needs a disk tier
    error: str | None = None  # memory copies do not fail

    def __init__(self, size_bytes: int, layout: BlockLayout, counters: TierCounters) -> None:
        self.store = HostMemoryStore(size_bytes, layout.block_bytes)
        self.layout = layout
        self.counters = counters

    def queued(self, key: TierKey) -> bool:
        return False  # stored at once

    def put(self, blocks: Sequence[TierBlock]) -> None:
        """Into slab slots, least recently used evicted first; more blocks than the whole tier holds: the last kept."""
        store = self.store
        fits = list(blocks)[-store.capacity_blocks :] if store.capacity_blocks else []
        slots, evicted = store.reserve([(tier_key(b), b.key) for b in fits])
        self.layout.gather_into([b.block_id for b in fits], store.slab, slots)
        self.counters.add(dropped_blocks=len(blocks) - len(fits), stored_blocks=len(fits))
        self.counters.written.extend(fits)
        self.counters.evicted.extend(evicted)

    def load(self, blocks: Sequence[TierBlock], cancelled: threading.Event) -> Future[int]:
        """Find each block's slot, then copy all of them into their pool blocks in one scatter: done on return."""
        slots: list[int] = []

        def finish(n: int) -> None:
            self.layout.scatter([b.block_id for b in blocks[:n]], self.store.slab, slots[:n])

        fetch = lambda block: slots.append(self.store.locate(tier_key(block), block.key))  # noqa: E731
        return done_future(restore_in_order(blocks, cancelled, fetch, finish, self.counters))

    def retain(self, keys: Sequence[TierKey], until: float) -> None:
        """Nothing: the server refuses prompt_cache_retention without a disk tier."""

    def memory(self) -> list[torch.Tensor]:
        return [self.store.slab]

    def where(self) -> str:
        return "host memory"

    def refused_records(self) -> int:
        return 0

    def refresh(self) -> None:
        pass

    def flush(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass
