"""Hybrid models with state layers (kv/state.py) through the whole engine on tiny random checkpoints: LFM2 (short
convolutions beside attention) and Qwen3.5 (Gated DeltaNet beside gated attention), with transformers' own modeling
code as the reference: greedy ids and top logprobs equal HF's over prompts several prefill chunks long, batched with
other requests, under forced preemption; prefix hits from state snapshots give the cold run's output; every state
slot and block returns at the end."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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


def _save(tmp_path_factory, variant: str) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(variant)
    model = build_tiny_hf_model(variant)
    model.save_pretrained(path)
    write_char_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return _save(tmp_path_factory, "lfm2_hybrid")


@pytest.fixture(scope="module", params=["lfm2_hybrid", "qwen3_5_hybrid"])
def hybrid(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """Each tiny hybrid checkpoint in turn."""
    return _save(tmp_path_factory, request.param)


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


def test_malformed_hybrid_configs_are_clear_errors(hybrid):
    """A hostile run's configs: zero attention heads was a ZeroDivisionError traceback; an LFM2 of conv layers only or
    a Qwen3.5 of linear-attention layers only was refused as "a model needs at least one layer". Each is now an error
    saying what is wrong, or what is not supported, from the config alone (so estimate and serve say the same)."""
    import json

    path, _ = hybrid
    cfg = json.loads((path / "config.json").read_text())
    for field in ("num_attention_heads", "hidden_size", "num_hidden_layers"):
        with pytest.raises(ValueError, match=f"{field} must be a positive integer, got 0"):
            ModelConfig.from_hf_dict({**cfg, field: 0})
    state_kind = "conv" if cfg["model_type"] == "lfm2" else "linear_attention"
    only_state = {**cfg, "layer_types": [state_kind] * cfg["num_hidden_layers"]}
    with pytest.raises(NotImplementedError, match="has no attention layer") as refused:
        ModelConfig.from_hf_dict(only_state)
    assert "needs at least one layer" not in str(refused.value)
    # kvserve estimate / advise read the same config the same way (they sized such a model as if it ran)
    from kvserve.tools.model_facts import kv_shape_from_hf_config

    with pytest.raises(NotImplementedError, match="has no attention layer"):
        kv_shape_from_hf_config(only_state)
    with pytest.raises(ValueError, match="must be positive"):
        kv_shape_from_hf_config({**cfg, "num_attention_heads": 0})


SETTINGS = {
    "one_chunk": dict(max_num_batched_tokens=256),
    "chunked": dict(max_num_batched_tokens=16),
    # 40 blocks of 4 tokens for 6 requests of up to 80 tokens: some are preempted and recomputed from their start
    "preempt": dict(max_num_batched_tokens=16, num_gpu_blocks_override=41),
    # prompts longer than 12 tokens take 12 a step (cut further at snapshot stops) and yield to the shorter ones
    "long_prompts": dict(max_num_batched_tokens=64, long_prefill_token_threshold=12),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_output_equals_hf_transformers(hybrid, setting):
    path, hf = hybrid
    engine = tiny_engine(path, max_num_seqs=4, **SETTINGS[setting])
    batch = prompts(6, seed=3)
    got = run(engine, batch, GREEDY)
    slots = engine.core.kv_manager.state_slots
    assert slots is not None and slots.num_free == slots.num_slots  # every slot back
    if setting == "preempt":
        assert engine.core.scheduler.num_preemptions > 0
    for ids, g in zip(batch, got):
        ref, ref_top = hf_greedy(hf, ids, len(g.outputs[0].token_ids))
        assert_logprobs_close(ref, ref_top, g.outputs[0].token_ids, tops_of(g.outputs[0]), name=path.name)


def test_prompt_logits_equal_hf_within_tolerance(hybrid):
    """prompt_logprobs: every prompt position's logits, computed over several chunks, within 1e-4 of HF's
    log-softmax (float32 both sides)."""
    path, hf = hybrid
    engine = tiny_engine(path, max_num_batched_tokens=8)
    ids = prompts(1, seed=5)[0]
    (out,) = run(engine, [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    want = torch.log_softmax(hf_logits(hf, ids), -1)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = ids[pos]
        assert abs(entry[token].logprob - want[pos - 1, token].item()) < 1e-4


def test_speculative_decoding_is_refused(lfm2):
    path, _ = lfm2
    with pytest.raises(ValueError, match="speculative decoding is not supported for lfm2"):
        tiny_engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def cold_run(path: Path, ids: list[int]) -> list[int]:
    """Greedy ids of `ids` on a fresh engine without prefix caching (every token computed)."""
    (out,) = run(tiny_engine(path, enable_prefix_caching=False), [ids], GREEDY)
    return list(out.outputs[0].token_ids)


def test_chat_turns_hit_the_snapshot_at_the_end_of_the_reply(hybrid):
    """Turn 2 (turn 1's prompt, its reply, a new message) hits up to the reply's last block boundary, restores the
    state from that snapshot, and gives the cold run's greedy ids; the same prompt sent again hits at its own hit
    point (its last block boundary before its last token)."""
    path, _ = hybrid
    engine = tiny_engine(path, max_num_batched_tokens=16)
    first_prompt = prompts(1, seed=11)[0][:30]
    (first,) = run(engine, [first_prompt], GREEDY)
    reply = list(first.outputs[0].token_ids)
    turn = first_prompt + reply + [7, 8, 9, 10, 11]
    (second,) = run(engine, [turn], GREEDY)
    computed = len(first_prompt) + len(reply) - 1  # the last reply token is never computed
    assert second.num_cached_tokens == computed // 4 * 4 > len(first_prompt)
    assert list(second.outputs[0].token_ids) == cold_run(path, turn)
    (again,) = run(engine, [turn], GREEDY)
    assert again.num_cached_tokens == (len(turn) - 1) // 4 * 4
    assert list(again.outputs[0].token_ids) == list(second.outputs[0].token_ids)
    stats = engine.core.stats()
    assert stats.state_snapshots_restored == 2 and stats.state_snapshots_saved >= 3
    assert stats.state_snapshots > 0 and stats.state_slots_used == 0
    from kvserve.engine.inspector import build_snapshot

    view = build_snapshot(engine.core)["state"]
    assert view["slots"] == {} and len(view["snapshots"]) == stats.state_snapshots
    assert not any(s["pending"] for s in view["snapshots"])


def test_a_long_prefill_leaves_a_snapshot_every_chunk(hybrid):
    """A 16-token step budget: a prompt's chunks end on block boundaries, each leaving a snapshot; a prompt sharing
    only the first 37 tokens hits at the last chunk boundary before them (32), not at 0."""
    path, _ = hybrid
    engine = tiny_engine(path, max_num_batched_tokens=16)
    long = prompts(1, seed=12)[0] + list(range(4, 60))
    run(engine, [long], GREEDY)
    other = long[:37] + [5, 6, 7, 8, 9, 10]
    (out,) = run(engine, [other], GREEDY)
    assert out.num_cached_tokens == 32
    assert out.prefix_miss is not None and out.prefix_miss.reason == "no_state_snapshot"
    assert list(out.outputs[0].token_ids) == cold_run(path, other)


def test_chunk_end_snapshots_are_overwritten_before_prompt_ends(hybrid):
    """A chunk end the token budget chose (no interval, no hit point, no mark) still leaves a snapshot, but as the
    least recently used: with 4 snapshot slots (--max-num-seqs 1) and an 8-token budget, two 41-token prompts leave
    4 chunk-end snapshots each beside their hit points, and the next turn of *each* still hits at its hit point (40).
    Saved as most recent, the second prompt's chunk ends overwrote the first's hit point (measured on LFM2-350M's
    shape with 8 users and --max-num-batched-tokens 256: 7 of 8 chat turns lost their hit); and the first turn's reply
    snapshots take the slot of the reply's previous one (reserved before it was dropped, each overwrote the second
    prompt's hit point)."""
    path, _ = hybrid
    engine = tiny_engine(path, max_num_batched_tokens=8, max_num_seqs=1)
    assert engine.core.scheduler.kv.state_snapshots.num_slots == 4
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    g = torch.Generator().manual_seed(21)
    first, second = ([2, *torch.randint(4, 256, (40,), generator=g).tolist()] for _ in range(2))
    for ids in (first, second):
        run(engine, [ids], params)
    for ids in (first, second):
        turn = ids + [7, 8, 9, 10, 11]
        (out,) = run(engine, [turn], GREEDY)
        assert out.num_cached_tokens == 40
        assert list(out.outputs[0].token_ids) == cold_run(path, turn)


@pytest.mark.parametrize("limit", [None, 1])
def test_max_num_partial_prefills_finishes_prompts_one_after_another(hybrid, limit):
    """--max-num-partial-prefills 1: a burst of prompts (each cut at its snapshot stops, so unfinished after its first
    step) is prefilled one after another, at most one prompt unfinished after any step, and the first tokens come
    in order, one prompt's a step; without the limit every prompt starts in the first step and the first tokens come
    within a step of each other. Greedy ids as cold runs either way."""
    path, _ = hybrid
    engine = tiny_engine(path, max_num_partial_prefills=limit)
    batch = [p + list(range(4, 30)) for p in prompts(4, seed=22)]
    for i, ids in enumerate(batch):
        engine.add_request(str(i), ids, GREEDY)
    finished: dict[str, Any] = {}
    first_token_step: dict[str, int] = {}
    most_unfinished, step = 0, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = out
        running = engine.core.scheduler.running
        most_unfinished = max(most_unfinished, sum(r.num_computed_tokens < r.num_tokens - 1 for r in running))
        engine.check_invariants()
    steps = [first_token_step[str(i)] for i in range(len(batch))]
    if limit == 1:
        assert most_unfinished <= 1 and steps == sorted(steps) and len(set(steps)) == len(batch)
    else:
        assert most_unfinished > 1 and max(steps) - min(steps) <= 1
    for i, ids in enumerate(batch):
        assert list(finished[str(i)].outputs[0].token_ids) == cold_run(path, ids)


def test_a_queued_request_keeps_its_snapshot_while_others_save_theirs(hybrid):
    """4 snapshot slots (--max-num-seqs 1): a chat's next turn queued behind a 250-token prompt, whose prefill saves 4
    snapshots (every 64 tokens, and its hit point), still hits the snapshot of its earlier turn: each step marks the
    snapshots that the first waiting requests would start from as recently used (keep_state_hit), so the running
    prompt's saves overwrite its own older ones. Unmarked, its saves overwrote the queued turn's (Qwen3.5 with
    --max-num-partial-prefills 1: round-2 hit rate 0.54 against 0.86)."""
    path, _ = hybrid
    engine = tiny_engine(path, max_num_seqs=1)
    g = torch.Generator().manual_seed(23)
    chat = [2, *torch.randint(4, 256, (40,), generator=g).tolist()]
    other = [2, *torch.randint(4, 256, (249,), generator=g).tolist()]
    run(engine, [chat], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    turn = chat + [7, 8, 9, 10, 11]
    got = run(engine, [other, turn], GREEDY)
    assert got[1].num_cached_tokens == 40
    assert list(got[1].outputs[0].token_ids) == cold_run(path, turn)


def test_hits_under_preemption_and_batching_equal_cold_runs(hybrid):
    """Requests sharing a system prompt, admitted together on a pool small enough to preempt: each resumes from its
    longest snapshot hit (or its start); greedy ids as cold runs, every slot and block back at the end."""
    path, _ = hybrid
    engine = tiny_engine(path, max_num_batched_tokens=16, num_gpu_blocks_override=25, max_num_seqs=4)
    system = prompts(1, seed=13)[0][:26]
    batch = [system + p[1:30] for p in prompts(6, seed=14)]
    got = run(engine, batch, GREEDY)
    assert engine.core.scheduler.num_preemptions > 0
    # Those admitted with the first computed nothing from it (its snapshot is saved after their step); later ones hit
    assert sum(o.num_cached_tokens > 0 for o in got) >= 2
    for ids, out in zip(batch, got):
        assert list(out.outputs[0].token_ids) == cold_run(path, ids)


def write_lfm2_gguf(hf: torch.nn.Module, path: Path) -> None:
    """The tiny LFM2 as llama.cpp's convert_hf_to_gguf.py writes one (its LFM2Model): tensor names from gguf-py's own
    map for the lfm2 architecture, the conv taps squeezed to [channels, kernel], the conv layers marked by 0 KV heads
    in a per-layer head_count_kv, shortconv.l_cache and the derived MLP width; 2-D weights as Q8_0 (the HF model's
    weights replaced by their Q8_0 values, so that both compute the same numbers)."""
    import gguf
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    c = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(hf.model.layers[0].feed_forward.w1.out_features)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "full_attention" else 0 for t in c.layer_types])
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_shortconv_l_cache(c.conv_L_cache)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    with torch.no_grad():
        for hf_name, param in hf.state_dict().items():
            if hf_name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            base, _, suffix = hf_name.rpartition(".")
            name = f"{names.get_name(base)}.{suffix}"
            data = param.float().numpy()
            if "conv.conv" in hf_name:
                data = data.squeeze(1)
            elif data.ndim == 2:
                q = quantize(data, GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0)))
                w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
                continue
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_a_gguf_written_as_llama_cpp_names_it_equals_hf(tmp_path, quantization):
    """The GGUF's config and weights (dequantized, or run as the file's Q8_0 blocks) give HF's logits within 1e-4
    on a prompt of several chunks (the HF model holds the same Q8_0 values)."""
    from tiny_models import PagedDriver

    from kvserve.model.loader import load_model
    from kvserve.model.source import ModelFormat, ModelSource

    hf = build_tiny_hf_model("lfm2_hybrid")
    path = tmp_path / "tiny-lfm2.gguf"
    write_lfm2_gguf(hf, path)
    cfg = ModelConfig.from_gguf(path)
    assert cfg.family == "lfm2" and cfg.state_layers == (0, 2, 3) and cfg.conv_kernel == 3
    source = ModelSource(ModelFormat.GGUF, path, path.stem)
    model = load_model(source, torch.float32, torch.device("cpu"), quantization=quantization, cache_dir=tmp_path).model
    ids = prompts(1, seed=21)[0]
    driver = PagedDriver(model, [ids])
    got = torch.cat([driver.step({0: n})[0] for n in (9, 16, len(ids) - 25)])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def _reorder_value_heads(t: torch.Tensor, dim: int, k_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's converter (its _LinearAttentionVReorderBase): value heads from HF's grouped order to tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_key, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def write_qwen35_gguf(hf: torch.nn.Module, path: Path, with_vocab: bool = False, mtp: bool = False) -> None:
    """The tiny Qwen3.5 as llama.cpp's converter writes one (its Qwen3_5TextModel: Qwen3NextModel's transforms and
    _LinearAttentionVReorderBase's): names from gguf-py's map for qwen35; A_log stored as -exp(A_log), dt_bias as
    ssm_dt.bias, the conv squeezed, every norm but the gated one stored as 1 + w, and with fewer key than value heads
    the value heads reordered to tiled order in in_proj_qkv's value rows, in_proj_z, in_proj_b / _a, A_log, dt_bias,
    the conv's value channels and out_proj's columns. 2-D projections as Q8_0 (the HF model given the same values)."""
    import gguf
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    c = hf.config
    k_heads, v_heads = c.linear_num_key_heads, c.linear_num_value_heads
    per_key, kd, dv = v_heads // k_heads, 2 * c.linear_num_key_heads * c.linear_key_head_dim, c.linear_value_head_dim
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_block_count(c.num_hidden_layers + int(mtp))  # the converter counts a multi-token-prediction layer in
    if mtp:
        w.add_uint32("qwen35.nextn_predict_layers", 1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(k_heads)
    w.add_ssm_time_step_rank(v_heads)
    w.add_ssm_inner_size(dv * v_heads)
    # the converter's add_recurrent_layers (newer than the gguf package on PyPI): the same key and values
    w.add_array("qwen35.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types] + [False] * mtp)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if with_vocab:  # a byte-level BPE vocabulary of the model's 256 ids, as a gpt2-type GGUF tokenizer stores it
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen35")
        w.add_token_list(list(bytes_to_unicode().values()))
        w.add_token_merges([])
        w.add_token_scores([0.0] * c.vocab_size)
        w.add_token_types([1] * c.vocab_size)
    with torch.no_grad():
        for hf_name, param in hf.state_dict().items():
            if hf_name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            data = param.float().clone()
            if data.ndim == 2 and "conv1d" not in hf_name:  # the HF model computes with the Q8_0 values too
                q = quantize(data.numpy(), GGMLQuantizationType.Q8_0)
                data = torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0))
                param.copy_(data)
            name = hf_name
            if name.endswith(".A_log"):
                data = -torch.exp(data)
            elif name.endswith(".dt_bias"):
                name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
            elif "conv1d" in name:
                data = data.squeeze(1)
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                data = data + 1
            if "linear_attn." in name and per_key > 1:
                if ".in_proj_qkv." in name or ".conv1d" in name:
                    data = torch.cat((data[:kd], _reorder_value_heads(data[kd:], 0, k_heads, per_key, dv)))
                elif ".in_proj_z." in name:
                    data = _reorder_value_heads(data, 0, k_heads, per_key, dv)
                elif ".in_proj_b." in name or ".in_proj_a." in name:
                    data = _reorder_value_heads(data, 0, k_heads, per_key, 1)
                elif ".A_log" in name or ".dt_proj" in name:
                    data = _reorder_value_heads(data[:, None], 0, k_heads, per_key, 1)[:, 0]
                elif ".out_proj." in name:
                    data = _reorder_value_heads(data, 1, k_heads, per_key, dv)
            base, dot, suffix = name.rpartition(".")
            gguf_name = f"{names.get_name(base)}.{suffix}" if suffix in ("weight", "bias") else names.get_name(name)
            array = data.numpy()
            if array.ndim == 2 and "conv1d" not in name:
                q = quantize(array, GGMLQuantizationType.Q8_0)
                w.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(gguf_name, array)
    if mtp:  # a few of the nextn layer's tensors, as blocks past the model's own
        n = c.num_hidden_layers
        w.add_tensor(f"blk.{n}.nextn.eh_proj.weight", torch.randn(c.hidden_size, 2 * c.hidden_size).numpy())
        w.add_tensor(f"blk.{n}.attn_norm.weight", torch.ones(c.hidden_size).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("quantization,mtp", [("none", False), ("gguf", False), ("none", True)])
def test_a_qwen35_gguf_written_as_llama_cpp_does_equals_hf(tmp_path, quantization, mtp):
    """Qwen3.5's GGUF (value heads tiled, A stored as -exp(A_log), 1 + w norms) loads back to HF's layout: logits
    within 1e-4 of HF's on a prompt of several chunks, dequantized or run as the file's Q8_0 blocks; a file with a
    multi-token-prediction layer (the converter's default for the published checkpoints) runs without it."""
    from tiny_models import PagedDriver

    from kvserve.model.loader import load_model
    from kvserve.model.source import ModelFormat, ModelSource

    hf = build_tiny_hf_model("qwen3_5_hybrid")
    path = tmp_path / "tiny-qwen35.gguf"
    write_qwen35_gguf(hf, path, mtp=mtp)
    cfg = ModelConfig.from_gguf(path)
    assert cfg.family == "qwen3_5" and cfg.state_layers == (0, 2, 3) and cfg.rotary_dim == 8
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim) == (2, 4, 16, 8)
    source = ModelSource(ModelFormat.GGUF, path, path.stem)
    model = load_model(source, torch.float32, torch.device("cpu"), quantization=quantization, cache_dir=tmp_path).model
    ids = prompts(1, seed=22)[0]
    driver = PagedDriver(model, [ids])
    got = torch.cat([driver.step({0: n})[0] for n in (9, 16, len(ids) - 25)])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_a_qwen35_gguf_serves_with_its_own_tokenizer(tmp_path):
    """An engine on the GGUF alone (its tokenizer built from the file's vocabulary): greedy ids equal HF's on the
    same Q8_0 values."""
    hf = build_tiny_hf_model("qwen3_5_hybrid")
    path = tmp_path / "tiny-qwen35.gguf"
    write_qwen35_gguf(hf, path, with_vocab=True)
    engine = tiny_engine(path, max_num_batched_tokens=16)
    ids = prompts(1, seed=23)[0]
    (out,) = run(engine, [ids], GREEDY)
    ref, ref_top = hf_greedy(hf, ids, len(out.outputs[0].token_ids))
    assert_logprobs_close(ref, ref_top, out.outputs[0].token_ids, tops_of(out.outputs[0]), name="qwen35 gguf")


def test_a_pinned_prefix_keeps_its_state_snapshot(hybrid):
    """cache_control on a hybrid model: the mark's block boundary gets a snapshot, and while the pin lives that
    snapshot is never overwritten, though other prompts churn every other snapshot slot (4 of them here); without the
    pin the same prefix, evicted, is computed again."""
    from kvserve.sampling_params import KVPin

    path, _ = hybrid
    base = prompts(1, seed=31)[0][:30]
    others = [p[:30] for p in prompts(6, seed=32)]
    follow = base + [9, 8, 7, 6, 5, 4, 3]

    def complete(engine, ids: list[int], params: SamplingParams):  # run() but the pin's blocks stay held
        engine.add_request(str(len(ids)) + str(ids[:3]), ids, params)
        done = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                done = out if out.finished else done
            engine.check_invariants()
        return done

    def hit_after_churn(pinned: bool) -> int:
        engine = tiny_engine(path, max_num_batched_tokens=16, max_num_seqs=1)
        assert engine.core.kv_manager.state_snapshots.num_slots == 4
        pins = (KVPin(num_tokens=26, ttl_s=600.0),) if pinned else ()
        complete(engine, base, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, kv_pins=pins))
        for other in others:
            complete(engine, other, GREEDY)
        out = complete(engine, follow, GREEDY)
        assert list(out.outputs[0].token_ids) == cold_run(path, follow)
        return out.num_cached_tokens

    assert hit_after_churn(pinned=True) == 24  # the mark at token 26 ends its last whole block at 24
    assert hit_after_churn(pinned=False) == 0


@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
def test_int8_activations_run_the_hybrid_layers_natively(tmp_path, arch):
    """`--activation-quantization int8` on a hybrid GGUF: the native short-conv / Gated DeltaNet / attention layers
    with 8-bit activations equal the torch layers with the same quantization (atol = rtol = 1e-4, the same numbers
    summed in another order), differ from the exact path (the flag does something) and stay within 0.05 of the
    logits' spread of HF's float32 logits (8-bit activations on random tiny weights), over several prefill chunks."""
    from tiny_models import PagedDriver

    from kvserve.kernels.native import cpu_supports_native
    from kvserve.kernels.ops import TorchKernels
    from kvserve.model.loader import load_model
    from kvserve.model.source import ModelFormat, ModelSource

    hf = build_tiny_hf_model("lfm2_hybrid" if arch == "lfm2" else "qwen3_5_hybrid")
    path = tmp_path / f"tiny-{arch}.gguf"
    (write_lfm2_gguf if arch == "lfm2" else write_qwen35_gguf)(hf, path)
    source = ModelSource(ModelFormat.GGUF, path, path.stem)
    model = load_model(
        source,
        torch.float32,
        torch.device("cpu"),
        quantization="gguf",
        activation_quantization="int8",
        cache_dir=tmp_path,
    ).model
    ids = prompts(1, seed=24)[0]

    def logits() -> torch.Tensor:
        driver = PagedDriver(model, [ids])
        return torch.cat([driver.step({0: n})[0] for n in (9, 16, len(ids) - 25)])

    got = logits()
    if cpu_supports_native()[0]:
        assert model.native_layers is not None, "the native hybrid layers run int8 activations too"
    model.use_kernels(TorchKernels(activation_quantization="int8"))
    torch.testing.assert_close(logits(), got, atol=1e-4, rtol=1e-4)
    ref = hf_logits(hf, ids)
    assert float((got - ref).abs().max()) < 0.05 * float(ref.max() - ref.min())
    assert not torch.allclose(got, ref, atol=1e-5, rtol=0), "int8 activations must differ from the exact path"
