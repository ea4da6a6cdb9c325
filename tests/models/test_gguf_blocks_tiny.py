"""--quantization gguf on tiny GGUF files (Q8_0 matrices, written as llama.cpp would by test_gguf.write_gguf):
the layers hold the file's blocks (llama's permuted Q/K rows un-permuted block-row by block-row, biases loaded
into the fused layers), and logits equal HF transformers' on the same dequantized weights, with the native kernels
and with the torch fallback; a safetensors checkpoint is refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gguf import ATOL, GGUF_VARIANTS, RTOL, tiny_gguf
from tiny_models import PagedDriver, hf_logits

from kvserve.bench.floor import model_cost
from kvserve.kernels.native import cpu_supports_native
from kvserve.kernels.ops import TorchKernels
from kvserve.model import loader
from kvserve.model.gguf_layers import GGUFEmbedding, GGUFLinear
from kvserve.model.source import ModelFormat, ModelSource


@pytest.mark.parametrize("variant_name", sorted(GGUF_VARIANTS))
def test_gguf_blocks_match_hf(variant_name: str, tmp_path: Path) -> None:
    hf, source = tiny_gguf(variant_name, tmp_path)
    loaded = loader.load_model(
        source, torch.float32, torch.device("cpu"), cache_dir=tmp_path / "cache", quantization="gguf"
    )
    model = loaded.model
    assert not list((tmp_path / "cache").glob("*/model.safetensors")), "the file's blocks need no float32 cache"
    if cpu_supports_native()[0]:
        assert isinstance(model.layers[0].self_attn.qkv_proj, GGUFLinear)
        assert isinstance(model.embed_tokens, GGUFEmbedding)
    if cpu_supports_native()[0]:  # packed blocks hold more weights than elements: the FLOP floor asks the layers
        dense = loader.load_model(
            source, torch.float32, torch.device("cpu"), cache_dir=tmp_path / "cache", quantization="none"
        )
        kv = 2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 4
        assert (
            model_cost(model, loaded.config, kv).matmul_params
            == model_cost(dense.model, dense.config, kv).matmul_params
        )
    ids = [1] + [(7 * i) % 250 + 3 for i in range(29)]
    ref = hf_logits(hf, ids)
    for kernels in (None, TorchKernels(slab_rows=64)):
        if kernels is not None:
            model.use_kernels(kernels)
        driver = PagedDriver(model, [ids], block_size=2)
        got = torch.cat([driver.step({0: 25})[0], *(driver.step({0: 1})[0] for _ in range(5))])
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_gguf_blocks_need_a_gguf_file(tmp_path: Path) -> None:
    source = ModelSource(ModelFormat.HF, tmp_path, "some-hf-checkpoint")
    with pytest.raises(ValueError, match="GGUF file's own quantized blocks"):
        loader.load_model(source, torch.float32, torch.device("cpu"), cache_dir=tmp_path, quantization="gguf")
