"""--quantization q8_0 on the default model (Gemma 3 270M): greedy output against the stored HF transformers
reference passes vLLM's check_logprobs_close rule on every reference prompt, and each first-token logprob
is within 0.05 of HF's. Perplexity (within 1% of float32) comes from `kvserve bench quantization`, see
docs/BENCHMARKS.md. Run with -s to see where each prompt first diverges."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.quantization import Q8Embedding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

pytestmark = pytest.mark.real_model
REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "gemma3_270m_reference.json"
TOP = 5


def test_q8_0_close_to_hf_reference() -> None:
    reference = json.loads(REFERENCE.read_text())["prompts"]
    llm = LLM(quantization="q8_0", kv_cache_memory_bytes=256 << 20)
    assert isinstance(llm.engine.core.runner.model.embed_tokens, Q8Embedding)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([r["prompt"] for r in reference], params, use_tqdm=False)
    for r, out in zip(reference, outs):
        got = out.outputs[0]
        tops = [dict.fromkeys(sorted(e, key=lambda t: e[t].rank)[:TOP]) for e in got.logprobs]
        ref_tops = [dict.fromkeys(ids) for ids in r["top_ids"]]
        first = assert_logprobs_close(r["token_ids"], ref_tops, got.token_ids, tops, name=r["name"])
        print(f"q8_0 {r['name']}: first divergence from HF at token {first} of 32")
        ref_lp = r["top_logprobs"][0][0]
        assert got.logprobs[0][r["token_ids"][0]].logprob == pytest.approx(ref_lp, abs=0.05), r["name"]
    llm.engine.check_invariants()
    assert llm.engine.core.pool.num_free_blocks == llm.engine.core.pool.num_usable_blocks
