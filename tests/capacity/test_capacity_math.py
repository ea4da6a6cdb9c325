"""kvserve.capacity against numbers worked out by hand from the models' published configs."""

from __future__ import annotations

import pytest

from kvserve.capacity import (
    KV_DTYPES,
    KVShape,
    blocks_per_request,
    compare_contiguous,
    max_concurrent_requests,
    max_model_len_for_concurrency,
    plan_kv_cache,
    resolve_compute_dtype,
    resolve_kv_dtype,
    window_blocks,
)
from kvserve.capacity_catalog import CATALOG, find_entry
from kvserve.tools.model_facts import dense_parameter_count, kv_shape_from_hf_config

BF16, FP32 = KV_DTYPES["bfloat16"], KV_DTYPES["float32"]


def shape_of(name: str) -> KVShape:
    entry = find_entry(name)
    assert entry is not None, name
    return kv_shape_from_hf_config(entry.config)[0]


def test_gqa_llama3_8b_bf16() -> None:
    shape = shape_of("llama-3.1-8b")
    assert shape.attention == "GQA"
    assert shape.bytes_per_token(BF16) == 32 * 8 * 128 * 2 * 2 == 131072  # 32 layers x 8 kv heads, not 32 heads


def test_mqa_gemma3_270m_fp32() -> None:
    shape = shape_of("google/gemma-3-270m")
    assert shape.attention == "MQA"
    assert shape.bytes_per_token(FP32) == 2 * 18 * 1 * 256 * 4 == 36864


def test_head_dim_from_config_not_hidden_over_heads() -> None:
    shape = shape_of("qwen3-0.6b")  # hidden 1024 / 16 heads = 64, but head_dim is 128
    assert shape.head_dim == 128 and shape.head_dim_note == "head_dim"
    assert shape.bytes_per_token(BF16) == 2 * 28 * 8 * 128 * 2 == 114688


def test_mla_deepseek_v3_is_one_latent_plus_rope() -> None:
    shape = shape_of("deepseek-v3")
    assert shape.attention == "MLA"
    assert shape.bytes_per_token(BF16) == (512 + 64) * 61 * 2 == 70272
    # with 8-bit KV: one byte per element plus one float32 scale per token per layer (one "head", no K/V pair)
    assert shape.bytes_per_token(KV_DTYPES["fp8"]) == 61 * (576 + 4)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_8bit_kv_adds_a_float32_scale_per_token_per_head(name: str) -> None:
    shape = shape_of("llama-3.1-8b")
    assert shape.bytes_per_token(KV_DTYPES[name]) == 32 * 2 * 8 * (128 * 1 + 4) == 67584


def test_sliding_window_gemma3_270m_capped_at_32k() -> None:
    shape = shape_of("google/gemma-3-270m")
    assert sum(w is None for w in shape.sliding_windows) == 3  # layers 5, 11, 17 are global
    per_layer_token = 2 * 1 * 256 * 4
    # uniform pool (today): 32768 tokens x all 18 layers; capped: 3 global layers keep 32768 tokens, the 15
    # sliding layers keep the 512-token window = 32 whole blocks (32256 and 32768 are block-aligned).
    assert blocks_per_request(32768, 16) * 16 * shape.bytes_per_token(FP32) == 32768 * 36864
    assert shape.window_capped_bytes(32768, FP32, 16) == (3 * 32768 + 15 * 512) * per_layer_token == 217_055_232


def test_sliding_window_mistral_v01_every_layer() -> None:
    shape = shape_of("mistral-7b-v0.1")
    assert set(shape.sliding_windows) == {4096}
    assert shape.window_capped_bytes(32768, BF16, 16) == 4096 * 131072
    assert shape.window_capped_bytes(1000, BF16, 16) == 63 * 16 * 131072  # shorter than the window: no cap
    assert set(shape_of("mistral-7b-v0.3").sliding_windows) == {None}


def test_gemma2_alternates_local_and_global() -> None:
    windows = shape_of("gemma-2-9b").sliding_windows
    assert windows[:4] == (4096, None, 4096, None) and windows.count(None) == 21


def test_window_blocks_unaligned() -> None:
    # tokens 0..999 with a 512 window: keys 488..999 live in blocks 30 (488 // 16) .. 62 (999 // 16) = 33 blocks
    assert window_blocks(1000, 512, 16) == 33
    assert window_blocks(1000, None, 16) == 63
    assert window_blocks(300, 512, 16) == 19
    assert window_blocks(0, 512, 16) == 0


def test_block_rounding_and_plan() -> None:
    assert blocks_per_request(1000, 16) == 63 and blocks_per_request(1024, 16) == 64
    plan = plan_kv_cache(bytes_per_block=589824, block_size=16, model_context_len=32768, budget_bytes=4 << 30)
    assert plan.num_blocks == (4 << 30) // 589824 == 7281
    assert plan.max_model_len == 32768
    assert plan.num_usable_blocks == 7280 and plan.num_tokens == 7280 * 16  # block 0 is the null block
    assert max_concurrent_requests(7281, 1000, 16) == 7280 // 63
    assert max_model_len_for_concurrency(7281, 16, 8, 32768) == 910 * 16
    small = plan_kv_cache(bytes_per_block=1000, block_size=16, model_context_len=32768, budget_bytes=10_999)
    assert (small.num_blocks, small.max_model_len) == (10, 144)  # capped by the pool's 9 usable blocks


def test_plan_errors_match_the_engine() -> None:
    with pytest.raises(ValueError, match="holds 0 blocks"):
        plan_kv_cache(1000, 16, 4096, budget_bytes=999)
    with pytest.raises(ValueError, match="holds 1 blocks .* at least 2 .*null block"):
        plan_kv_cache(1000, 16, 4096, budget_bytes=1999)
    with pytest.raises(ValueError, match="override is 1; .*null block"):
        plan_kv_cache(1000, 16, 4096, num_blocks_override=1)
    with pytest.raises(ValueError, match="larger than the model's context length"):
        plan_kv_cache(1000, 16, 4096, budget_bytes=10**9, max_model_len=8192)
    with pytest.raises(ValueError, match="largest max-model-len that fits is 144"):
        plan_kv_cache(1000, 16, 4096, budget_bytes=10_999, max_model_len=145)
    assert plan_kv_cache(1000, 16, 4096, num_blocks_override=3).num_blocks == 3


def test_without_chunked_prefill_one_step_bounds_max_model_len() -> None:
    """#43 item 13: a prompt must fit one step when chunked prefill is off, so the step's budget caps the resolved
    max-model-len (the default) and refuses a larger explicit one."""
    plan = plan_kv_cache(1000, 16, 4096, budget_bytes=10**9, max_num_batched_tokens=512, enable_chunked_prefill=False)
    assert plan.max_model_len == 512
    assert plan_kv_cache(1000, 16, 4096, budget_bytes=10**9, max_num_batched_tokens=512).max_model_len == 4096
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens \(512\) is smaller than --max-model-len \(1024\)"):
        plan_kv_cache(
            1000,
            16,
            4096,
            budget_bytes=10**9,
            max_model_len=1024,
            max_num_batched_tokens=512,
            enable_chunked_prefill=False,
        )


def test_contiguous_vs_paged_by_hand() -> None:
    # 10 requests of 100 tokens, max-len 1000, 1000 bytes/token, 16-token blocks, a 10 MB budget.
    # contiguous: 10 x 1000 x 1000 = 10 MB reserved, 1 MB used (90% waste), 10 MB / 1 MB = 10 fit.
    # paged: 100 tokens -> 7 blocks = 112 tokens = 112,000 bytes each: 1.12 MB reserved, waste 12/112 = 10.71%,
    # 10,000,000 // 112,000 = 89 fit.
    cmp = compare_contiguous(1000, 16, requests=10, avg_len=100, max_len=1000, budget_bytes=10_000_000)
    assert (cmp.contiguous.allocated_bytes, cmp.contiguous.used_bytes) == (10_000_000, 1_000_000)
    assert cmp.contiguous.waste_perc == pytest.approx(90.0)
    assert cmp.contiguous.requests_that_fit == 10
    assert (cmp.paged.allocated_bytes, cmp.paged.used_bytes) == (1_120_000, 1_000_000)
    assert cmp.paged.waste_perc == pytest.approx(100 * 12 / 112)
    assert cmp.paged.requests_that_fit == 89


def test_dtype_resolution_follows_the_loader() -> None:
    assert resolve_compute_dtype("auto", "cpu", "bfloat16") == "float32"
    assert resolve_compute_dtype("auto", "cuda", "float16") == "float16"
    assert resolve_compute_dtype("auto", "cuda", None) == "bfloat16"
    assert resolve_kv_dtype("auto", "bfloat16") is BF16
    with pytest.raises(ValueError, match="unsupported --kv-cache-dtype"):
        resolve_kv_dtype("fp4", "bfloat16")


DENSE_TEXT_ONLY = [
    e
    for e in CATALOG
    if e.config["model_type"] in ("llama", "qwen2", "qwen3", "mistral") or e.name in ("gemma-3-270m", "gemma-3-1b-pt")
]  # Gemma 3 4B+ also count a vision tower


@pytest.mark.parametrize("entry", DENSE_TEXT_ONLY, ids=lambda e: e.name)
def test_catalog_configs_reproduce_the_published_parameter_counts(entry) -> None:
    """An independent check of each dense entry's config facts: they must add up to the model card's count."""
    _, model_config = kv_shape_from_hf_config(entry.config)
    assert model_config is not None
    assert dense_parameter_count(model_config) == pytest.approx(entry.num_parameters, rel=0.02)


def test_catalog_entries_cite_a_source() -> None:
    for entry in CATALOG:
        assert entry.source.startswith("https://huggingface.co/") and entry.source.endswith("config.json")
        kv_shape_from_hf_config(entry.config)  # every entry parses


HYBRIDS = [e for e in CATALOG if e.config["model_type"] in ("lfm2", "qwen3_5_text")]


@pytest.mark.parametrize("entry", HYBRIDS, ids=lambda e: e.name)
def test_catalog_hybrids_have_state_layers_and_lfm2_counts_add_up(entry) -> None:
    """The hybrid entries parse into their layer kinds (a state spec beside the attention layers); LFM2's configs add
    up to their model cards' counts (Qwen3.5's cards count the vision tower too: only the text part is checked, in
    test_parameter_count_of_hybrids_equals_hf)."""
    _, model_config = kv_shape_from_hf_config(entry.config)
    assert model_config is not None and model_config.state_spec is not None
    assert model_config.num_kv_layers == (6 if entry.config["model_type"] == "lfm2" else model_config.num_layers // 4)
    if entry.config["model_type"] == "lfm2":
        assert dense_parameter_count(model_config) == pytest.approx(entry.num_parameters, rel=0.02)


@pytest.mark.parametrize("variant", ["lfm2_hybrid", "qwen3_5_hybrid"])
def test_parameter_count_of_hybrids_equals_hf(variant, tmp_path) -> None:
    """dense_parameter_count on a hybrid's config equals the parameters HF transformers builds for it, exactly."""
    import json

    from tiny_models import build_tiny_hf_model

    model = build_tiny_hf_model(variant)
    model.save_pretrained(tmp_path)
    _, model_config = kv_shape_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert model_config is not None
    assert dense_parameter_count(model_config) == sum(p.numel() for p in model.parameters())
