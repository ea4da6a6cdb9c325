"""The native layer path (kernels/decoder_layer.cpp: one call per decoder layer) against the torch modules, the
reference, on tiny random checkpoints: teacher-forced logits of ragged steps (prefill chunks over a cached
prefix, decodes, several query rows per sequence as in speculative verification, mixed in one step) agree to
float32 summation order (atol = rtol = 1e-4; both paths run the same kernels, so the differences are the float32
matmul's and the order of residual additions), with float32, q8_0 and GGUF-block weights; greedy tokens through
the engine are identical; what the C++ does not cover falls back to the torch path."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gguf import GGUF_VARIANTS, write_gguf
from tiny_models import STATE_VARIANTS, TINY_VARIANTS, PagedDriver, build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kernels.native import cpu_supports_native
from kvserve.kernels.ops import TorchKernels
from kvserve.kv.cache import KVCacheConfig, LayerKVCache, allocate_kv_cache
from kvserve.model.decoder import DecoderModel
from kvserve.model.loader import load_model
from kvserve.model.native_layer import FLOAT32_MAX_ROWS
from kvserve.model.source import ModelFormat, ModelSource
from kvserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_supports_native()[0], reason=cpu_supports_native()[1])

ATOL = RTOL = 1e-4
# Ragged steps over four sequences (index -> new tokens): whole prompts, chunks after a cached prefix, decodes,
# multi-token verification rows, and steps where all rows are decodes (the decode kernel's direct path).
PLAN = [
    {0: 9, 1: 5},
    {1: 6, 2: 11, 0: 1},
    {0: 1, 1: 1, 2: 1},
    {3: 7, 0: 3, 1: 1},
    {0: 1, 1: 1, 2: 1, 3: 1},
    {2: 4, 3: 1},
    {3: 2, 0: 1},
]


def _sequences(n: int = 4, length: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1, *torch.randint(3, 256, (length - 1,), generator=g).tolist()] for _ in range(n)]


def _load(path: Path, quantization: str, fmt: ModelFormat = ModelFormat.HF) -> DecoderModel:
    source = ModelSource(fmt, path, path.stem)
    return load_model(
        source, torch.float32, torch.device("cpu"), cache_dir=path.parent / "cache", quantization=quantization
    ).model


def _teacher_forced(
    model: DecoderModel, seqs: list[list[int]], kv_dtype: torch.dtype = torch.float32, static_scales: bool = False
) -> list[dict[int, torch.Tensor]]:
    driver = PagedDriver(model, seqs, block_size=4)
    if kv_dtype != torch.float32:  # a cache of another element type (8-bit ones with scales), of the driver's shape
        c = model.config
        spec = KVCacheConfig(c.num_layers, c.num_kv_heads, c.head_dim, 4, kv_dtype)
        driver.kv = allocate_kv_cache(spec, driver.kv[0].key.shape[0], torch.device("cpu"))
        for cache in driver.kv:
            if static_scales:  # a checkpoint's calibrated fp8 scales (kv/cache.py use_static_kv_scales)
                cache.static_key_scale, cache.static_value_scale = 0.05, 0.05
    return [driver.step(plan) for plan in PLAN]


def _float32_caches(model: DecoderModel) -> list[LayerKVCache]:
    return PagedDriver(model, _sequences()).kv


def _assert_paths_agree(native: DecoderModel, reference: DecoderModel) -> None:
    reference.use_torch_layers()
    seqs = _sequences()
    got, want = _teacher_forced(native, seqs), _teacher_forced(reference, seqs)
    assert native.native_layers is not None, "the native layer path was not chosen"
    for step, (g, w) in enumerate(zip(got, want)):
        for i in w:
            where = f"step {step} seq {i}"
            torch.testing.assert_close(g[i], w[i], atol=ATOL, rtol=RTOL, msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.parametrize("quantization", ["none", "q8_0"])
@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS.keys() - STATE_VARIANTS))
def test_native_layers_equal_torch_layers(variant: str, quantization: str, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint(variant)
    _assert_paths_agree(_load(path, quantization), _load(path, quantization))


@pytest.mark.parametrize("variant_name", sorted(GGUF_VARIANTS))
def test_native_layers_on_gguf_blocks(variant_name: str, tmp_path: Path) -> None:
    variant, overrides = GGUF_VARIANTS[variant_name]
    arch = variant_name.split("_")[0]
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(build_tiny_hf_model(variant, **overrides), path, arch)
    _assert_paths_agree(_load(path, "gguf", ModelFormat.GGUF), _load(path, "gguf", ModelFormat.GGUF))


def test_torch_path_where_the_native_layer_does_not_reach(tiny_checkpoint, caplog) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint("gemma3_mqa_sliding")
    with caplog.at_level(logging.INFO):  # the loader chooses the layer path and logs it
        model = _load(path, "q8_0")
    seqs = _sequences()
    want = _teacher_forced(model, seqs)
    assert model.native_layers is not None and model.native_layers.max_rows is None
    assert any("one native call per layer" in r.message for r in caplog.records)
    # float32 weights: steps of more rows than FLOAT32_MAX_ROWS run the torch modules (MKL is faster there)
    float32 = _load(path, "none").choose_layer_path()
    assert float32 is not None and float32.max_rows == FLOAT32_MAX_ROWS
    assert float32.takes(_float32_caches(model), FLOAT32_MAX_ROWS)
    assert not float32.takes(_float32_caches(model), FLOAT32_MAX_ROWS + 1)
    # An fp8 KV cache with a checkpoint's static scales: its steps run the torch modules, the choice stays native.
    _teacher_forced(model, seqs, kv_dtype=torch.float8_e4m3fn, static_scales=True)
    assert model.native_layers is not None and model.native_layers.warned_cache
    # The torch kernels: no native layer at all, and the same logits.
    model.use_kernels(TorchKernels())
    got = _teacher_forced(model, seqs)
    assert model.native_layers is None and model.layer_path_chosen
    for g, w in zip(got, want):
        for i in w:
            torch.testing.assert_close(g[i], w[i], atol=ATOL, rtol=RTOL)


def _engine_run(
    path: Path, prompts: list[list[int]], params: SamplingParams, native: bool, quantization: str, num_blocks: int
) -> tuple[LLMEngine, dict[str, Any]]:
    """Every prompt's completion through an engine with chunked prefill (8 tokens a step, decodes of other requests
    in the same steps), on the native layer path or the torch modules; the pool checked after every step."""
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(path),
            quantization=quantization,
            block_size=4,
            num_gpu_blocks_override=num_blocks,
            max_num_batched_tokens=8,
            max_num_seqs=4,
        )
    )
    model = engine.core.runner.model
    if not native:
        model.use_torch_layers()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        engine.check_invariants()
    assert (model.native_layers is not None) == native
    return engine, done


@pytest.mark.parametrize("variant", ["llama_mqa_bias_llama3rope", "gemma3_mqa_sliding"])
def test_engine_greedy_tokens_equal_torch_layers(variant: str, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Chunked prefill (8 tokens a step) with decodes of other requests in the same steps, through the engine."""
    path, _ = tiny_checkpoint(variant)
    write_char_tokenizer(path)
    prompts = _sequences(5, 21)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for native in (True, False):
        _, done = _engine_run(path, prompts, params, native, "q8_0", 128)
        outputs.append({rid: list(c.token_ids) for rid, c in done.items()})
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    "kv_dtype",
    [torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=["bf16", "f16", "int8", "fp8_e4m3", "fp8_e5m2"],
)
@pytest.mark.parametrize("variant", ["gemma3_mqa_sliding", "qwen2_gqa"])
def test_every_kv_dtype_runs_natively(variant: str, kv_dtype: torch.dtype, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """16-bit and 8-bit KV caches: every step (prefill chunks over a cached prefix, verification rows, decodes) runs
    the native layer, which writes each token's K/V as the torch path's store does (kvserve/kv/quant.py; the writer
    alone is compared bit for bit in tests/unit/test_kv_dtype_kernels.py) and reads the cache in place. Logits agree
    with the torch path to float32 summation order."""
    path, _ = tiny_checkpoint(variant)
    native, reference = _load(path, "q8_0"), _load(path, "q8_0")
    reference.use_torch_layers()
    seqs = _sequences()
    caches, logits = [], []
    for model in (native, reference):
        driver = PagedDriver(model, seqs, block_size=4)
        c = model.config
        spec = KVCacheConfig(c.num_layers, c.num_kv_heads, c.head_dim, 4, kv_dtype)
        driver.kv = allocate_kv_cache(spec, driver.kv[0].key.shape[0], torch.device("cpu"))
        for cache in driver.kv:  # allocated empty: zero the slots no step writes, so that the caches compare
            cache.key.view(torch.uint8).zero_(), cache.value.view(torch.uint8).zero_()
        logits.append([driver.step(plan) for plan in PLAN])
        caches.append(driver.kv)
    assert native.native_layers is not None and not native.native_layers.warned_cache
    assert native.native_layers.takes(caches[0], 4)
    for step, (g, w) in enumerate(zip(*logits)):
        for i in w:
            torch.testing.assert_close(g[i], w[i], atol=ATOL, rtol=RTOL, msg=lambda m, s=step: f"step {s}: {m}")
    # The tokens in the same codes and scales, but for summation order: K and V themselves may differ in the last
    # bit between the paths, and then their codes by one
    bits = torch.int16 if kv_dtype.itemsize == 2 else torch.int8
    for got, want in zip(*caches):
        for g, w in ((got.key, want.key), (got.value, want.value)):
            differ = (g.view(bits).int() - w.view(bits).int()).abs()
            assert differ.max() <= 1 and differ.bool().float().mean() < 0.01
        if kv_dtype.itemsize == 1:
            torch.testing.assert_close(got.key_scale, want.key_scale, rtol=1e-6, atol=0)
            torch.testing.assert_close(got.value_scale, want.value_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("quantization", ["none", "q8_0"])
@pytest.mark.parametrize("variant", sorted(STATE_VARIANTS))
def test_hybrid_layers_run_natively_as_the_torch_modules(variant: str, quantization: str, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Hybrid models' state layers run one native call each, as their attention layers do: LFM2's short
    convolutions (kvserve_short_conv_layer) and Qwen3.5's Gated DeltaNet (kvserve_gated_deltanet_layer), each
    sequence's states in its slots, and Qwen3.5's gated attention with partial rope on the native decoder layer.
    Through the engine, with chunked prefill (8 tokens a step) beside other requests' decodes, state snapshots
    restored for prompts sharing a prefix, and preemption on a small pool, greedy tokens equal the torch modules'
    and top logprobs agree within 1e-4."""
    path, _ = tiny_checkpoint(variant)
    write_char_tokenizer(path)
    shared = _sequences(1, 14)[0]
    prompts = [shared + p[1:] for p in _sequences(5, 21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = []
    for native in (True, False):
        engine, done = _engine_run(path, prompts, params, native, quantization, 24)
        assert engine.core.stats().state_snapshots_restored > 0
        results.append((done, engine.core.scheduler.num_preemptions))
    (got, preempted), (want, _) = results
    assert preempted > 0
    for rid, completion in want.items():
        assert list(got[rid].token_ids) == list(completion.token_ids)
        for g, w in zip(got[rid].logprobs, completion.logprobs):
            for token, entry in w.items():
                assert abs(g[token].logprob - entry.logprob) < 1e-4
