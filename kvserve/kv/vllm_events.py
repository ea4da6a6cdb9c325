"""kvserve's KV events in vLLM's event batch schema: the values the ZMQ publisher encodes with msgpack.

Why a separate module: this is the contract with external readers (llm-d, Dynamo, vLLM's own subscriber example),
kept pure (no sockets, no threads) so that it can be tested and read on its own. The schema followed is vLLM
0.26's (docs/KV_EVENTS.md): a batch is the array [ts, events, data_parallel_rank]; each event is a map tagged by
its class name under "type" (or, with event_encoding "array", the positional array of vLLM <= 0.23, tag first).

Block hashes go out as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the low 64 bits of the
big-endian integer of the hash, an unsigned int. A run of BlockStored events that chain (each one's parent is the
previous one's last block) becomes one BlockStored with several block_hashes, as vLLM sends a request's newly
full blocks; consecutive BlockRemoved events likewise become one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvserve.kv.groups import KVCacheSpec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# The spec kind of a hybrid model's state snapshots (published as the group after its KV cache groups): vLLM calls a
# state layer's spec MambaSpec.
STATE_SNAPSHOT_KIND = "mamba"
# A model of one kind of layer has one KV cache group, a full-attention one (vLLM's "full_attention" spec, group 0).
UNIFORM_GROUPS: tuple[KVCacheSpec, ...] = (KVCacheSpec(),)


def external_block_hash(hex_hash: str) -> int:
    """vLLM's integer form of a block hash: the low 64 bits of its big-endian value (its last 8 bytes)."""
    return int(hex_hash[-16:], 16)


def medium_for_device(device_type: str) -> str:
    """Where the blocks live, in vLLM's words: "GPU" for an accelerator's cache, "CPU" for a cache in host RAM."""
    return MEDIUM_CPU if device_type == "cpu" else MEDIUM_GPU


@dataclass(slots=True)
class _Stored:
    hashes: list[int]
    last_hex: str
    parent: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None  # None: the pool's (the batch's medium)
    group_idx: int = 0


@dataclass(slots=True)
class _Removed:
    hashes: list[int] = field(default_factory=list)
    medium: str | None = None
    group_idx: int = 0


@dataclass(slots=True)
class _Cleared:
    pass


def _coalesce(events: Iterable[KVEvent]) -> list[_Stored | _Removed | _Cleared]:
    """Block events in order, runs merged; the engine's other events (preemptions, aborts...) are not vLLM's."""
    out: list[_Stored | _Removed | _Cleared] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, BlockStored):
            if (
                isinstance(last, _Stored)
                and event.parent_block_hash == last.last_hex
                and event.block_size == last.block_size
                and event.medium == last.medium
                and event.group_idx == last.group_idx
            ):
                last.hashes.append(external_block_hash(event.block_hash))
                last.token_ids.extend(event.token_ids)
                last.last_hex = event.block_hash
            else:
                parent = None if event.parent_block_hash is None else external_block_hash(event.parent_block_hash)
                out.append(
                    _Stored(
                        [external_block_hash(event.block_hash)],
                        event.block_hash,
                        parent,
                        list(event.token_ids),
                        event.block_size,
                        event.medium,
                        event.group_idx,
                    )
                )
        elif isinstance(event, BlockRemoved):
            if not isinstance(last, _Removed) or (last.medium, last.group_idx) != (event.medium, event.group_idx):
                last = _Removed(medium=event.medium, group_idx=event.group_idx)
                out.append(last)
            last.hashes.append(external_block_hash(event.block_hash))
        elif isinstance(event, AllBlocksCleared):
            out.append(_Cleared())
    return out


def _as_map(item: _Stored | _Removed | _Cleared, medium: str, groups: Sequence[KVCacheSpec]) -> dict[str, Any]:
    """vLLM after 0.23: named fields; those whose vLLM default is None and whose value is None are left out, as
    msgspec's omit_defaults leaves them out (extra_keys is sent: one None per block, like vLLM without LoRA,
    multimodal inputs or a salt to report). A BlockStored carries its group's spec, as vLLM's do, so that a reader
    can tell a full-attention group's blocks from a sliding window's (docs/KV_EVENTS.md)."""
    if isinstance(item, _Stored):
        # The group past the KV cache groups: a hybrid model's state snapshots (kv/state.py), vLLM's MambaSpec.
        spec = groups[item.group_idx] if item.group_idx < len(groups) else None
        stored = {
            "type": "BlockStored",
            "block_hashes": item.hashes,
            "parent_block_hash": item.parent,
            "token_ids": item.token_ids,
            "block_size": item.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "extra_keys": [None] * len(item.hashes),
            "group_idx": item.group_idx,
            "kv_cache_spec_kind": STATE_SNAPSHOT_KIND if spec is None else spec.kind,
        }
        if spec is not None and spec.window is not None:
            stored["kv_cache_spec_sliding_window"] = spec.window
        return stored
    if isinstance(item, _Removed):
        return {"type": "BlockRemoved", "block_hashes": item.hashes, "medium": medium, "group_idx": item.group_idx}
    return {"type": "AllBlocksCleared"}


def _as_array(item: _Stored | _Removed | _Cleared, medium: str, groups: Sequence[KVCacheSpec]) -> list[Any]:
    """vLLM <= 0.23: the tag, then the fields in declaration order up to the last one without a default
    (lora_name); the trailing optional ones are omitted, as msgspec's omit_defaults omits them."""
    if isinstance(item, _Stored):
        return ["BlockStored", item.hashes, item.parent, item.token_ids, item.block_size, None, medium, None]
    if isinstance(item, _Removed):
        return ["BlockRemoved", item.hashes, medium]
    return ["AllBlocksCleared"]


def event_batch(
    events: Iterable[KVEvent],
    ts: float,
    medium: str,
    encoding: str = "map",
    data_parallel_rank: int = 0,
    groups: Sequence[KVCacheSpec] = UNIFORM_GROUPS,
) -> list[Any] | None:
    """One KVEventBatch, msgpack-ready: [ts, [event, ...], data_parallel_rank]; None when no event is vLLM's.
    `groups`: each KV cache group's spec, by group index (the array encoding, vLLM <= 0.23's, has no group fields:
    readers of it should be given a model of one group)."""
    items = _coalesce(events)
    if not items:
        return None
    encode = _as_map if encoding == "map" else _as_array
    return [ts, [encode(item, _medium_of(item, medium), groups) for item in items], data_parallel_rank]


def _medium_of(item: _Stored | _Removed | _Cleared, pool_medium: str) -> str:
    """An offload tier's events carry their own medium; the pool's take the batch's (its device's)."""
    own = item.medium if isinstance(item, (_Stored, _Removed)) else None
    return own or pool_medium
