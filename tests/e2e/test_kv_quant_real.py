"""8-bit KV on the default model (Gemma 3 270M): each dtype's greedy continuation of two reference prompts
passes vLLM's check_logprobs_close rule against float32 KV, and its first-token logprob stays close.
Where a dtype diverges, the index is printed (run with -s) so a regression in accuracy shows up as an
earlier divergence. The full accuracy figures come from `kvserve bench kv-dtype` (docs/KV_QUANT.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.build import build_engine
from kvserve.engine.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

pytestmark = pytest.mark.real_model
TOP = 5
PROMPTS = ["The capital of France is", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n']
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=TOP)


@pytest.fixture(scope="module")
def loaded(default_float32_model):
    return default_float32_model


def generate(loaded, kv_cache_dtype: str) -> list:
    model, tokenizer = loaded
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=64 << 20, quantization="none")
    engine = build_engine(config, model.config, model.model, tokenizer)
    return [o.outputs[0] for o in LLM(engine=engine).generate(PROMPTS, GREEDY, use_tqdm=False)]


def tops(completion) -> list[dict]:
    return [dict.fromkeys(sorted(e, key=lambda t: e[t].rank)[:TOP]) for e in completion.logprobs]


@pytest.fixture(scope="module")
def float32_kv(loaded) -> list:
    return generate(loaded, "float32")


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_8bit_kv_close_to_float32_kv(loaded, float32_kv, kv_dtype):
    for prompt, ref, got in zip(PROMPTS, float32_kv, generate(loaded, kv_dtype)):
        first = assert_logprobs_close(ref.token_ids, tops(ref), got.token_ids, tops(got), name=f"{kv_dtype} {prompt!r}")
        print(f"{kv_dtype} {prompt[:20]!r}: first divergence from float32 KV at token {first} of 10")
        ref_lp, got_lp = ref.logprobs[0][ref.token_ids[0]].logprob, got.logprobs[0][ref.token_ids[0]].logprob
        assert got_lp == pytest.approx(ref_lp, abs=0.15), f"{kv_dtype}: first-token logprob {got_lp} vs {ref_lp}"
