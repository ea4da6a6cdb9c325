"""`--activation-quantization int8` on the default model (Gemma 3 270M Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K
blocks): the engine's guarantees hold with the flag on (a request's greedy output does not depend on the batch,
on chunked prefill, on prefix-cache hits, on preemption or on n-gram speculation, and an int8 KV cache keeps
it; every block returns to the pool), and its greedy output agrees with HF transformers' stored reference up to
near-ties (vLLM's check_logprobs_close rule, tests/logprob_check.py).
The accuracy cost itself (perplexity, greedy agreement over 32 tokens) is measured by `kvserve bench
quantization --methods gguf,gguf+act-int8` (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

pytestmark = pytest.mark.real_model
REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "gemma3_270m_reference.json"
TOP = 5
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP)
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": 64,
    "min_acceptance_rate": 0.0,
}


def tops(completion) -> list[dict]:
    return [dict.fromkeys(sorted(e, key=lambda t: e[t].rank)[:TOP]) for e in completion.logprobs]


@pytest.fixture(scope="module")
def int8_engine():
    engine = LLMEngine.from_config(
        EngineConfig(activation_quantization="int8", kv_cache_memory_bytes=128 << 20, enable_prefix_caching=False)
    )
    yield engine
    engine.close()


def test_int8_engine_agrees_with_hf_and_with_itself_under_batching(int8_engine) -> None:
    reference = json.loads(REFERENCE.read_text())["prompts"]
    assert int8_engine.core.runner.model.kernels.activation_quantization == "int8"
    long_ids = max(reference, key=lambda r: r["num_prompt_tokens"])["prompt_token_ids"]
    batch = [r["prompt_token_ids"] for r in reference] + [long_ids[:n] for n in (40, 130, 333, 530)]
    baseline = [o.outputs[0] for o in LLM(engine=int8_engine).generate(batch, GREEDY, use_tqdm=False)]
    for r, base in zip(reference, baseline):
        ref_tops = [dict.fromkeys(ids) for ids in r["top_ids"]]
        assert_logprobs_close(r["token_ids"][:12], ref_tops, base.token_ids, tops(base), name=r["name"])
    variants = {
        "alone": None,
        "chunked-96": dict(max_num_batched_tokens=96),
        "prefix-cache": dict(enable_prefix_caching=True),
        # 310 one-group blocks cannot hold them all while they prefill in 128-token chunks side by side (no
        # long-prefill threshold: with it, long prompts take turns and never hold that much at once)
        "preempt": dict(
            num_gpu_blocks_override=310, max_model_len=800, max_num_batched_tokens=128, long_prefill_token_threshold=0
        ),
        "spec-ngram": dict(speculative_config=SPEC),
        "int8-kv": dict(kv_cache_dtype="int8"),
    }
    for name, changes in variants.items():
        if changes is None:
            outs = [LLM(engine=int8_engine).generate([p], GREEDY, use_tqdm=False)[0] for p in batch[:4]]
            engine = int8_engine
        else:
            engine = int8_engine.sibling(**changes)
            outs = LLM(engine=engine).generate(batch, GREEDY, use_tqdm=False)
        for i, (base, out) in enumerate(zip(baseline, outs)):
            got = out.outputs[0]
            assert_logprobs_close(base.token_ids, tops(base), got.token_ids, tops(got), name=f"{name} prompt {i}")
        if name == "prefix-cache":
            assert engine.stats().prefix_cache_hits_tokens > 0
        if name == "preempt":
            assert engine.core.scheduler.num_preemptions > 0
        if name == "spec-ngram":
            assert engine.stats().spec_decode_num_draft_tokens > 0
        engine.check_invariants()
        assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks
