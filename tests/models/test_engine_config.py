"""The engine's config as built (engine/build.py): limits checked against the values the build resolved, and one
resolution of what loading decides, whichever builder made the engine (#43 items 13 and 14)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import tiny_engine

from kvserve import SamplingParams


@pytest.fixture(scope="module")
def model_dir(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama_gqa"]


def test_without_chunked_prefill_the_default_max_model_len_is_one_step(model_dir: Path) -> None:
    """#43 item 13: with chunked prefill off and no --max-model-len, a prompt must fit one step's budget, so the
    resolved max-model-len is capped at --max-num-batched-tokens; a longer prompt gets a clear error at once instead
    of waiting at the head of the queue forever."""
    engine = tiny_engine(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=16)
    try:
        assert engine.facts.max_model_len == 16
        with pytest.raises(ValueError, match="16"):
            engine.add_request("long", list(range(3, 23)), SamplingParams(max_tokens=2))
        engine.add_request("short", list(range(3, 13)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        outputs = []
        for _ in range(50):
            if not engine.has_unfinished_requests():
                break
            outputs += engine.step()
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    finally:
        engine.close()


def test_without_chunked_prefill_an_explicit_max_model_len_must_fit_a_step(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens \(16\).*--max-model-len \(32\)"):
        tiny_engine(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=32)
