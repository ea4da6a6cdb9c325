"""The CPU attention backend against the reference, on random paged caches.

Tolerance: fp32, atol = rtol = 1e-5 (both compute the same softmax; only summation order differs, and the
native prefill kernel's polynomial exp adds ~2e-7 relative; it measures ~1e-6 absolute at head_dim 256).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from paged_tables import context_slot_mask, shuffled_block_tables

from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.cpu import cpu_attention
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import reference_attention
from kvserve.kernels.native import cpu_supports_native, supported_isas
from kvserve.kernels.ops import TorchKernels, load_kernels
from kvserve.kv.cache import KVCacheConfig, LayerKVCache, allocate_kv_cache
from kvserve.model.tokenizer import default_cache_dir

ATOL = RTOL = 1e-5


def _scenario(
    seqs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int, seed: int, head_dim: int = 16
):
    """Random caches + shuffled (non-contiguous) block tables for sequences given as (seq_len, query_len)."""
    torch.manual_seed(seed)
    tables, meta, num_blocks = shuffled_block_tables(seqs, block_size, seed, spare_blocks=5)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    # Slots outside every context hold NaN: a backend that reads them (even masked) fails the comparison.
    used = context_slot_mask(tables, seqs, block_size, num_blocks)
    k_cache.view(-1, num_kv_heads, head_dim)[~used] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[~used] = float("nan")
    q = torch.randn(sum(q for _, q in seqs), num_heads, head_dim)
    return q, k_cache, v_cache, meta


CASES = {
    "decode_only": [(1, 1), (5, 1), (17, 1), (33, 1)],
    "prefill_only": [(12, 12), (7, 7)],
    "mixed": [(20, 20), (9, 1), (30, 7), (1, 1), (16, 3), (40, 1)],
    "chunked_prefill_later_chunk": [(21, 7), (14, 7)],
}


@pytest.fixture(scope="module", params=["torch", *(supported_isas() or ["native"])])
def kernels(request):  # type: ignore[no-untyped-def]
    """The CPU backend with plain torch, and with the compiled paged attention of each build this CPU runs."""
    if request.param == "torch":
        return TorchKernels()
    ok, why = cpu_supports_native()
    if not ok:
        pytest.skip(why)
    return load_kernels(default_cache_dir() / "kernels", isa=request.param)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 1, 6, 100])
@pytest.mark.parametrize("block_size", [1, 4])
def test_cpu_matches_reference(case: str, heads: tuple[int, int], window: int | None, block_size: int, kernels) -> None:  # type: ignore[no-untyped-def]
    q, kc, vc, meta = _scenario(CASES[case], block_size, *heads, seed=zlib.crc32(repr((case, heads, window)).encode()))
    scale = 0.3
    cache, layer = LayerKVCache(kc, vc), AttentionLayerSpec(scale, window)
    ref = reference_attention(q, cache, meta, layer)
    fast = cpu_attention(q, cache, meta, layer, kernels=kernels)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=RTOL)


def test_native_paged_attention_takes_long_contexts_and_wide_heads(kernels) -> None:  # type: ignore[no-untyped-def]
    """head_dim 256 (Gemma 3) and a context of many blocks, decode only."""
    q, kc, vc, meta = _scenario([(300, 1), (77, 1)], 16, 4, 1, seed=7, head_dim=256)
    cache, layer = LayerKVCache(kc, vc), AttentionLayerSpec(0.0625, None)
    ref = reference_attention(q, cache, meta, layer)
    torch.testing.assert_close(cpu_attention(q, cache, meta, layer, kernels=kernels), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 1, 24), (3, 1, 12), (8, 2, 40), (9, 1, 16)])
def test_decode_of_wide_groups_and_odd_head_sizes(heads: int, kv_heads: int, head_dim: int, kernels) -> None:  # type: ignore[no-untyped-def]
    """The native decode kernel takes the query heads of a KV head four at a time and V's columns sixteen at a
    time: groups of 3, 4 + 2, 4 + 4 + 1 and head sizes with a tail after the sixteens (or no sixteen at all)."""
    q, kc, vc, meta = _scenario(
        [(45, 1), (3, 1), (17, 1)], 4, heads, kv_heads, seed=heads * 100 + head_dim, head_dim=head_dim
    )
    cache, layer = LayerKVCache(kc, vc), AttentionLayerSpec(head_dim**-0.5, None)
    ref = reference_attention(q, cache, meta, layer)
    torch.testing.assert_close(cpu_attention(q, cache, meta, layer, kernels=kernels), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window"), [(4, 1, 256, None), (6, 1, 24, 9), (8, 2, 40, None), (3, 1, 12, 5)]
)
def test_native_decode_attention_reads_an_int8_cache_in_place(
    heads: int, kv_heads: int, head_dim: int, window: int | None, kernels
) -> None:  # type: ignore[no-untyped-def]
    """The int8 decode kernel (the native layer path's, for --kv-cache-dtype int8) against the reference on the
    same int8 cache, which dequantizes the rows it gathers: the same values, summed in another order."""
    if isinstance(kernels, TorchKernels):
        pytest.skip("the torch kernels have no paged attention")
    q, kc, vc, meta = _scenario(
        [(45, 1), (3, 1), (17, 1), (300, 1)], 16, heads, kv_heads, seed=heads * 10 + head_dim, head_dim=head_dim
    )
    kc, vc = torch.nan_to_num(kc), torch.nan_to_num(vc)  # quantized, unused slots are zeros with a unit scale
    spec = KVCacheConfig(1, kv_heads, head_dim, 16, torch.int8)
    cache = allocate_kv_cache(spec, kc.shape[0], torch.device("cpu"))[0]
    slots = torch.arange(kc.shape[0] * 16)
    cache.write(kc.view(-1, kv_heads, head_dim), vc.view(-1, kv_heads, head_dim), slots)
    layer = AttentionLayerSpec(head_dim**-0.5, window)
    ref = reference_attention(q, cache, meta, layer)
    got = kernels.paged_decode_attention(
        q,
        cache.key,
        cache.value,
        meta.block_tables,
        meta.seq_lens,
        window,
        head_dim**-0.5,
        cache.key_scale,
        cache.value_scale,
    )
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("seq_len", "window", "threads"),
    [(300, None, 2), (1, None, 2), (2, None, 3), (3, 2, 2), (700, 512, 2), (41, None, 4), (41, None, 1)],
)
def test_decode_of_one_sequence_split_over_threads(seq_len: int, window: int | None, threads: int, kernels) -> None:  # type: ignore[no-untyped-def]
    """Batch 1 on one KV head: the native kernel splits the context over threads and merges the parts' softmax
    sums (some parts empty when the context is shorter than the thread count)."""
    q, kc, vc, meta = _scenario([(seq_len, 1)], 16, 4, 1, seed=seq_len, head_dim=256)
    cache, layer = LayerKVCache(kc, vc), AttentionLayerSpec(0.0625, window)
    ref = reference_attention(q, cache, meta, layer)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_attention(q, cache, meta, layer, kernels=kernels)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


# Prefill chunks on the Gemma 3 shape (head_dim 256, 4 heads over 1 KV head) and around it: whole prompts and
# later chunks, windows smaller and larger than the context, GQA 2 and 4, MQA, MHA, block sizes 16 and 5,
# chunk lengths that are no multiple of the kernel's tiles, decode rows in the same batch, a head_dim that is no
# multiple of 8. With the native kernels they go through paged_prefill_attention (checked by counting calls).
PREFILL_CASES = {
    "gemma_whole_prompt": ([(512, 512)], 16, 4, 1, 256, None),
    "gemma_later_chunk_window": ([(700, 300)], 16, 4, 1, 256, 512),
    "gqa2_window_inside": ([(600, 600)], 5, 4, 2, 64, 100),
    "gqa4_mixed_batch": ([(45, 20), (9, 1), (130, 130), (3, 1), (70, 2)], 5, 8, 2, 64, 1000),
    "mqa_later_chunk": ([(150, 61)], 5, 8, 1, 64, 40),
    "mha_tiny_window": ([(77, 77)], 16, 4, 4, 64, 7),
    "short_chunk_long_context": ([(600, 17), (33, 33)], 16, 2, 1, 64, None),
    "head_dim_12": ([(40, 40), (25, 9)], 4, 4, 2, 12, None),
    # the AVX-512 output step's column tails: 32 + 8 and 16 + 8
    "head_dim_40": ([(50, 50), (30, 11)], 4, 4, 2, 40, None),
    "head_dim_24": ([(37, 37)], 4, 4, 1, 24, 9),
}


@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_matches_reference(case: str, kernels, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seqs, block_size, heads, kv_heads, head_dim, window = PREFILL_CASES[case]
    q, kc, vc, meta = _scenario(seqs, block_size, heads, kv_heads, seed=zlib.crc32(case.encode()), head_dim=head_dim)
    calls: list[int] = []
    if kernels.name == "native":
        native_prefill = type(kernels).paged_prefill_attention
        monkeypatch.setattr(
            type(kernels),
            "paged_prefill_attention",
            lambda self, q, *a, **kw: calls.append(q.shape[0]) or native_prefill(self, q, *a, **kw),
        )
    scale = head_dim**-0.5
    cache, layer = LayerKVCache(kc, vc), AttentionLayerSpec(scale, window)
    ref = reference_attention(q, cache, meta, layer)
    torch.testing.assert_close(cpu_attention(q, cache, meta, layer, kernels=kernels), ref, atol=ATOL, rtol=RTOL)
    if kernels.name == "native":
        assert calls == [n for n in meta.query_lens_cpu if n > 1]


def test_reference_matches_dense_causal_sdpa() -> None:
    """The reference itself, on one contiguous whole prompt, equals plain causal attention."""
    q, kc, vc, meta = _scenario([(13, 13)], 4, 4, 2, seed=3)
    slots = meta.slot_mapping
    k = kc.view(-1, 2, 16)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    v = vc.view(-1, 2, 16)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=0.25).transpose(0, 1)
    got = reference_attention(q, LayerKVCache(kc, vc), meta, AttentionLayerSpec(0.25, None))
    torch.testing.assert_close(got, dense, atol=ATOL, rtol=RTOL)


def test_sliding_window_one_sees_only_itself() -> None:
    q, kc, vc, meta = _scenario([(9, 3), (5, 1)], 4, 2, 1, seed=4)
    out = cpu_attention(q, LayerKVCache(kc, vc), meta, AttentionLayerSpec(1.0, 1))
    v_flat = vc.view(-1, 1, 16)
    expected = v_flat[meta.slot_mapping].expand(-1, 2, -1)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_cache_write_places_tokens_at_slots() -> None:
    kc = torch.zeros(6, 4, 2, 8)
    vc = torch.zeros(6, 4, 2, 8)
    meta = AttentionMetadata.build([[3, 1]], [6], [3], 4, torch.device("cpu"))  # positions 3, 4, 5
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    LayerKVCache(kc, vc).write(k, v, meta.slot_mapping)
    torch.testing.assert_close(kc[3, 3], k[0])
    torch.testing.assert_close(kc[1, 0], k[1])
    torch.testing.assert_close(vc[1, 1], v[2])
    assert kc.abs().sum() == k.abs().sum()
