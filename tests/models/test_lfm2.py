"""LFM2 (short convolutions beside attention, kv/state.py) through the whole engine on a tiny random checkpoint
(transformers' Lfm2ForCausalLM, the reference): greedy ids and top logprobs equal HF's over prompts several prefill
chunks long, batched with other requests, under forced preemption; every state slot and block returns at the end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_hybrid_kv_cache import hf_greedy, run, tops_of
from tiny_models import build_tiny_hf_model, hf_logits, tiny_engine
from tiny_tokenizer import write_char_tokenizer

from kvserve import SamplingParams
from kvserve.model.config import SHORT_CONV, ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

TOP = 5
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=TOP)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("lfm2")
    model = build_tiny_hf_model("lfm2_hybrid")
    model.save_pretrained(path)
    write_char_tokenizer(path)
    return path, model


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 70, (n,), generator=g).tolist()
    return [[2] + torch.randint(4, 256, (k,), generator=g).tolist() for k in lengths]


def test_config_reads_layer_kinds_and_the_derived_mlp_width(lfm2):
    path, hf = lfm2
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.layer_kinds == [SHORT_CONV, "attention", SHORT_CONV, SHORT_CONV]
    assert cfg.attention_layers == (1,) and cfg.state_layers == (0, 2, 3)
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features
    assert cfg.state_spec is not None and cfg.state_spec.bytes_per_slot == 3 * 2 * 64 * 4


def test_unknown_layer_types_are_refused_by_name(lfm2, tmp_path):
    import json

    path, _ = lfm2
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"][0] = "mamba"
    with pytest.raises(NotImplementedError, match="'mamba'"):
        ModelConfig.from_hf_dict(cfg)
    cfg["model_type"] = "lfm2_moe"
    with pytest.raises(ValueError, match="lfm2_moe"):
        ModelConfig.from_hf_dict(cfg)


SETTINGS = {
    "one_chunk": dict(max_num_batched_tokens=256),
    "chunked": dict(max_num_batched_tokens=16),
    # 40 blocks of 4 tokens for 6 requests of up to 80 tokens: some are preempted and recomputed from their start
    "preempt": dict(max_num_batched_tokens=16, num_gpu_blocks_override=41),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_output_equals_hf_transformers(lfm2, setting):
    path, hf = lfm2
    engine = tiny_engine(path, max_num_seqs=4, **SETTINGS[setting])
    batch = prompts(6, seed=3)
    got = run(engine, batch, GREEDY)
    slots = engine.core.kv_manager.state_slots
    assert slots is not None and slots.num_free == slots.num_slots  # every slot back
    if setting == "preempt":
        assert engine.core.scheduler.num_preemptions > 0
    for ids, g in zip(batch, got):
        ref, ref_top = hf_greedy(hf, ids, len(g.outputs[0].token_ids))
        assert_logprobs_close(ref, ref_top, g.outputs[0].token_ids, tops_of(g.outputs[0]), name="lfm2")


def test_prompt_logits_equal_hf_within_tolerance(lfm2):
    """prompt_logprobs: every prompt position's logits, computed over several chunks, within 1e-4 of HF's
    log-softmax (float32 both sides)."""
    path, hf = lfm2
    engine = tiny_engine(path, max_num_batched_tokens=8)
    ids = prompts(1, seed=5)[0]
    (out,) = run(engine, [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    want = torch.log_softmax(hf_logits(hf, ids), -1)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = ids[pos]
        assert abs(entry[token].logprob - want[pos - 1, token].item()) < 1e-4


def test_prefix_caching_and_speculative_decoding_are_settled_at_build(lfm2):
    path, _ = lfm2
    engine = tiny_engine(path)
    assert not engine.core.config.enable_prefix_caching  # a hit would need a state snapshot
    with pytest.raises(ValueError, match="speculative decoding is not supported for lfm2"):
        tiny_engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
