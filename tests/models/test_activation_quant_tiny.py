"""`--activation-quantization int8` on tiny GGUF files (Q8_0 matrices, test_gguf.write_gguf): the native decoder
layers with int8 activations equal the torch layers with the same quantization (kernels/activation_quant.py:
the torch definition), over a paged cache, prefill and decode steps; the result is not the exact path's (the
flag does something) but stays close to HF transformers' float32 logits; and the flag is refused where it cannot
apply.

Tolerances: native int8 against torch int8, the same numbers summed in another order: atol = rtol = 1e-4, as
the exact GGUF path against HF. int8 against HF's float32: max |logit difference| < 0.05 of the logits' spread
(8-bit activations on random tiny weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gguf import ATOL, GGUF_VARIANTS, RTOL, tiny_gguf
from tiny_models import PagedDriver, hf_logits

from kvserve.config import EngineConfig
from kvserve.kernels.native import cpu_supports_native
from kvserve.kernels.ops import TorchKernels
from kvserve.model import loader
from kvserve.model.source import ModelFormat, ModelSource


def _logits(model, ids: list[int]) -> torch.Tensor:
    driver = PagedDriver(model, [ids], block_size=2)
    return torch.cat([driver.step({0: 25})[0], *(driver.step({0: 1})[0] for _ in range(5))])


@pytest.mark.parametrize("variant_name", sorted(GGUF_VARIANTS))
def test_int8_activations_native_equal_torch_and_stay_near_hf(variant_name: str, tmp_path: Path) -> None:
    hf, source = tiny_gguf(variant_name, tmp_path)
    model = loader.load_model(
        source,
        torch.float32,
        torch.device("cpu"),
        cache_dir=tmp_path / "cache",
        quantization="gguf",
        activation_quantization="int8",
    ).model
    assert model.kernels.activation_quantization == "int8"
    ids = [1] + [(7 * i) % 250 + 3 for i in range(29)]
    got = _logits(model, ids)
    if cpu_supports_native()[0]:
        assert model.native_layers is not None, "the native decoder layers run int8 activations too"
    model.use_kernels(TorchKernels(activation_quantization="int8"))
    torch.testing.assert_close(_logits(model, ids), got, atol=ATOL, rtol=RTOL)
    ref = hf_logits(hf, ids)
    spread = float(ref.max() - ref.min())
    assert float((got - ref).abs().max()) < 0.05 * spread
    assert not torch.allclose(got, ref, atol=1e-5, rtol=0), "int8 activations must differ from the exact path"


def test_int8_activations_need_gguf_blocks_on_the_cpu(tmp_path: Path) -> None:
    source = ModelSource(ModelFormat.HF, tmp_path, "some-hf-checkpoint")
    with pytest.raises(ValueError, match="needs --quantization gguf on the CPU"):
        loader.load_model(
            source,
            torch.float32,
            torch.device("cpu"),
            cache_dir=tmp_path,
            quantization="q8_0",
            activation_quantization="int8",
        )
    with pytest.raises(ValueError, match="--activation-quantization must be one of none, int8"):
        EngineConfig(activation_quantization="int4")
    with pytest.raises(ValueError, match="--kernel-isa must be one of"):
        EngineConfig(kernel_isa="neon")
