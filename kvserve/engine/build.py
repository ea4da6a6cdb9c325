"""Building an engine: load the model and tokenizer a config names, resolve what only loading decides, size the KV
pool, and assemble the core (EngineCore) and its front end (LLMEngine). `sibling` builds another engine around an
already loaded model, for comparing settings without loading it twice.

Why apart from the engine: loading, sizing and resolving run once, before the first step; keeping them here leaves
engine/core.py and engine/engine.py to what runs every step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kvserve.capacity import CachePlan, plan_kv_cache, resolve_quantization
from kvserve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, resolve_attention_backend
from kvserve.engine.core import EngineCore
from kvserve.engine.core_builder import build_engine_core
from kvserve.engine.engine import LLMEngine
from kvserve.engine.memory_profile import CudaMemory, gpu_kv_budget, profile_gpu_memory
from kvserve.kv.cache import KVCacheConfig, resolve_kv_cache_dtype
from kvserve.kv.groups import make_kv_cache_layout
from kvserve.kv.offload.config import check_host_tier_fits
from kvserve.kv.state import state_reservation
from kvserve.structured.compiler import GrammarCompiler
from kvserve.units import MiB

if TYPE_CHECKING:
    from kvserve.kv.offload.fingerprint import KVFingerprint
    from kvserve.model.config import ModelConfig
    from kvserve.model.protocol import Model
    from kvserve.model.source import ModelSource
    from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Settings a sibling cannot change: they are the loaded model's.
_MODEL_SETTINGS = frozenset(
    {
        "model",
        "dtype",
        "quantization",
        "device",
        "attention_backend",
        "lm_head_quantization",
        "activation_quantization",
        "kernel_isa",
    }
)


def plan_cache(
    config: EngineConfig,
    model_config: ModelConfig,
    spec: KVCacheConfig,
    device: torch.device,
    device_budget: Callable[[], int] | None = None,
) -> CachePlan:
    """Size the pool from the KV budget and check that one request of max-model-len fits, and that a host-memory
    offload tier fits in available memory beside it (kv/offload/config.py check_host_tier_fits). On CUDA without
    --kv-cache-memory-bytes or --num-gpu-blocks-override, `device_budget()` (the profiled budget,
    engine/memory_profile.py) is the budget."""
    budget = config.kv_cache_memory_bytes
    if config.num_gpu_blocks_override is None:
        if budget is None:
            if device.type != "cpu":
                if device_budget is None:
                    raise ValueError(
                        f"on {device} the KV budget comes from a profile of the model: pass "
                        "--kv-cache-memory-bytes or --num-gpu-blocks-override to plan without one"
                    )
                budget = device_budget()
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        if device.type == "cpu":
            available = _available_memory_bytes()
            if available is not None and budget > available:
                raise ValueError(
                    f"--kv-cache-memory-bytes {budget} exceeds this machine's available memory ({available} bytes); "
                    f"pass a smaller budget, e.g. --kv-cache-memory-bytes {max(available // 4, MiB)}"
                )
    num_snapshots = num_sequences = 0
    if model_config.state_spec is not None:
        state = state_reservation(
            model_config.state_spec, config.max_num_seqs, budget, config.enable_prefix_caching, spec.bytes_per_block
        )
        num_snapshots, num_sequences = state.num_snapshots, state.num_sequences
        if budget is not None:
            if state.bytes >= budget:
                raise ValueError(
                    f"the KV budget ({budget} bytes) does not hold the state layers' slots ({state.describe()}): "
                    "raise --kv-cache-memory-bytes or lower --max-num-seqs"
                )
            budget -= state.bytes
        logger.info("state layers' slots, out of the KV budget: %s", state.describe())
    plan = plan_kv_cache(
        spec.bytes_per_block,
        spec.block_size,
        model_config.max_position_embeddings,
        budget_bytes=budget,
        num_blocks_override=config.num_gpu_blocks_override,
        max_model_len=config.max_model_len,
        layout=spec.groups,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
    )
    if not config.enable_chunked_prefill and config.max_model_len is None:
        if plan.max_model_len == config.max_num_batched_tokens < model_config.max_position_embeddings:
            logger.info(
                "chunked prefill is off, so a prompt must fit one step: max-model-len is %d "
                "(--max-num-batched-tokens); raise it, or turn chunked prefill on, for longer prompts",
                plan.max_model_len,
            )
    pool_bytes = plan.num_blocks * plan.bytes_per_block if device.type == "cpu" else 0
    check_host_tier_fits(config.kv_offload, _available_memory_bytes(), pool_bytes)
    return dataclasses.replace(plan, num_state_sequences=num_sequences, num_state_snapshots=num_snapshots)


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def build_core(
    config: EngineConfig,
    model_config: ModelConfig,
    model: Model,
    tokenizer: Tokenizer,
    device: torch.device,
    compute_dtype: torch.dtype,
    grammar: GrammarCompiler | None = None,
) -> EngineCore:
    """The core around a loaded model: the KV spec, the pool's plan (profiled on CUDA), the grammar compiler (built
    over the tokenizer's vocabulary on its first use, never per request), the core."""
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, compute_dtype)
    if model_config.state_layers:
        config = for_state_layers(config, model_config)
    spec = KVCacheConfig(
        model_config.num_kv_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
        config.block_size,
        kv_dtype,
        # A contiguous cache's emulation (bench memory) keeps every layer's max-model-len: the uniform layout.
        make_kv_cache_layout(
            model_config.kv_sliding_windows,
            hybrid=not (config.disable_hybrid_kv_cache_manager or config.reserve_max_model_len),
        ),
    )

    def profiled_budget() -> int:
        """vLLM's GPU sizing: --gpu-memory-utilization of the device's memory less the weights, the peak of one
        profiled step and non-torch memory (engine/memory_profile.py); logged like the CPU plan."""
        facts = profile_gpu_memory(
            model, spec, config.max_num_batched_tokens, config.max_num_seqs, device, CudaMemory(device)
        )
        budget = gpu_kv_budget(facts, config.gpu_memory_utilization, spec.bytes_per_block)
        logger.info(budget.describe())
        return budget.kv_bytes

    plan = plan_cache(config, model_config, spec, device, profiled_budget)
    if grammar is None:
        grammar = GrammarCompiler(
            tokenizer,
            model.num_logits,
            model_config.eos_token_ids,
            backend=config.structured_outputs_backend,
            config=config.structured_outputs_config,
        )
    fingerprint = offload_fingerprint(config, model, spec, device, compute_dtype) if config.kv_offload else None
    return build_engine_core(config, model_config, model, spec, plan, grammar, device, fingerprint)


def for_state_layers(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """A model with state layers (kv/state.py) cannot roll its state back: speculative decoding, which rejects drafted
    tokens, is refused."""
    if config.speculative_config is not None:
        raise ValueError(
            f"speculative decoding is not supported for {model_config.family}: its state layers cannot take back "
            "rejected draft tokens"
        )
    return config


def offload_fingerprint(
    config: EngineConfig, model: Model, spec: KVCacheConfig, device: torch.device, compute_dtype: torch.dtype
) -> KVFingerprint:
    """What the KV offload tier's blocks are computed under (kv/offload/fingerprint.py): the weights named by
    config.model (the default model's file when None), and every setting that changes the K/V numbers."""
    import kvserve
    from kvserve.dtypes import dtype_name
    from kvserve.kv.offload.fingerprint import KVFingerprint, weights_identity
    from kvserve.model.source import resolve_model
    from kvserve.model.tokenizer import default_cache_dir

    scales = model.static_kv_scales if spec.dtype_name == "fp8_e4m3" else None
    return KVFingerprint(
        weights=weights_identity(resolve_model(config.model).path, default_cache_dir()),
        weight_quantization=config.quantization,
        activation_quantization=config.activation_quantization,
        kernels=model.kernel_isa,
        attention_backend=config.attention_backend or "auto",
        device_type=device.type,
        dtype=dtype_name(compute_dtype),
        kv_cache_dtype=spec.dtype_name,
        tier_dtype=config.kv_offloading_dtype,
        static_kv_scales="" if scales is None else repr([(float(k), float(v)) for k, v in scales]),
        block_size=spec.block_size,
        hash_algo=config.prefix_caching_hash_algo,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        kv_cache_groups=spec.groups.signature(),
        torch_version=torch.__version__,
        kvserve_version=kvserve.__version__,
    )


def resolve_config(config: EngineConfig, source: ModelSource, device: torch.device) -> EngineConfig:
    """What only the model and the device decide, resolved into a copy: --quantization auto (the GGUF blocks on CPU,
    else none), the attention backend, the served name (the checkpoint's). Both builders call it, so an engine's
    config, and the offload tier's fingerprint made from it, are the same whichever of them built the engine."""
    return dataclasses.replace(
        config,
        attention_backend=resolve_attention_backend(config.attention_backend, device.type),
        quantization=resolve_quantization(config.quantization, device.type, source.format.value),
        served_model_name=config.served_model_name or source.name,
    )


def build_engine(
    config: EngineConfig,
    model_config: ModelConfig,
    model: Model,
    tokenizer: Tokenizer,
    device: torch.device | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> LLMEngine:
    """An engine around a model loaded elsewhere (one load shared by engines of different settings: tests,
    benchmarks). `config`'s model settings must describe that model (config.model names its checkpoint; a float32
    model loaded from a GGUF file needs quantization="none", since auto means the file's blocks on CPU); the rest is
    resolved by resolve_config, as load_engine does."""
    from kvserve.model.source import resolve_model

    device = device or torch.device(config.device)
    resolved = resolve_config(config, resolve_model(config.model), device)
    return LLMEngine(
        build_core(resolved, model_config, model, tokenizer, device, compute_dtype), tokenizer, compute_dtype
    )


def load_engine(config: EngineConfig) -> LLMEngine:
    """Load the model and tokenizer named by the config and build an engine around them. The engine's config is a
    resolved copy (resolve_config); `config` is unchanged."""
    from kvserve.model.loader import load_model, load_model_config, resolve_dtype
    from kvserve.model.source import resolve_model
    from kvserve.model.tokenizer import load_tokenizer

    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    device = torch.device(config.device)
    source = resolve_model(config.model)
    resolved = resolve_config(config, source, device)
    # The tokenizer loads in a thread while the weights load: reading a cached tokenizer.json is Rust code
    # that releases the GIL (about 1 s of a later start for Gemma's 262k vocabulary).
    with ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer") as pool:
        tokenizer_future = pool.submit(load_tokenizer, source, chat_template=config.chat_template)
        model_config = load_model_config(source)
        dtype = resolve_dtype(config.dtype, device, model_config)
        loaded = load_model(
            source,
            dtype,
            device,
            attention_backend=resolved.attention_backend or "cpu",
            quantization=resolved.quantization,
            config=model_config,
            lm_head_quantization=resolved.lm_head_quantization,
            activation_quantization=resolved.activation_quantization,
            kernel_isa=None if resolved.kernel_isa == "auto" else resolved.kernel_isa,
        )
        tokenizer = tokenizer_future.result()
    core = build_core(resolved, loaded.config, loaded.model, tokenizer, device, dtype)
    return LLMEngine(core, tokenizer, compute_dtype=dtype)


def sibling(engine: LLMEngine, **changes: Any) -> LLMEngine:
    """A new engine (own KV cache, scheduler and requests) sharing `engine`'s loaded model and tokenizer, with
    `changes` applied to its config. The grammar compiler is shared too unless the change is its backend or budgets."""
    fixed = _MODEL_SETTINGS & changes.keys()
    if fixed:
        raise ValueError(f"a sibling engine shares the loaded model, so it cannot change {', '.join(sorted(fixed))}")
    core = engine.core
    changes.setdefault("kv_events_config", None)  # one publisher per address: the sibling publishes none
    config = core.config.updated(**changes)
    same = (config.structured_outputs_backend, config.structured_outputs_config) == (
        core.config.structured_outputs_backend,
        core.config.structured_outputs_config,
    )
    grammar = core.grammar if same else None
    new_core = build_core(
        config, core.model_config, core.runner.model, engine.tokenizer, core.device, engine.compute_dtype, grammar
    )
    return LLMEngine(new_core, engine.tokenizer, compute_dtype=engine.compute_dtype)
