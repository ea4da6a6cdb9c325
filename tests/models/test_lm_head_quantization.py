"""--lm-head-quantization q4_0 on a tiny Gemma 3 GGUF (tied embeddings, Q8_0 in the file): the logits equal HF
transformers' with its LM head replaced by gguf-py's own Q4_0 round trip of the same weights (the input embedding
keeps the file's Q8_0), the per-step bytes the floor counts fall by the head's, and the option is refused, with a
clear message, wherever the head is not GGUF blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_gguf import ATOL, GGUF_VARIANTS, RTOL, write_gguf
from tiny_models import PagedDriver, build_tiny_hf_model, hf_logits

from kvserve.bench.floor import model_cost
from kvserve.config import EngineConfig
from kvserve.kernels.native import cpu_supports_native
from kvserve.model import loader
from kvserve.model.gguf_layers import GGUFEmbedding, GGUFLinear
from kvserve.model.source import ModelFormat, ModelSource

needs_native = pytest.mark.skipif(not cpu_supports_native()[0], reason=cpu_supports_native()[1])


def _tiny(arch: str, directory: Path) -> tuple[torch.nn.Module, ModelSource]:
    variant, overrides = GGUF_VARIANTS[arch]
    hf = build_tiny_hf_model(variant, **overrides)
    path = directory / f"tiny-{arch}.gguf"
    write_gguf(hf, path, arch)  # the HF model now holds the file's Q8_0 weights
    return hf, ModelSource(ModelFormat.GGUF, path, path.stem)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> tuple[torch.nn.Module, ModelSource]:
    return _tiny("gemma3", tmp_path_factory.mktemp("lm_head"))


def _load(source: ModelSource, tmp_path: Path, **kwargs):
    return loader.load_model(source, torch.float32, torch.device("cpu"), cache_dir=tmp_path, **kwargs)


@needs_native
@pytest.mark.parametrize("arch", ["gemma3", "llama"])  # a tied head (the embedding's blocks) and an untied one
def test_q4_0_head_matches_hf_with_the_same_head(arch: str, tmp_path: Path) -> None:
    hf, source = _tiny(arch, tmp_path)
    loaded = _load(source, tmp_path / "cache", quantization="gguf", lm_head_quantization="q4_0")
    if arch == "gemma3":
        embed = loaded.model.embed_tokens
        assert isinstance(embed, GGUFEmbedding) and embed.head_qweight is not None and "Q4_0" in repr(embed)
    else:
        assert isinstance(loaded.model.lm_head, GGUFLinear) and loaded.model.lm_head.qtypes == (2,)  # Q4_0
    weight = hf.lm_head.weight.detach().float().numpy()  # gemma: the tied embedding
    q4 = dequantize(quantize(weight, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    assert not np.array_equal(q4, weight)  # the head really changed, so the comparison below can fail
    hf.lm_head.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(q4)))  # unties it from the input
    ids = [1] + [(7 * i) % 250 + 3 for i in range(21)]
    driver = PagedDriver(loaded.model, [ids], block_size=4)
    got = torch.cat([driver.step({0: 18})[0], *(driver.step({0: 1})[0] for _ in range(4))])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


@needs_native
def test_q4_0_head_reads_fewer_bytes_a_step(tiny_gemma, tmp_path: Path) -> None:
    _, source = tiny_gemma
    file_head = _load(source, tmp_path, quantization="gguf")
    q4_head = _load(source, tmp_path, quantization="gguf", lm_head_quantization="q4_0")
    c = file_head.config
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    before, after = model_cost(file_head.model, c, kv), model_cost(q4_head.model, c, kv)
    embed = file_head.model.embed_tokens
    saved = embed.qweight.numel() - q4_head.model.embed_tokens.head_qweight.numel()  # uint8 blocks: bytes
    assert before.weight_bytes_per_step - after.weight_bytes_per_step == saved > 0
    assert before.matmul_params == after.matmul_params  # the same products, from other bytes


def test_q4_0_head_needs_gguf_blocks(tiny_gemma, tmp_path: Path) -> None:
    _, source = tiny_gemma
    with pytest.raises(ValueError, match="needs --quantization gguf"):
        _load(source, tmp_path, quantization="q8_0", lm_head_quantization="q4_0")


def test_unknown_head_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="--lm-head-quantization must be one of none, q4_0"):
        EngineConfig(lm_head_quantization="q2_k")
