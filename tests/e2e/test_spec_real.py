"""Speculative decoding on the default model (Gemma 3 270M): greedy output token for token the same with and
without n-gram drafts, on an input-grounded prompt (drafts accepted) and an open-ended one, batched."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.engine.llm import LLM

pytestmark = pytest.mark.real_model

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    "disable_by_batch_size": 8,
    "min_acceptance_rate": 0.0,
}


def test_greedy_output_identical_with_and_without_speculation(default_engine):
    import inspect

    from kvserve.kv.pool import BlockPool

    code = inspect.getsource(BlockPool.free)
    prompts = [
        f"Here is a Python function:\n\n{code}\nThe same function, copied exactly:\n\n",
        "Once upon a time, in a small village by the sea, there lived",
    ]
    plain = default_engine.sibling(kv_cache_memory_bytes=256 * 2**20)
    spec = plain.sibling(speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    off = [o.outputs[0].token_ids for o in LLM(engine=plain).generate(prompts, params, use_tqdm=False)]
    on = [o.outputs[0].token_ids for o in LLM(engine=spec).generate(prompts, params, use_tqdm=False)]
    assert on == off
    stats = spec.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    spec.check_invariants()
    assert spec.core.pool.num_free_blocks == spec.core.pool.num_usable_blocks
