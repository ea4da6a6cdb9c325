"""The reader's side of kvserve's KV events (docs/KV_EVENTS.md), as an external router written against vLLM
declares it: msgspec structs shaped like vLLM's event batches, the index a router builds by replaying them,
and a client of the replay socket. Shared by the single-engine and the replica-set tests."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from kvserve.kv.event_publisher import END_OF_REPLAY


# vLLM 0.26: tagged-map events.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


# vLLM <= 0.23: every event a positional array, tag first.
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class LegacyRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(EventBatch):
    events: list[LegacyStored | LegacyRemoved | LegacyCleared]


def replay(batches: list[KVEventBatch]) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """What a router's index holds after the stream: hash -> (parent hash, the block's tokens)."""
    index: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, VBlockStored):
                parent = event.parent_block_hash
                size = event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    index[block_hash] = (parent, tuple(event.token_ids[i * size : (i + 1) * size]))
                    parent = block_hash
            elif isinstance(event, VBlockRemoved):
                for block_hash in event.block_hashes:
                    del index[block_hash]  # KeyError: a removal of a block never stored
            else:
                index.clear()
    return index


def replay_from(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Every batch from sequence number `start` on, as (sequence number, payload), from a ROUTER replay socket."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)
