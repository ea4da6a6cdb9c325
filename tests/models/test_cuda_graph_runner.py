"""The CUDA path's engine logic on CPU, on tiny random checkpoints: decode steps run through DecodeGraphs (static
buffers, padding to the captured size, replay) with the capture replaced by a plain call, and must give the eager
engine's tokens; the GPU memory profile's dummy step runs with fake device counters. A real CUDA graph capture,
pinned copies and the profile's real numbers need a GPU (docs/CUDA.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import reference_attention
from kvserve.config import EngineConfig
from kvserve.engine.cuda_graphs import CudaGraphCapture, DecodeGraphs, PaddedDecode, capture_sizes, replay_by_call
from kvserve.engine.engine import LLMEngine
from kvserve.engine.host_transfer import HostToDevice
from kvserve.engine.memory_profile import profile_gpu_memory
from kvserve.kernels.ops import TORCH_KERNELS, Kernels
from kvserve.kv.cache import LayerKVCache
from kvserve.model.quantization import weight_bytes

CPU = torch.device("cpu")
BLOCK = 4
# The same checks with a real CUDA graph capture, pinned copies and the GPU sampler, where a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def tensor_only_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    layer: AttentionLayerSpec,
    kernels: Kernels = TORCH_KERNELS,
) -> torch.Tensor:
    """A capturable decode backend, as the graph path requires: it reads the step only from the metadata's tensors
    (every block-table column, masked by seq_lens), never from its Python lists; other steps go to the reference."""
    if not meta.is_decode_only:
        return reference_attention(q, cache, meta, layer, kernels)
    tables, lens = meta.block_tables, meta.seq_lens
    pos = torch.arange(tables.shape[1] * meta.block_size, device=tables.device)
    slots = tables[:, pos // meta.block_size] * meta.block_size + pos % meta.block_size  # [B, S]
    k, v = cache.read(slots, torch.float32)  # [B, S, kv_heads, D]
    valid = pos[None, :] < lens[:, None]
    if layer.sliding_window is not None:
        valid &= pos[None, :] >= lens[:, None] - layer.sliding_window
    group = q.shape[1] // cache.num_kv_heads
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2).masked_fill(~valid[:, :, None, None], 0.0)  # unwritten slots may be NaN
    scores = torch.einsum("bhd,bshd->bhs", q.float(), k) * layer.scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bshd->bhd", scores.softmax(dim=-1), v).to(q.dtype)


def make_engine(path: Path, backend=tensor_only_attention, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks_override", 256)
    kw.setdefault("device", "cpu")
    engine = LLMEngine.from_config(
        EngineConfig(model=str(path), block_size=BLOCK, attention_backend="reference", max_num_seqs=8, **kw)
    )
    for layer in engine.core.runner.model.layers:
        layer.self_attn.backend = backend
    return engine


def with_graphs(engine: LLMEngine) -> list[int]:
    """Give the engine's runner decode graphs (captured by a plain call on CPU, as CUDA graphs on a GPU); returns
    the list of sizes replayed."""
    config, device = engine.config, engine.core.device
    capture = replay_by_call if device.type == "cpu" else CudaGraphCapture(device)
    graphs = DecodeGraphs(
        engine.core.runner.model,
        engine.core.runner.kv_caches,
        capture_sizes(None, config.max_num_seqs, config.max_num_batched_tokens),
        engine.core.max_model_len,
        BLOCK,
        device,
        capture,
        engine.core.layout,
    )
    used: list[int] = []
    replay = graphs.replay

    def spy(size: int, padded: PaddedDecode) -> torch.Tensor:
        used.append(size)
        return replay(size, padded)

    graphs.replay = spy  # type: ignore[method-assign]
    engine.core.runner.graphs = graphs
    return used


# The sliding variant's pool holds 3 KV cache groups of one layer each (kv/groups.py): a block is a third of the
# uniform model's, and a 48-token request (with a 7-token chunk) needs 22 of them; this many still preempt.
POOL_PER_BLOCK_LAYER = {"gemma3_mqa_sliding": 26}


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Five prompts ending at different lengths, so that decode batches shrink 5 -> 1 (graphs of 8, 4, 2, 1)."""
    g = torch.Generator().manual_seed(3)
    prompts = [[2] + torch.randint(4, 256, (int(n),), generator=g).tolist() for n in (5, 17, 9, 30, 3)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (3, 7, 11, 14, 18)]
    return prompts, params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["llama_gqa", "gemma3_mqa_sliding"])
@pytest.mark.parametrize(
    "engine_kw",
    [{}, dict(kv_cache_dtype="fp8"), dict(max_num_batched_tokens=7, num_gpu_blocks_override=14, max_model_len=48)],
    ids=["plain", "fp8-kv", "chunked-preempt"],
)
def test_padded_graph_steps_give_the_eager_tokens(checkpoints, device, variant, engine_kw) -> None:
    prompts, params = workload()
    engine_kw = {**engine_kw, "device": device}
    if variant in POOL_PER_BLOCK_LAYER and "num_gpu_blocks_override" in engine_kw:
        engine_kw["num_gpu_blocks_override"] = POOL_PER_BLOCK_LAYER[variant]
    eager = LLM(engine=make_engine(checkpoints[variant], **engine_kw)).generate(prompts, params, use_tqdm=False)
    engine = make_engine(checkpoints[variant], **engine_kw)
    used = with_graphs(engine)
    graphed = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    for e, g in zip(eager, graphed):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        lp_e = [d[t].logprob for d, t in zip(e.outputs[0].logprobs, e.outputs[0].token_ids)]
        lp_g = [d[t].logprob for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        assert lp_g == pytest.approx(lp_e, abs=1e-4)
    largest = max(engine.core.runner.graphs.sizes) if engine.core.runner.graphs else 0
    assert used and max(used) <= largest
    if engine_kw.get("num_gpu_blocks_override", 256) < 256:  # fewer requests decode together; one is preempted
        assert engine.core.scheduler.num_preemptions > 0
    else:
        assert {1, 2, 4, 8} <= set(used)  # batches of 3 and 5 were padded up to 4 and 8
    engine.check_invariants()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks
    assert engine.core.pool.null_block.ref_cnt == 0  # padding rows wrote there; no request ever holds it


@pytest.mark.parametrize("graphs", [False, True])
def test_staged_transfers_give_the_same_tokens(checkpoints, graphs: bool) -> None:
    """The CUDA path's host -> device packing (one staging buffer, one copy, views per tensor, the metadata rebuilt
    around them), run on CPU: the same tokens as tensors built in place."""
    prompts, params = workload()
    path = checkpoints["gemma3_mqa_sliding"]
    plain = LLM(engine=make_engine(path)).generate(prompts, params, use_tqdm=False)
    engine = make_engine(path, max_num_batched_tokens=16)  # chunked prefill mixed with decodes: eager steps too
    engine.core.runner.transfer = HostToDevice(CPU, staged=True)
    used = with_graphs(engine) if graphs else []
    staged = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in staged] == [o.outputs[0].token_ids for o in plain]
    assert bool(used) == graphs


def test_a_backend_that_reads_the_python_lists_is_caught_by_the_frozen_metadata(checkpoints) -> None:
    """The reference backend loops over seq_lens_cpu, which a graph freezes at capture: the CPU stand-in keeps that
    metadata frozen too, so such a backend gives other tokens here, as it would on a GPU (hence
    cuda_graphs.CUDA_GRAPH_BACKENDS)."""
    prompts, params = workload()
    path = checkpoints["llama_gqa"]
    eager = LLM(engine=make_engine(path, reference_attention)).generate(prompts, params, use_tqdm=False)
    engine = make_engine(path, reference_attention)
    with_graphs(engine)
    graphed = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphed] != [o.outputs[0].token_ids for o in eager]


def test_on_cpu_the_default_backend_is_cpu_and_no_graphs_are_built(checkpoints) -> None:
    engine = LLMEngine.from_config(EngineConfig(model=str(checkpoints["llama_gqa"]), num_gpu_blocks_override=64))
    assert engine.config.attention_backend == "cpu" and engine.core.runner.graphs is None


def test_a_batch_larger_than_every_graph_runs_eagerly(checkpoints) -> None:
    engine = make_engine(checkpoints["llama_gqa"])
    used = with_graphs(engine)
    assert engine.core.runner.graphs is not None
    engine.core.runner.graphs.sizes = [1, 2]  # the 4 and 8 graphs stay captured but are never chosen
    prompts, params = workload()
    LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    assert set(used) == {1, 2}


class FakeMemory:
    """DeviceMemory with scripted counters: 1 GB allocated before the profile, a 3 GB peak during it."""

    def __init__(self) -> None:
        self.resets = 0

    def total_and_free(self) -> tuple[int, int]:
        return 80_000_000_000, 60_000_000_000

    def allocated(self) -> int:
        return 1_000_000_000

    def reserved(self) -> int:
        return 15_000_000_000

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_allocated(self) -> int:
        return 4_000_000_000


def test_the_profile_runs_the_largest_step_and_reads_the_device_counters(checkpoints) -> None:
    engine = make_engine(checkpoints["gemma3_mqa_sliding"])
    model = engine.core.runner.model
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    head_rows: list[int] = []
    compute_logits = model.compute_logits

    def spy(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        head_rows.append(hidden.shape[0])
        return compute_logits(hidden, out)

    model.compute_logits = spy  # type: ignore[method-assign]
    memory = FakeMemory()
    try:
        facts = profile_gpu_memory(model, engine.core.kv_config, 50, 6, CPU, memory)
    finally:
        hook.remove()
        del model.compute_logits
    assert rows == [50] and head_rows == [6] and memory.resets == 1
    assert facts.weights == weight_bytes(model) > 0
    assert facts.peak_activations == 3_000_000_000 and facts.total == 80_000_000_000
    assert facts.non_torch == 80_000_000_000 - 60_000_000_000 - 15_000_000_000
