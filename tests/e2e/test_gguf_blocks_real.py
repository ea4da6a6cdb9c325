"""--quantization gguf (what auto means for a GGUF file on CPU) on the default model (Gemma 3 270M Q4_K_M): every
quantized weight runs as the file's own blocks, so greedy output equals the stored HF transformers reference
(which computes on the file's dequantized weights) on every prompt, except at a near-tie: a first difference is
allowed only where the float32 reference's top-2 logprob margin is under 0.005. First-token logprobs agree to
2e-3 (as --quantization none does). KVSERVE_GREEDY_REFERENCE=PATH checks another reference instead, such as one
`scripts/make_reference_outputs.py --prompts FILE --out PATH` wrote for prompts the fixtures do not contain."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.gguf_layers import GGUFEmbedding, GGUFLinear

pytestmark = pytest.mark.real_model
REFERENCE = Path(
    os.environ.get("KVSERVE_GREEDY_REFERENCE")
    or Path(__file__).resolve().parents[1] / "fixtures" / "gemma3_270m_reference.json"
)
NEAR_TIE = 0.005


def test_gguf_blocks_greedy_equals_hf_reference(default_engine) -> None:
    reference = json.loads(REFERENCE.read_text())["prompts"]
    llm = LLM(engine=default_engine.sibling(kv_cache_memory_bytes=256 << 20))  # --quantization auto: the file's blocks
    assert llm.engine.config.quantization == "gguf"
    model = llm.engine.core.runner.model
    assert isinstance(model.embed_tokens, GGUFEmbedding)
    assert all(
        isinstance(layer.mlp.down_proj, GGUFLinear) and isinstance(layer.self_attn.qkv_proj, GGUFLinear)
        for layer in model.layers
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    outs = llm.generate([r["prompt_token_ids"] for r in reference], params, use_tqdm=False)
    for r, out in zip(reference, outs):
        got = out.outputs[0]
        first = next((i for i, (a, b) in enumerate(zip(got.token_ids, r["token_ids"])) if a != b), None)
        if first is not None:
            margin = r["top_logprobs"][first][0] - r["top_logprobs"][first][1]
            assert margin < NEAR_TIE, f"{r['name']}: differs from HF at token {first} (reference margin {margin})"
        assert got.logprobs[0][r["token_ids"][0]].logprob == pytest.approx(r["top_logprobs"][0][0], abs=2e-3)
    llm.engine.check_invariants()
