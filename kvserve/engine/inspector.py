"""The KV inspector's view of the engine: an immutable snapshot of the block pool, the requests' block tables and the
prefix cache, and the engine events (preemptions, aborts, refused admissions, prefix misses) recorded around each
schedule.

Why here and built on the engine thread: the pool's linked lists and the requests' block lists change every step, so
a reader on another thread (the server's loop) must never walk them. The engine builds a fresh structure of plain
values (str, int, float, lists, dicts) that shares nothing with its own objects, and the async engine publishes it
between steps. The cost is O(num_blocks + tokens of block tables) per call, paid only while someone is watching.

Schema (version 2; the JSON of GET /v1/kv/snapshot, documented in docs/UI.md):
- pool: num_blocks, num_usable_blocks, num_free_blocks, block_size, null_block_id, enable_prefix_caching
- kv_cache_groups: one entry per KV cache group (kv/groups.py): group_id, kind (full_attention | sliding_window),
  sliding_window (null for full attention), layers, blocks_held (referenced blocks of the group), blocks_cached
- block_states: one character per block id: "n" null, "f" free (no hash), "c" cached and evictable (free, hashed),
  "u" used by one request, "s" shared by several. Blocks in state "f" and "n" appear nowhere else.
- blocks: one entry per block in states c / u / s: id, group (its KV cache group), state, ref_cnt, hash (first 16 hex
  digits or null), evict_rank (c only: 0 = the next cached block to be reused), holders (request ids), token_ids
  (null when redacted)
- requests: request_id, seq_id, status (running / waiting / preempted), block_ids (group 0's table), group_block_ids
  (every group's table, in group order; a sliding group's entries before its window are the null block's id),
  num_prompt_tokens, num_output_tokens, num_computed_tokens, prefix_hit_tokens, restored_tokens, prefix_miss (why
  the prefix hit stopped short, kv/misses.py: reason, at_token, diverged_at_token, evicted_ago_s,
  evicted_blocks_since; null when it served all it could; when redacted, as clients are told it: kv/misses.py
  tenant_view), prompt_cache_key (null when redacted), age_s, num_preemptions
- prefix_cache: nodes, one per cached block of group 0 (a full-attention group where the model has one: every
  prefix's whole chain): hash, parent (hash prefix or null), block_id, hits, ref_cnt, evict_rank, groups (how many
  groups hold this hash's block)
- pins: the live cache_control pins (kv/pins.py): hash (of the prefix's last block), num_tokens, block_ids, ttl_s,
  expires_in_s
- gauges: the EngineStats fields (when redacted, the miss reasons counted as clients are told them); capacity: the
  cache plan (kvserve estimate's figures for this server)
- offload_tier: null without a KV offload tier; else medium, available, num_blocks, bytes_used, capacity_bytes,
  indexed_blocks (those this process knows, kv/offload/index.py) and prefixes: the largest 64 prefixes it holds,
  each root (hash prefix), blocks, tokens, in_pool (of its blocks, also in the pool), token_ids (the root block's;
  null when redacted)
- state: null for a model of attention only; for a hybrid model's state layers (kv/state.py): spec, bytes_per_slot,
  num_sequence_slots, slots (request id -> slot), num_snapshot_slots, snapshots (hash, slot, pending, loading: being
  restored from the offload tier), offload_tier (null without one: the tier's state snapshots, num_snapshots,
  bytes_used, capacity_bytes, snapshot_bytes, stored, restored, restore_failures)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.capacity import NULL_BLOCK_ID
from kvserve.engine.request import Request, RequestStatus
from kvserve.kv.events import Aborted, KVEventBuffer, Preempted, PrefixMissed
from kvserve.kv.misses import PrefixMiss, tenant_counts, tenant_view

if TYPE_CHECKING:
    from kvserve.engine.core import EngineCore
    from kvserve.engine.scheduler import Scheduler, SchedulerOutput
    from kvserve.kv.block import KVCacheBlock
    from kvserve.kv.offload.tier import OffloadTier

SNAPSHOT_VERSION = 2
HASH_PREFIX_HEX = 16


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """One published view of the KV cache. `data` is JSON-ready and owned by no one else: never mutate it."""

    seq: int  # increases with every snapshot of an engine
    taken_at: float  # time.time()
    data: dict[str, Any]


@dataclass(slots=True)
class EngineEventRecorder:
    """Turns what one schedule did into engine events. Holds only what it needs between steps: which requests
    were already reported as refused (one event per refusal stretch, not one per step)."""

    events: KVEventBuffer
    # The user's request id of an engine sequence id (events name what the user sent, not "3:id#0").
    name: Callable[[str], str] = str
    refused: set[str] = field(default_factory=set)

    def after_schedule(self, out: SchedulerOutput, scheduler: Scheduler) -> None:
        """What the schedule decided, as events: its preemptions (with what each lost) and a refused admission (once
        per stretch of refusals of the same request, as the scheduler reported it). Nothing is made while no one
        reads the events."""
        if not self.events.enabled:
            return
        for request in out.preempted:
            tokens, blocks = out.preempted_held.get(request.request_id, (0, 0))
            self.events.append(Preempted(self.name(request.request_id), tokens, blocks))
        for request in out.missed:
            miss = request.prefix_miss
            if miss is not None:
                name = self.name(request.request_id)
                at, diverged = miss.at_token, miss.diverged_at_token
                self.events.append(PrefixMissed(name, miss.reason, at, request.num_prompt_tokens, diverged))
        if not scheduler.waiting:
            self.refused.clear()
        refusal = out.refused
        if refusal is None or refusal.request_id in self.refused:
            return
        self.refused = {r for r in self.refused if any(w.request_id == r for w in scheduler.waiting)}
        self.refused.add(refusal.request_id)
        self.events.append(dataclasses.replace(refusal, request_id=self.name(refusal.request_id)))

    def record_abort(self, request_id: str, blocks_freed: int) -> None:
        if self.events.enabled:
            self.events.append(Aborted(request_id, blocks_freed))


def _short(block_hash: bytes | None) -> str | None:
    return block_hash.hex()[:HASH_PREFIX_HEX] if block_hash is not None else None


def _evict_ranks(engine: EngineCore) -> dict[int, int]:
    """Cached free blocks by block id -> their rank in reuse order (0: reused, so evicted, next)."""
    ranks: dict[int, int] = {}
    for block in engine.pool.free_blocks():
        if block.block_hash is not None:
            ranks[block.block_id] = len(ranks)
    return ranks


PIN_HOLDER = "(pinned)"  # a cache_control pin's reference (kv/pins.py), among a block's holders


def _holders(engine: EngineCore) -> dict[int, list[str]]:
    """Block id -> the user request ids holding it (a request with n > 1 appears once per sequence), and PIN_HOLDER
    for each pin holding it."""
    holders: dict[int, list[str]] = {}
    for seq_id, _, block in engine.kv_manager.held_blocks():
        seq = engine.requests.sequences.get(seq_id)
        holders.setdefault(block.block_id, []).append(seq.group_id if seq is not None else seq_id)
    for block in engine.kv_manager.pins.held_blocks():
        holders.setdefault(block.block_id, []).append(PIN_HOLDER)
    return holders


def _state(block: KVCacheBlock) -> str:
    if block.block_id == NULL_BLOCK_ID:
        return "n"
    if block.ref_cnt > 1:
        return "s"
    if block.ref_cnt == 1:
        return "u"
    return "c" if block.block_hash is not None else "f"


def _blocks(engine: EngineCore, include_tokens: bool) -> tuple[str, list[dict[str, Any]]]:
    ranks = _evict_ranks(engine)
    holders = _holders(engine)
    states: list[str] = []
    detail: list[dict[str, Any]] = []
    for block in engine.pool.blocks:
        state = _state(block)
        states.append(state)
        if state in ("f", "n"):
            continue
        key = block.key
        detail.append(
            {
                "id": block.block_id,
                "group": block.group_id,
                "state": state,
                "ref_cnt": block.ref_cnt,
                "hash": _short(block.block_hash),
                "evict_rank": ranks.get(block.block_id),
                "holders": holders.get(block.block_id, []),
                "token_ids": list(key.token_ids) if include_tokens and key is not None else None,
            }
        )
    return "".join(states), detail


def _request(engine: EngineCore, request: Request, now: float, tenant: bool) -> dict[str, Any]:
    seq = engine.requests.sequences.get(request.request_id)
    return {
        "request_id": seq.group_id if seq is not None else request.request_id,
        "seq_id": request.request_id,
        "status": request.status.value,
        "block_ids": engine.kv_manager.block_ids(request),
        "group_block_ids": [
            [b.block_id for b in table] for table in engine.kv_manager.group_tables(request.request_id)
        ],
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_output_tokens": len(request.output_token_ids),
        "num_computed_tokens": request.num_computed_tokens,
        "prefix_hit_tokens": request.num_cached_tokens,
        "restored_tokens": request.num_restored_tokens,  # of prefix_hit_tokens, from the KV offload tier
        # why the prefix hit stopped short (kv/misses.py), the operator's view: every reason, another salt's too;
        # a tenant's view (redacted) tells what clients are told
        "prefix_miss": _miss(request.prefix_miss, tenant),
        # OpenAI's: requests that belong together (a tenant's name for its work: not in a tenant's view)
        "prompt_cache_key": None if tenant else request.sampling_params.prompt_cache_key,
        "age_s": round(now - request.arrival_time, 3),
        "num_preemptions": request.num_preemptions,
    }


def _miss(miss: PrefixMiss | None, tenant: bool) -> dict[str, Any] | None:
    if miss is None:
        return None
    return dataclasses.asdict(tenant_view(miss) if tenant else miss)


def tenant_event(data: dict[str, Any]) -> dict[str, Any]:
    """An event's JSON as a tenant's view of the inspector shows it (redacted): no token ids, a prefix miss as
    clients are told it (kv/misses.py tenant_view)."""
    if data.get("token_ids") is not None:
        data = {**data, "token_ids": None}
    if data.get("kind") == "prefix_missed":
        told = tenant_view(PrefixMiss(data["reason"], data["at_token"], data.get("diverged_at_token")))
        data = {**data, "reason": told.reason, "diverged_at_token": told.diverged_at_token}
    return data


def _requests(engine: EngineCore, tenant: bool) -> list[dict[str, Any]]:
    now = time.monotonic()
    queued = [*engine.scheduler.running, *engine.scheduler.waiting]
    return [_request(engine, r, now, tenant) for r in queued if r.status is not RequestStatus.FINISHED_ABORTED]


def _prefix_cache(engine: EngineCore, ranks: dict[int, int]) -> list[dict[str, Any]]:
    """The cached blocks as tree nodes linked by parent hash (a node whose parent is gone was evicted first)."""
    pool = engine.pool
    nodes = []
    for block_hash, block in pool.cached[0].items():
        parent = block.key.parent if block.key is not None else None
        nodes.append(
            {
                "hash": _short(block_hash),
                "parent": _short(parent),
                "block_id": block.block_id,
                "hits": pool.hit_counts[0].get(block_hash, 0),
                "ref_cnt": block.ref_cnt,
                "evict_rank": ranks.get(block.block_id),
                "groups": sum(1 for cached in pool.cached if block_hash in cached),
            }
        )
    return nodes


def _groups(engine: EngineCore) -> list[dict[str, Any]]:
    """The KV cache groups, and how many blocks each holds now (referenced) and keeps cached."""
    held = [0] * engine.layout.num_groups
    for block in engine.pool.blocks:
        if block.ref_cnt > 0:
            held[block.group_id] += 1
    return [
        {
            "group_id": g.group_id,
            "kind": g.spec.kind,
            "sliding_window": g.spec.window,
            "layers": list(g.layers),
            "blocks_held": held[g.group_id],
            "blocks_cached": len(engine.pool.cached[g.group_id]),
        }
        for g in engine.layout.groups
    ]


def _capacity(engine: EngineCore) -> dict[str, Any]:
    plan = engine.cache_plan
    return {
        "num_blocks": plan.num_blocks,
        "num_usable_blocks": plan.num_usable_blocks,
        "block_size": plan.block_size,
        "bytes_per_block": plan.bytes_per_block,
        "bytes_per_token": plan.bytes_per_block // plan.block_size,
        "num_tokens": plan.num_tokens,
        "max_model_len": plan.max_model_len,
        "max_concurrency": round(plan.max_concurrency, 3),
        "blocks_per_request": plan.blocks_per_request(plan.max_model_len),
        "tensors_per_block": engine.layout.tensors_per_block,
        "kv_cache_dtype": engine.kv_config.dtype_name,
        "total_bytes": plan.num_blocks * plan.bytes_per_block,
    }


def _pins(engine: EngineCore) -> list[dict[str, Any]]:
    """The live cache_control pins (kv/pins.py): the prefix each holds (its last block's hash, its tokens), its
    blocks, its TTL and the seconds it has left."""
    table = engine.kv_manager.pins
    now = table.clock()
    return [
        {
            "hash": _short(pin.key),
            "num_tokens": pin.num_tokens,
            "block_ids": [b.block_id for b in pin.blocks],
            "ttl_s": pin.ttl_s,
            "expires_in_s": round(max(pin.expires_at - now, 0.0), 1),
        }
        for pin in table.pins.values()
    ]


def _state_layers(engine: EngineCore) -> dict[str, Any] | None:
    """A hybrid model's state layers (kv/state.py): what a sequence's state costs, which request holds which slot,
    and the snapshots kept for prefix hits (the hash of the block each ends at, most recently used last; pending: saved
    after the step now running). None for a model of attention only."""
    kv = engine.kv_manager
    spec, slots, snapshots = engine.model_config.state_spec, kv.state_slots, kv.state_snapshots
    if spec is None or slots is None:
        return None
    return {
        "spec": spec.describe(),
        "bytes_per_slot": spec.bytes_per_slot,
        "num_sequence_slots": slots.num_slots,
        "slots": dict(slots.held),
        "num_snapshot_slots": 0 if snapshots is None else snapshots.num_slots,
        "snapshots": []
        if snapshots is None
        else [
            {"hash": _short(h), "slot": s, "pending": h in snapshots.pending, "loading": h in snapshots.loading}
            for h, s in snapshots.by_hash.items()
        ],
        "offload_tier": None if engine.state_offload is None else _state_tier(engine.state_offload),
    }


def _state_tier(tier: OffloadTier) -> dict[str, Any]:
    """The offload tier's share for state snapshots: what it holds and did."""
    stats = tier.stats()
    return {
        "medium": stats.medium,
        "available": stats.available,
        "num_snapshots": stats.num_blocks,
        "bytes_used": stats.bytes_used,
        "capacity_bytes": stats.capacity_bytes,
        "snapshot_bytes": stats.block_bytes,
        "stored": stats.stored_blocks,
        "restored": stats.restored_blocks,
        "restore_failures": stats.restore_failures,
    }


def build_snapshot(engine: EngineCore, include_tokens: bool = True, tenant: bool | None = None) -> dict[str, Any]:
    """The whole view, built from the engine's live state on the engine thread (see the module docstring). `tenant`
    (default: without token ids): a tenant's view, whose prefix misses and their counts are what clients are told
    (kv/misses.py tenant_view) and which names no prompt_cache_key."""
    tenant = not include_tokens if tenant is None else tenant
    stats = dataclasses.asdict(engine.stats())
    if tenant:
        stats["prefix_cache_miss_reasons"] = tenant_counts(stats["prefix_cache_miss_reasons"])
    pool = engine.pool
    states, blocks = _blocks(engine, include_tokens)
    ranks = {b["id"]: b["evict_rank"] for b in blocks if b["evict_rank"] is not None}
    return {
        "version": SNAPSHOT_VERSION,
        "pool": {
            "num_blocks": pool.num_blocks,
            "num_usable_blocks": pool.num_usable_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "block_size": engine.config.block_size,
            "null_block_id": NULL_BLOCK_ID,
            "enable_prefix_caching": pool.enable_caching,
        },
        "kv_cache_groups": _groups(engine),
        "block_states": states,
        "blocks": blocks,
        "requests": _requests(engine, tenant),
        "prefix_cache": _prefix_cache(engine, ranks),
        "pins": _pins(engine),
        "state": _state_layers(engine),
        "gauges": stats,
        "capacity": _capacity(engine),
        "offload_tier": None
        if engine.offload is None
        else engine.offload.view(lambda h: pool.is_cached(h, 0), include_tokens),
        "redacted": not include_tokens,
        "events_dropped": engine.kv_events.dropped,
    }


def block_detail(engine: EngineCore, block_id: int, include_text: bool = True) -> dict[str, Any]:
    """One block in full, for the page's click: its snapshot entry plus, per holder, the token range it holds, and
    its token ids (from the cached key or the holder's tokens; the route adds their text, off the engine thread).
    Raises ValueError for an unknown id."""
    if not 0 <= block_id < engine.pool.num_blocks:
        raise ValueError(f"block id {block_id} is out of range: the pool has {engine.pool.num_blocks} blocks")
    block = engine.pool.blocks[block_id]
    bs = engine.config.block_size
    spans = []
    token_ids: list[int] | None = list(block.key.token_ids) if block.key is not None else None
    for seq_id, state in engine.kv_manager.requests.items():
        table = state.tables[block.group_id]
        if block not in table:
            continue
        index = table.index(block)
        seq = engine.requests.sequences.get(seq_id)
        request = seq.request if seq is not None else None
        start, end = index * bs, (index + 1) * bs
        if request is not None:
            end = min(end, request.num_tokens)
            if token_ids is None:
                token_ids = request.token_slice(start, end)
        spans.append({"request_id": seq.group_id if seq is not None else seq_id, "start": start, "end": end})
    detail: dict[str, Any] = {
        "id": block_id,
        "group": block.group_id,
        "state": _state(block),
        "ref_cnt": block.ref_cnt,
        "hash": _short(block.block_hash),
        "held": spans,
        "redacted": not include_text,
    }
    detail["token_ids"] = token_ids if include_text else None
    return detail
