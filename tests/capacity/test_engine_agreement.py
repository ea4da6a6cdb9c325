"""`kvserve estimate` predicts the engine's block count to the block, for the same flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.config import EngineConfig


def estimate_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tiny_models import save_tiny_checkpoints

    return save_tiny_checkpoints(tmp_path_factory.mktemp, ("llama_gqa", "gemma3_mqa_sliding", "lfm2_hybrid"))


@pytest.mark.parametrize("variant", ["llama_gqa", "gemma3_mqa_sliding"])
@pytest.mark.parametrize(
    "flags",
    [
        dict(kv_cache_memory_bytes=1_000_003, block_size=16),
        dict(kv_cache_memory_bytes=777_777, block_size=4, kv_cache_dtype="bfloat16"),
        dict(kv_cache_memory_bytes=5_000_000, block_size=8, max_model_len=200),
        dict(kv_cache_memory_bytes=333_333, block_size=16, kv_cache_dtype="int8"),
        dict(kv_cache_memory_bytes=333_333, block_size=32, kv_cache_dtype="fp8"),
    ],
    ids=["fp32-b16", "bf16kv-b4", "max-model-len", "int8-scales", "fp8-scales"],
)
def test_estimate_matches_the_engine_on_tiny_checkpoints(capsys, tiny_dirs, variant, flags) -> None:
    from kvserve.engine.engine import LLMEngine

    path = tiny_dirs[variant]
    engine = LLMEngine.from_config(EngineConfig(model=str(path), **flags))
    argv = [
        "--model",
        str(path),
        "--kv-cache-memory-bytes",
        str(flags["kv_cache_memory_bytes"]),
        "--block-size",
        str(flags["block_size"]),
        "--kv-cache-dtype",
        flags.get("kv_cache_dtype", "auto"),
    ]
    if "max_model_len" in flags:
        argv += ["--max-model-len", str(flags["max_model_len"])]
    kv = estimate_json(capsys, *argv)["kv"][0]
    assert kv["bytes_per_token"] == engine.core.kv_config.bytes_per_token
    assert kv["bytes_per_block"] == engine.core.cache_plan.bytes_per_block
    assert kv["plan"]["num_blocks"] == engine.core.cache_plan.num_blocks == engine.core.pool.num_blocks
    # One block is the null block: the estimate and the engine agree on what requests can use, too.
    assert kv["plan"]["num_usable_blocks"] == engine.core.pool.num_usable_blocks == engine.core.pool.num_blocks - 1
    assert kv["plan"]["num_tokens"] == engine.core.pool.num_usable_blocks * flags["block_size"]
    assert kv["plan"]["max_model_len"] == engine.core.cache_plan.max_model_len


def test_estimate_reports_the_engines_max_model_len_error(capsys, tiny_dirs) -> None:
    path = tiny_dirs["llama_gqa"]
    assert main(["estimate", "--model", str(path), "--kv-cache-memory-bytes", "100000", "--max-model-len", "250"]) == 2
    assert "does not fit in the KV cache" in capsys.readouterr().err


def test_estimate_matches_the_engine_plan_on_the_default_gguf(capsys) -> None:
    """Metadata only: the engine's plan_cache on the GGUF's ModelConfig, no weights loaded."""
    import torch

    from kvserve.engine.build import plan_cache
    from kvserve.kv.cache import KVCacheConfig
    from kvserve.kv.groups import make_kv_cache_layout
    from kvserve.model.config import ModelConfig
    from kvserve.model.source import default_model_path

    model_config = ModelConfig.from_gguf(default_model_path())
    budget = (1 << 30) + 12345
    for hybrid in (True, False):
        layout = make_kv_cache_layout(model_config.sliding_windows, hybrid)
        spec = KVCacheConfig(
            model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, 16, torch.float32, layout
        )
        config = EngineConfig(kv_cache_memory_bytes=budget, disable_hybrid_kv_cache_manager=not hybrid)
        plan = plan_cache(config, model_config, spec, torch.device("cpu"))
        flags = [] if hybrid else ["--disable-hybrid-kv-cache-manager"]
        doc = estimate_json(capsys, "--kv-cache-memory-bytes", str(budget), *flags)
        kv = doc["kv"][0]
        assert kv["bytes_per_token"] == 36864
        assert len(doc["layout"]["groups"]) == (6 if hybrid else 1)
        if hybrid:  # a block id spans 3 layers (one group's), so 6x the blocks; a request of the whole context fits
            assert kv["plan"]["num_blocks"] == plan.num_blocks == budget // (3 * 2048 * 16)
            assert kv["plan"]["max_model_len"] == plan.max_model_len == 32768
            assert kv["plan"]["blocks_per_request"] == plan.blocks_per_request(32768) == 2048 + 5 * 32
        else:  # every layer keeps every token: the pool (1820 blocks, one of them the null block) caps the context
            assert kv["plan"]["num_blocks"] == plan.num_blocks == budget // (36864 * 16)
            assert kv["plan"]["max_model_len"] == plan.max_model_len == 1819 * 16


@pytest.mark.parametrize("max_num_seqs,budget", [(256, 3_000_017), (8, 777_777), (256, 400_009)])
def test_estimate_counts_a_hybrid_models_state_slots_like_the_engine(capsys, tiny_dirs, max_num_seqs, budget) -> None:
    """LFM2's short-conv layers keep a state per sequence slot plus snapshots, out of the budget before the blocks: the
    estimate and the engine take the same bytes off and get the same blocks."""
    from kvserve.engine.engine import LLMEngine

    path = tiny_dirs["lfm2_hybrid"]
    engine = LLMEngine.from_config(
        EngineConfig(model=str(path), kv_cache_memory_bytes=budget, block_size=16, max_num_seqs=max_num_seqs)
    )
    argv = ["--model", str(path), "--kv-cache-memory-bytes", str(budget), "--max-num-seqs", str(max_num_seqs)]
    kv = estimate_json(capsys, *argv)["kv"][0]
    slots = kv["state_slots"]
    # as many sequence slots as --max-num-seqs asks, unless half the budget holds fewer (the smallest budget here)
    assert (
        slots["num_sequences"] == engine.core.kv_manager.state_slots.num_slots == min(max_num_seqs, budget // 2 // 1536)
    )
    assert slots["num_snapshots"] == engine.core.cache_plan.num_state_snapshots > 0
    assert kv["plan"]["num_blocks"] == engine.core.pool.num_blocks
    assert kv["bytes_per_block"] * kv["plan"]["num_blocks"] + slots["bytes"] <= budget


def test_advise_reserves_a_hybrid_models_state_slots_as_the_engine_does(capsys, tiny_dirs) -> None:
    """advise takes the state slots of the scenario's concurrent sequences off the budget before counting blocks; the
    engine started with its recommendation reserves no more, so it has at least the blocks advise counted on."""
    from kvserve.engine.engine import LLMEngine

    path = tiny_dirs["lfm2_hybrid"]
    budget = 2_000_003
    assert main(["advise", "--model", str(path), "--kv-cache-memory-bytes", str(budget), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    state, rec = doc["state_slots"], doc["recommendation"]
    assert state["bytes"] > 0 and rec["max_num_seqs"] <= state["num_sequences"]
    chosen = next(
        c
        for c in doc["candidates"]
        if (c["max_model_len"], c["kv_cache_dtype"]) == (rec["max_model_len"], rec["kv_cache_dtype"])
    )
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(path),
            kv_cache_memory_bytes=budget,
            max_num_seqs=rec["max_num_seqs"],
            max_model_len=rec["max_model_len"],
            kv_cache_dtype=rec["kv_cache_dtype"],
        )
    )
    assert engine.core.pool.num_blocks >= chosen["num_blocks"]
