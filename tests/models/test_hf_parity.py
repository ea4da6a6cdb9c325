"""Our decoder vs HF transformers' own modeling code on tiny random checkpoints, through the paged cache.

Tolerance: fp32 everywhere, logits compared with atol = rtol = 1e-4 (differences are summation order only).
Caches start as NaN and block tables are shuffled, so any read of an unwritten slot or a wrong block shows.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny_models import TINY_VARIANTS, PagedDriver, hf_logits

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model, load_model_config
from kvserve.model.source import ModelFormat, ModelSource

ATOL = RTOL = 1e-4
PROMPT_LEN = 40
BACKENDS = ["cpu", "reference"]


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 256) for _ in range(n - 1)]


def _load(path, backend: str):  # type: ignore[no-untyped-def]
    source = ModelSource(ModelFormat.HF, path, path.name)
    return load_model(source, torch.float32, torch.device("cpu"), attention_backend=backend).model


@pytest.fixture(params=sorted(TINY_VARIANTS))
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_prompt_chunked_and_decode(variant: str, backend: str, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    path, hf = tiny_checkpoint(variant)
    model = _load(path, backend)
    a, b, c = _prompt(1), _prompt(2), _prompt(3)
    ref = {i: hf_logits(hf, s) for i, s in enumerate((a, b, c))}

    # (a) a whole prompt in one step (longer than every sliding window)
    whole = PagedDriver(model, [a]).step({0: PROMPT_LEN})[0]
    torch.testing.assert_close(whole, ref[0], atol=ATOL, rtol=RTOL)

    # (b) + (c) one flat batch per step mixing: seq 0 prefilled whole then decoded one token at a time
    # (teacher-forced), seq 1 prefilled in chunks of 7, seq 2 decoding from a 5-token prompt.
    driver = PagedDriver(model, [a, b, c], block_size=4, seed=7)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    plan = {0: 20, 2: 5}
    while plan:
        for i, logits in driver.step(plan).items():
            got[i].append(logits)
        plan = {}
        for i in range(3):
            left = PROMPT_LEN - driver.done[i]
            if left:
                plan[i] = min(7, left) if i == 1 else 1
    for i in range(3):
        torch.testing.assert_close(torch.cat(got[i]), ref[i], atol=ATOL, rtol=RTOL, msg=f"sequence {i}")


def test_backends_agree_on_decode_steps(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Batched decode of sequences of different lengths: cpu path == reference path."""
    path, _ = tiny_checkpoint("gemma3_mqa_sliding")
    seqs = [_prompt(4, 30), _prompt(5, 11), _prompt(6, 19)]
    outs = []
    for backend in BACKENDS:
        driver = PagedDriver(_load(path, backend), seqs, block_size=2, seed=3)
        driver.step({0: 25, 1: 6, 2: 14})
        outs.append(torch.cat([torch.cat(list(driver.step({0: 1, 1: 1, 2: 1}).values())) for _ in range(5)]))
    torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=RTOL)


def test_sharded_checkpoint_and_generation_config(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    from transformers import GenerationConfig

    path, hf = tiny_checkpoint("qwen2_gqa", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, eos_token_id=[2, 5]).save_pretrained(path)
    config = load_model_config(ModelSource(ModelFormat.HF, path, "x"))
    assert config.generation_defaults["temperature"] == 0.7
    assert config.eos_token_ids == [2, 5]
    ids = _prompt(8)
    got = PagedDriver(_load(path, "cpu"), [ids]).step({0: len(ids)})[0]
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_config_fields(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint("gemma3_mqa_sliding")
    c = ModelConfig.from_hf_dir(path)
    assert (c.family, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == ("gemma3", 1, 32, True)
    assert c.sliding_windows == [8, None, 8]
    assert c.rope_thetas == [100.0, 10000.0, 100.0]
    assert c.attention_scale == pytest.approx(24**-0.5)
    assert c.final_logit_softcapping == 30.0
    path, _ = tiny_checkpoint("llama_mqa_bias_llama3rope")
    c = ModelConfig.from_hf_dir(path)
    assert c.rope_scaling["rope_type"] == "llama3" and c.attention_bias and c.attention_out_bias


def test_transformers4_style_gemma3_config() -> None:
    """Older config.json layout: rope_theta / rope_local_base_freq / sliding_window_pattern."""
    c = ModelConfig.from_hf_dict(
        dict(
            model_type="gemma3_text",
            vocab_size=10,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=7,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        )
    )
    assert c.sliding_windows == [512] * 5 + [None, 512]
    assert c.rope_thetas == [1e4] * 5 + [1e6, 1e4]
    assert c.rope_scalings[5] == {"rope_type": "linear", "factor": 8.0} and c.rope_scalings[0] is None


def test_unsupported_rope_scaling_is_a_clear_error() -> None:
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelConfig.from_hf_dict(
            dict(
                model_type="llama",
                vocab_size=10,
                hidden_size=8,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                rope_scaling={"rope_type": "yarn", "factor": 4.0},
            )
        )


# -- malformed checkpoints ---------------------------------------------------------------------------
@pytest.fixture
def llama_dir(tiny_checkpoint):  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama_gqa")[0]


def _load_error(path) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as info:
        _load(path, "cpu")
    return str(info.value)


def test_missing_safetensors(llama_dir) -> None:  # type: ignore[no-untyped-def]
    (llama_dir / "model.safetensors").unlink()
    assert "no *.safetensors" in _load_error(llama_dir)


def test_bad_config_json(llama_dir) -> None:  # type: ignore[no-untyped-def]
    (llama_dir / "config.json").write_text("{not json")
    msg = _load_error(llama_dir)
    assert "config.json" in msg and "not valid JSON" in msg


def test_config_missing_field(llama_dir) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads((llama_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(llama_dir)
    assert "config.json" in msg and "hidden_size" in msg


def test_corrupt_safetensors(llama_dir) -> None:  # type: ignore[no-untyped-def]
    (llama_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    assert "model.safetensors" in _load_error(llama_dir)


def test_index_names_missing_shard(llama_dir) -> None:  # type: ignore[no-untyped-def]
    (llama_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    msg = _load_error(llama_dir)
    assert "model-00002-of-00002.safetensors" in msg and "missing" in msg


def test_checkpoint_missing_tensor(llama_dir) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, llama_dir / "model.safetensors")
    assert "layers.1.self_attn.qkv_proj.weight" in _load_error(llama_dir)


def test_resolve_dtype() -> None:
    from kvserve.model.loader import resolve_dtype

    cfg = ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            vocab_size=10,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            torch_dtype="bfloat16",
        )
    )
    assert resolve_dtype("auto", torch.device("cpu"), cfg) == torch.float32
    assert resolve_dtype("bfloat16", "cpu", cfg) == torch.bfloat16
    assert resolve_dtype("float16", "cpu", cfg) == torch.float16
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", "cpu", cfg)


def test_bfloat16_runs_close_to_float32(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Smoke test of the reduced-precision path (norms and softmax stay float32): cosine > 0.999."""
    path, hf = tiny_checkpoint("gemma3_mqa_sliding")
    source = ModelSource(ModelFormat.HF, path, path.name)
    model = load_model(source, torch.bfloat16, torch.device("cpu")).model
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.float32
    ids = _prompt(9)
    driver = PagedDriver(model, [ids], kv_dtype=torch.bfloat16)
    got = torch.cat([driver.step({0: 30})[0]] + [driver.step({0: 1})[0] for _ in range(10)])
    ref = hf_logits(hf, ids)
    assert got.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.999
