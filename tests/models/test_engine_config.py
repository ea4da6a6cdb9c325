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


def test_both_builders_resolve_the_same_config_and_offload_fingerprint(tmp_path: Path) -> None:
    """#43 item 14: load_engine resolved --quantization auto (gguf for a GGUF file on CPU) and the served name, while
    build_engine left them at "auto" and None, so the offload tier's fingerprint of one model differed by builder and
    a tier one had stored was never read by the other. Both now call resolve_config."""
    from test_gguf import tiny_gguf

    from kvserve.config import EngineConfig
    from kvserve.engine.build import build_engine
    from kvserve.engine.engine import LLMEngine

    _, source = tiny_gguf("llama", tmp_path, with_vocab=True)
    config = EngineConfig(
        model=str(source.path), num_gpu_blocks_override=64, block_size=4, kv_offloading_size="1MiB", cpu_threads=1
    )
    loaded = LLMEngine.from_config(config)
    core = loaded.core
    built = build_engine(
        config, core.model_config, core.runner.model, loaded.tokenizer, compute_dtype=loaded.compute_dtype
    )
    try:
        assert loaded.config.quantization == "gguf" and loaded.config.served_model_name == source.name
        assert built.config == loaded.config
        assert core.offload is not None and built.core.offload is not None
        assert built.core.offload.fingerprint == core.offload.fingerprint
    finally:
        built.close()
        loaded.close()
