"""--quantization q8_0 on tiny random checkpoints.

Exactness: the quantized model equals the float32 model whose weights were replaced by their q8_0 round trip
(atol = rtol = 1e-4, summation order only), with the compiled kernel and with the torch one, so the module swap,
the tied LM head and the kernels are right. Closeness to the unquantized model is judged by vLLM's
check_logprobs_close rule through the whole engine, and the block pool is whole afterwards."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import TINY_VARIANTS, PagedDriver
from tiny_tokenizer import write_char_tokenizer

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kernels.ops import TorchKernels, load_kernels
from kvserve.kernels.q8 import dequantize_q8, quantize_q8
from kvserve.model.loader import load_model
from kvserve.model.quantization import Q8Embedding, Q8Linear, quantize_model, weight_bytes
from kvserve.model.source import ModelFormat, ModelSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

ATOL = RTOL = 1e-4
TOP = 5


def _load(path: Path, quantization: str = "none"):  # type: ignore[no-untyped-def]
    source = ModelSource(ModelFormat.HF, path, path.name)
    return load_model(
        source, torch.float32, torch.device("cpu"), quantization=quantization, cache_dir=path.parent / "cache"
    ).model


def _fake_quantize(model: torch.nn.Module) -> None:
    """float32 weights replaced by their q8_0 round trip: what the quantized model must compute."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight.shape[1] % 32 == 0:
            module.weight.data.copy_(dequantize_q8(*quantize_q8(module.weight)))


def _prompt(seed: int, n: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 256) for _ in range(n - 1)]


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_q8_model_equals_fake_quantized_float_model(variant: str, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint(variant)
    reference = _load(path)
    _fake_quantize(reference)
    native = _load(path, "q8_0")
    fallback = _load(path)
    fallback.use_kernels(TorchKernels())
    quantize_model(fallback, "q8_0", TorchKernels())
    assert any(isinstance(m, Q8Linear) for m in native.modules())
    assert isinstance(native.embed_tokens, Q8Embedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in native.modules())  # every layer here is 32-aligned
    assert weight_bytes(native) < weight_bytes(reference) / 2.5
    seqs = [_prompt(1, 32), _prompt(2, 11)]  # teacher-forced: 2 more tokens than the prompt step
    plan = [{0: 30, 1: 9}, {0: 1, 1: 1}, {0: 1, 1: 1}]
    drivers = [PagedDriver(m, seqs) for m in (reference, native, fallback)]
    for step in plan:
        ref, *others = [d.step(step) for d in drivers]
        for got in others:
            for i in step:
                torch.testing.assert_close(got[i], ref[i], atol=ATOL, rtol=RTOL)


def test_unaligned_layers_stay_float() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 40))
    assert quantize_model(model, "q8_0", TorchKernels()) == 1
    assert isinstance(model[0], Q8Linear) and isinstance(model[1], torch.nn.Linear)
    x = torch.randn(3, 64)
    assert model(x).shape == (3, 40)


def test_q8_linear_keeps_bias_and_dtype() -> None:
    linear = torch.nn.Linear(32, 6, bias=True)
    q8 = Q8Linear.from_linear(linear, TorchKernels())
    x = torch.randn(2, 5, 32)
    ref = torch.nn.functional.linear(x, dequantize_q8(q8.qweight, q8.scales), linear.bias)
    torch.testing.assert_close(q8(x), ref, atol=1e-5, rtol=1e-5)
    assert q8(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_auto_is_gguf_blocks_for_gguf_on_cpu_only() -> None:
    from kvserve.capacity import resolve_quantization

    assert resolve_quantization("auto", "cpu", "gguf") == "gguf"
    assert resolve_quantization("auto", "cpu", "hf") == "none"
    assert resolve_quantization("auto", "cuda", "gguf") == "none"
    assert resolve_quantization("none", "cpu", "gguf") == "none"


def test_hf_checkpoint_keeps_float_weights_by_default(gemma_checkpoint: Path) -> None:
    engine = LLMEngine.from_config(EngineConfig(model=str(gemma_checkpoint), num_gpu_blocks_override=8))
    assert engine.config.quantization == "none"
    assert not any(isinstance(m, Q8Linear) for m in engine.core.runner.model.modules())


def test_unknown_method_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="--quantization must be one of auto, none, q8_0"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="--quantization"):
        quantize_model(torch.nn.Linear(32, 2), "int4", TorchKernels())


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory) -> Path:
    from tiny_models import build_tiny_hf_model

    path = tmp_path_factory.mktemp("gemma3_mqa_sliding")
    build_tiny_hf_model("gemma3_mqa_sliding").save_pretrained(path)
    write_char_tokenizer(path)
    return path


def test_engine_q8_close_to_float_and_pool_whole(gemma_checkpoint: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP)
    prompts = [_prompt(s, n) for s, n in ((3, 5), (4, 20), (5, 37))]

    def run(quantization: str):  # type: ignore[no-untyped-def]
        engine = LLMEngine.from_config(
            EngineConfig(
                model=str(gemma_checkpoint), quantization=quantization, num_gpu_blocks_override=64, block_size=4
            )
        )
        outs = [o.outputs[0] for o in LLM(engine=engine).generate(prompts, params, use_tqdm=False)]
        engine.check_invariants()
        assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks
        return engine, outs

    def tops(c):  # type: ignore[no-untyped-def]
        return [dict.fromkeys(sorted(e, key=lambda t: e[t].rank)[:TOP]) for e in c.logprobs]

    _, ref = run("none")
    engine, got = run("q8_0")
    for i, (a, b) in enumerate(zip(ref, got)):
        assert_logprobs_close(a.token_ids, tops(a), b.token_ids, tops(b), name=f"prompt {i}")
    with pytest.raises(ValueError, match="cannot change quantization"):
        engine.sibling(quantization="none")


def test_kernel_cache_dir_is_used(tmp_path: Path) -> None:
    kernels = load_kernels(tmp_path / "k")
    if kernels.name == "native":
        assert list((tmp_path / "k").glob("kvserve_kernels_*.so"))


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
@pytest.mark.parametrize("quantization", ["none", "q8_0"])
def test_logits_into_a_reused_buffer(variant: str, quantization: str, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """compute_logits(out=buffer) (the runner's per-step buffer) equals a fresh computation, tied or untied head,
    and a buffer of the wrong shape is not used."""
    path, _ = tiny_checkpoint(variant)
    model = _load(path, quantization)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = model.compute_logits(hidden)
    buffer = torch.full((3, want.shape[1]), float("nan"))
    got = model.compute_logits(hidden, out=buffer)
    assert got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    wrong = torch.empty(3, want.shape[1] + 1)
    torch.testing.assert_close(model.compute_logits(hidden, out=wrong), want, atol=1e-5, rtol=1e-5)
