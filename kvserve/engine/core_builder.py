"""Building an EngineCore's parts around a loaded model and a sized cache: the block pool and its KV events, the KV
manager (with a hybrid model's state slots and snapshots), the cache tensors, the runner, the offload tier and its
connector, the scheduler, the sampler and the drafter. EngineCore itself only holds them and steps.

Why apart from the core: building is a one-time sequence with an order of its own (the manager before the tier, which
reads its snapshots; the tier before the scheduler, which drives it), and the core's job is the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.engine.cuda_graphs import build_decode_graphs
from kvserve.engine.facts import EngineFacts
from kvserve.engine.runner import ModelRunner
from kvserve.engine.sampler import Sampler
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.cache import allocate_kv_cache, use_static_kv_scales
from kvserve.kv.events import KVEventBuffer
from kvserve.kv.events_config import start_kv_event_publisher
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool
from kvserve.kv.state import StateSlots, StateSnapshots
from kvserve.kv.state_cache import LayerStateCache, allocate_state_cache
from kvserve.kv.vllm_events import medium_for_device
from kvserve.spec_decode.gate import SpecDecoder
from kvserve.units import format_bytes

if TYPE_CHECKING:
    from kvserve.capacity import CachePlan
    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.kv.cache import KVCacheConfig, LayerKVCache
    from kvserve.kv.event_publisher import ZmqKVEventPublisher
    from kvserve.kv.offload.config import KVOffloadConfig
    from kvserve.kv.offload.connector import OffloadConnector
    from kvserve.kv.offload.fingerprint import KVFingerprint
    from kvserve.kv.offload.layout import RowCopy
    from kvserve.kv.offload.tier import OffloadTier
    from kvserve.model.config import ModelConfig
    from kvserve.model.protocol import Model
    from kvserve.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CoreParts:
    """What an EngineCore holds, built once (build_engine_core)."""

    config: EngineConfig
    model_config: ModelConfig
    kv_config: KVCacheConfig
    cache_plan: CachePlan
    device: torch.device
    kv_events: KVEventBuffer
    pool: BlockPool
    kv_event_publisher: ZmqKVEventPublisher | None
    kv_manager: KVCacheManager
    runner: ModelRunner
    offload: OffloadTier | None
    state_offload: OffloadTier | None
    scheduler: Scheduler
    sampler: Sampler
    spec: SpecDecoder | None
    facts: EngineFacts


def build_engine_core(
    config: EngineConfig,
    model_config: ModelConfig,
    model: Model,
    kv_config: KVCacheConfig,
    cache_plan: CachePlan,
    grammar: GrammarCompiler,
    device: torch.device,
    offload_fingerprint: KVFingerprint | None = None,
) -> EngineCore:
    """The core around a loaded model (engine/build.py loads it and sizes the cache); `config` is resolved."""
    from kvserve.engine.core import EngineCore

    layout = kv_config.groups
    state = model_config.state_spec  # a hybrid model's state layers (kv/state.py), or None
    kv_events = KVEventBuffer()  # bounded: drained between steps by the async engine (the inspector)
    pool = BlockPool(
        cache_plan.num_blocks,
        enable_caching=config.enable_prefix_caching,
        events=kv_events,
        num_groups=layout.num_groups,
    )
    # vLLM's --kv-events-config: None (the default) imports no zmq; see kv/events_config.py.
    publisher = start_kv_event_publisher(
        config.kv_events_config,
        kv_events,
        config.block_size,
        medium_for_device(device.type),
        config.enable_prefix_caching,
        config.data_parallel_rank,
        [g.spec for g in layout.groups],
    )
    kv_manager = _kv_manager(config, cache_plan, pool, kv_config, kv_events, state is not None)
    kv_caches = allocate_kv_cache(kv_config, cache_plan.num_blocks, device)
    use_static_kv_scales(kv_caches, model.static_kv_scales, kv_config.dtype_name)
    state_caches = None
    if state is not None:
        num_slots = cache_plan.num_state_sequences + cache_plan.num_state_snapshots
        state_caches = allocate_state_cache(state, num_slots, torch.float32, device)
        logger.info("state layers: %s", state.describe())
    # No CUDA graphs for state layers: their per-sequence loop reads the step's lengths on the host.
    graphs = (
        None
        if state is not None
        else build_decode_graphs(config, model, kv_caches, layout, cache_plan.max_model_len, device)
    )
    runner = ModelRunner(model, kv_caches, kv_manager, config.block_size, device, graphs, state_caches)
    tier = _offload_tier(config, model_config, model, kv_manager, kv_caches, state_caches, offload_fingerprint)
    eos = tuple(model_config.eos_token_ids)
    scheduler = Scheduler(
        kv_manager,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=cache_plan.max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        max_num_partial_prefills=config.max_num_partial_prefills,
        long_prefill_token_threshold=config.long_prefill_threshold,
        max_long_partial_prefills=config.max_long_partial_prefills,
        attention_break_even_tokens=model_config.attention_break_even_tokens,
        offload=None if tier is None else tier[2],
        eos_token_ids=eos,
    )
    native = model.native_kernels
    facts = EngineFacts(
        max_model_len=cache_plan.max_model_len,
        vocab_size=model_config.vocab_size,
        max_logprobs=config.max_logprobs,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
        num_blocks=pool.num_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_cache_dtype=kv_config.dtype_name,
        eos_token_ids=eos,
        generation_defaults=model_config.generation_defaults,
        served_model_name=config.served_model_name,
        logits_width=grammar.vocab_size,
        kv_cache_groups=layout.describe(),
        hybrid_kv_cache_manager=layout.is_hybrid,
        sliding_window_layers=sum(w is not None for w in model_config.sliding_windows),
        max_concurrency=round(cache_plan.max_concurrency, 2),
        retains_prompts=tier is not None and tier[0].retains,
    )
    parts = CoreParts(
        config=config,
        model_config=model_config,
        kv_config=kv_config,
        cache_plan=cache_plan,
        device=device,
        kv_events=kv_events,
        pool=pool,
        kv_event_publisher=publisher,
        kv_manager=kv_manager,
        runner=runner,
        offload=None if tier is None else tier[0],
        state_offload=None if tier is None else tier[1],
        scheduler=scheduler,
        sampler=Sampler(eos, seed=config.seed, row_max=None if native is None else native.row_max),
        spec=None if config.speculative_config is None else SpecDecoder(config.speculative_config),
        facts=facts,
    )
    return EngineCore(parts, grammar)


def _kv_manager(
    config: EngineConfig,
    cache_plan: CachePlan,
    pool: BlockPool,
    kv_config: KVCacheConfig,
    kv_events: KVEventBuffer,
    has_state: bool,
) -> KVCacheManager:
    """The KV manager over the pool, its pin budgets from the config's fractions, and a hybrid model's state slots
    and snapshots (their slots after the sequences', KV events in the group past the KV cache groups)."""
    layout = kv_config.groups
    per_tenant = config.max_pinned_kv_fraction_per_tenant
    snapshots = None
    if has_state and cache_plan.num_state_snapshots:
        snapshots = StateSnapshots(
            cache_plan.num_state_sequences,
            cache_plan.num_state_snapshots,
            events=kv_events,
            group_idx=layout.num_groups,
        )
    return KVCacheManager(
        pool,
        config.block_size,
        config.prefix_caching_hash_algo,
        cache_plan.max_model_len if config.reserve_max_model_len else 0,
        layout,
        max_pinned_blocks=int(pool.num_usable_blocks * config.max_pinned_kv_fraction),
        state_slots=StateSlots(cache_plan.num_state_sequences) if has_state else None,
        state_snapshots=snapshots,
        max_pinned_blocks_per_tenant=None if per_tenant is None else int(pool.num_usable_blocks * per_tenant),
    )


def _offload_tier(
    config: EngineConfig,
    model_config: ModelConfig,
    model: Model,
    kv_manager: KVCacheManager,
    kv_caches: list[LayerKVCache],
    state_caches: list[LayerStateCache] | None,
    fingerprint: KVFingerprint | None,
) -> tuple[OffloadTier, OffloadTier | None, OffloadConnector] | None:
    """The KV offload tier under the pool, when one is configured (its modules are imported only then), and its
    scheduler side. A hybrid model's tier keeps its state snapshots too, in records of their own (a share of the
    size, a subdirectory of their own on disk: OffloadTier.snapshots)."""
    offload = config.kv_offload
    if offload is None:
        return None
    if not config.enable_prefix_caching:
        logger.warning("--kv-offloading-size has no effect without prefix caching: no tier is used")
        return None
    if fingerprint is None:
        raise ValueError("a KV offload tier needs the fingerprint of the engine's settings")
    from kvserve.kv.offload.connector import OffloadConnector, RestoreCostModel
    from kvserve.kv.offload.retention import retention_budget
    from kvserve.kv.offload.tier import OffloadTier

    native = model.native_kernels
    copy_rows = None if native is None else native.copy_rows
    state_tier = None
    snapshots = kv_manager.state_snapshots
    if state_caches is not None and snapshots is not None and model_config.state_spec is not None:
        offload, state_tier = _state_tier(
            config, model_config, offload, fingerprint, kv_caches, state_caches, snapshots.num_slots, copy_rows
        )
    tier = OffloadTier.for_kv_caches(offload, fingerprint, kv_caches, config.block_size, copy_rows)
    cost = RestoreCostModel(
        tier.is_async,
        lambda: tier.seconds_per_restored_block,
        None if state_tier is None else (lambda: state_tier.seconds_per_restored_block),
    )
    retention = (
        retention_budget(tier, config.max_retained_kv_fraction_per_tenant),
        None if state_tier is None else retention_budget(state_tier, config.max_retained_kv_fraction_per_tenant),
    )
    return tier, state_tier, OffloadConnector(kv_manager, tier, cost, state_tier, retention)


def _state_tier(
    config: EngineConfig,
    model_config: ModelConfig,
    offload: KVOffloadConfig,
    fingerprint: KVFingerprint,
    kv_caches: list[LayerKVCache],
    state_caches: list[LayerStateCache],
    num_snapshots: int,
    copy_rows: RowCopy | None,
) -> tuple[KVOffloadConfig, OffloadTier | None]:
    """The tier's share for a hybrid model's state snapshots (split_for_state_snapshots) and the tier that keeps
    them, one snapshot slot of every state layer a record; returns the blocks' share of the config too."""
    from kvserve.kv.cache import unique_tensors
    from kvserve.kv.offload.config import split_for_state_snapshots
    from kvserve.kv.offload.layout import BlockLayout
    from kvserve.kv.offload.tier import OffloadTier

    spec = model_config.state_spec
    assert spec is not None
    layout = BlockLayout.of_rows([t for cache in state_caches for t in cache.tensors()], copy_rows)
    pool_bytes = sum(t.numel() * t.element_size() for c in unique_tensors(kv_caches) for t in (c.key, c.value))
    kv_share, state_share = split_for_state_snapshots(
        offload, pool_bytes, num_snapshots * layout.block_bytes, layout.block_bytes
    )
    if state_share is None:
        logger.warning(
            "--kv-offloading-size %s has no room for 4 of %s's state snapshots (%s each): the tier keeps blocks "
            "only, and prefix hits need the pool's snapshots",
            format_bytes(offload.size_bytes),
            model_config.family,
            format_bytes(layout.block_bytes),
        )
        return offload, None
    state_fingerprint = fingerprint.for_state_snapshots(spec.describe())
    return kv_share, OffloadTier(state_share, state_fingerprint, layout, config.block_size, snapshots=True)
