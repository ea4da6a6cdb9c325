"""8-bit KV through the whole engine on tiny random checkpoints: greedy outputs pass vLLM's
check_logprobs_close rule against float32 KV, prefix hits / preemption / chunking behave as without
quantization, and the budget buys ~4x the blocks of float32."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_engine

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

TOP = 5
QUANT = ["fp8_e4m3", "fp8_e5m2", "int8"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [[2] + torch.randint(4, 256, (k,), generator=g).tolist() for k in lengths]


def tops_of(completion) -> list[dict]:
    return [dict.fromkeys(sorted(e, key=lambda t: e[t].rank)[: TOP + 1]) for e in completion.logprobs]


def generate(engine: LLMEngine, batch: list[list[int]]) -> list:
    return [o.outputs[0] for o in LLM(engine=engine).generate(batch, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def float32_outputs(checkpoints) -> dict[str, list]:
    return {v: generate(tiny_engine(p, kv_cache_dtype="float32"), prompts(6, seed=11)) for v, p in checkpoints.items()}


@pytest.mark.parametrize("kv_dtype", QUANT + ["bfloat16"])
@pytest.mark.parametrize("variant", ["llama_gqa", "gemma3_mqa_sliding"])
def test_greedy_close_to_float32_kv(checkpoints, float32_outputs, variant, kv_dtype):
    engine = tiny_engine(checkpoints[variant], kv_cache_dtype=kv_dtype)
    for ref, got in zip(float32_outputs[variant], generate(engine, prompts(6, seed=11))):
        assert len(got.token_ids) == 16
        assert_logprobs_close(ref.token_ids, tops_of(ref), got.token_ids, tops_of(got), name=f"{variant} {kv_dtype}")
    engine.check_invariants()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks


@pytest.mark.parametrize(
    "kv_dtype,engine_kw",
    [
        ("fp8", dict(max_num_batched_tokens=7)),
        ("int8", dict(num_gpu_blocks_override=60, max_model_len=64)),  # one-layer blocks: see test_engine_tiny
        ("fp8_e5m2", dict(attention_backend="reference")),
    ],
    ids=["fp8-chunked", "int8-preempt", "e5m2-reference-attn"],
)
def test_quantized_output_independent_of_batching(checkpoints, kv_dtype, engine_kw):
    """Scales are per token, so a block's bytes do not depend on how it was filled: prefix hits, chunking
    and recompute after preemption reproduce what each prompt produces alone in the same 8-bit dtype."""
    path = checkpoints["gemma3_mqa_sliding"]
    batch = prompts(10, seed=2)
    batch[5] = batch[3][:20] + batch[5]  # shared prefixes exercise prefix-cache hits
    batch[9] = batch[3][:25]
    alone_engine = tiny_engine(path, kv_cache_dtype=kv_dtype)
    alone = [generate(alone_engine, [p])[0] for p in batch]
    engine = tiny_engine(path, kv_cache_dtype=kv_dtype, **engine_kw)
    for a, c in zip(alone, generate(engine, batch)):
        assert_logprobs_close(a.token_ids, tops_of(a), c.token_ids, tops_of(c), name=f"{kv_dtype} {engine_kw}")
    if "num_gpu_blocks_override" in engine_kw:
        assert engine.core.scheduler.num_preemptions > 0
    engine.check_invariants()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks


def test_prefix_hit_equals_miss_with_int8(checkpoints):
    llm = LLM(engine=tiny_engine(checkpoints["llama_gqa"], kv_cache_dtype="int8"))
    p = prompts(1, seed=3)[0] + list(range(10, 30))
    first = llm.generate([p], GREEDY, use_tqdm=False)[0]
    second = llm.generate([p], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_budget_buys_4x_blocks_and_startup_log_says_so(checkpoints, caplog):
    path = checkpoints["llama_gqa"]
    blocks = {}
    with caplog.at_level(logging.INFO, logger="kvserve"):
        for kv_dtype in ("float32", "bfloat16", "fp8", "int8"):
            blocks[kv_dtype] = tiny_engine(
                path, kv_cache_dtype=kv_dtype, num_gpu_blocks_override=None, kv_cache_memory_bytes=4 << 20
            ).core.cache_plan.num_blocks
    # 2 layers x 2 KV heads x (K, V) x head_dim 16: 64 elements a token; 8-bit adds a 4-byte scale per head
    # vector, a fifth of it at head_dim 16 (1.6% at Gemma's 256), so 3.2x float32 here and 3.94x there.
    per_token = {"float32": 2 * 2 * 2 * 16 * 4, "bfloat16": 2 * 2 * 2 * 16 * 2, "fp8": 2 * 2 * 2 * (16 + 4)}
    for kv_dtype, nbytes in per_token.items():
        assert blocks[kv_dtype] == (4 << 20) // (nbytes * 4), kv_dtype
    assert blocks["int8"] == blocks["fp8"]
    assert f"KV cache dtype fp8_e4m3: {blocks['fp8']} blocks" in caplog.text
    assert f"KV cache dtype int8: {blocks['int8']} blocks" in caplog.text


def _with_static_kv_scales(src: Path, dst: Path, layers: range, scale: float) -> Path:
    """A copy of a checkpoint carrying per-tensor fp8 KV scales, named as vLLM / llm-compressor write them."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for i in layers:
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scale)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(scale * 2)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_static_fp8_scales_are_used(checkpoints, float32_outputs, tmp_path):
    path = _with_static_kv_scales(checkpoints["llama_gqa"], tmp_path / "static", range(2), 0.02)
    engine = tiny_engine(path, kv_cache_dtype="fp8")
    outs = generate(engine, prompts(6, seed=11))
    for ref, got in zip(float32_outputs["llama_gqa"], outs):
        assert_logprobs_close(ref.token_ids, tops_of(ref), got.token_ids, tops_of(got), name="static fp8")
    cache = engine.core.runner.kv_caches[0]
    used = cache.key_scale.view(-1)[cache.key_scale.view(-1) != 1.0]  # slots written (scales start at 1)
    assert used.numel() > 0 and torch.all(used == 0.02)
    assert torch.all(cache.value_scale.view(-1)[cache.value_scale.view(-1) != 1.0] == 0.04)
    # Another 8-bit format computes its own per-token scales: the fp8 calibration does not apply to it.
    int8 = tiny_engine(path, kv_cache_dtype="int8")
    generate(int8, prompts(2, seed=12))
    written = int8.core.runner.kv_caches[0].key_scale.view(-1)
    assert len(set(written[written != 1.0].tolist())) > 1


def test_partial_static_kv_scales_are_a_clear_error(checkpoints, tmp_path):
    path = _with_static_kv_scales(checkpoints["llama_gqa"], tmp_path / "partial", range(1), 0.02)
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_scale"):
        tiny_engine(path, kv_cache_dtype="fp8")
