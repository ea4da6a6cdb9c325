"""The native attention kernels on every KV cache element type (kernels/kv_dtypes.h), against the plain-torch reference
(attention/reference.py, which dequantizes the rows it gathers through LayerKVCache.read), and the native KV write
against kvserve/kv/quant.py's store, bit for bit.

The caches are filled by the torch write path (LayerKVCache.write), so kernel and reference read the same stored
values; the slots no context covers are poisoned (NaN values for 16/32-bit caches, NaN scales for 8-bit ones), so a
kernel that reads outside a context fails. Tolerance: atol = rtol = 2e-5, twice tests/unit/test_attention.py's (the
same softmax over the same values; only summation order and the polynomial exp differ, over rows scaled by up to ~5x
so that the 8-bit scales differ). Shapes: Qwen2.5-0.5B's (14 query
heads over 2 KV heads of 64), Gemma 3's (4 over 1 of 256), and head sizes with tails (12, 40); contexts around the
kernels' boundaries (a key tile of 8 or 16, chunks of 128 or 256 keys, parts of a split context), block sizes 1, 5, 16;
groups of 1-16 query heads a KV head (AVX2 takes groups of 4 or more with the heads on a vector's lanes);
sliding windows; 1-4 threads (the split over threads)."""

from __future__ import annotations

import math

import pytest
import torch
from paged_tables import context_slot_mask, shuffled_block_tables

from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.cpu import cpu_attention
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import reference_attention
from kvserve.kernels.native import cpu_supports_native, supported_isas
from kvserve.kernels.ops import NativeKernels, load_kernels
from kvserve.kv.cache import KVCacheConfig, LayerKVCache, allocate_kv_cache
from kvserve.kv.quant import compute_scales, quant_format, quantize
from kvserve.model.tokenizer import default_cache_dir

pytestmark = pytest.mark.skipif(not cpu_supports_native()[0], reason=cpu_supports_native()[1])

ATOL = RTOL = 2e-5
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
DTYPE_IDS = ["f32", "bf16", "f16", "int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.fixture(scope="module", params=supported_isas() or ["avx2"])
def native(request) -> NativeKernels:  # type: ignore[no-untyped-def]
    kernels = load_kernels(default_cache_dir() / "kernels", isa=request.param)
    assert isinstance(kernels, NativeKernels)
    return kernels


def _cache(
    seqs: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, LayerKVCache, AttentionMetadata]:
    """Queries for sequences given as (seq_len, query_len), and a cache of `dtype` holding random K/V at every
    context slot, through shuffled block tables; the other slots poisoned."""
    g = torch.Generator().manual_seed(seed)
    tables, meta, num_blocks = shuffled_block_tables(seqs, block_size, seed, spare_blocks=3)
    cache = allocate_kv_cache(KVCacheConfig(1, kv_heads, dim, block_size, dtype), num_blocks, torch.device("cpu"))[0]
    slots = torch.arange(num_blocks * block_size)
    # Rows of mixed magnitudes, so that the 8-bit scales differ from row to row.
    magnitude = torch.exp(0.5 * torch.randn(num_blocks * block_size, kv_heads, 1, generator=g))
    k = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g) * magnitude
    v = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g) * magnitude
    cache.write(k, v, slots)
    used = context_slot_mask(tables, seqs, block_size, num_blocks)
    if cache.key_scale is not None and cache.value_scale is not None:
        cache.key_scale.view(-1, kv_heads)[~used] = float("nan")
        cache.value_scale.view(-1, kv_heads)[~used] = float("nan")
    else:
        cache.key.view(-1, kv_heads, dim)[~used] = float("nan")
        cache.value.view(-1, kv_heads, dim)[~used] = float("nan")
    q = torch.randn(sum(n for _, n in seqs), heads, dim, generator=g)
    return q, cache, meta


def _check(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, window: int | None, native) -> None:  # type: ignore[no-untyped-def]
    layer = AttentionLayerSpec(q.shape[-1] ** -0.5, window)
    want = reference_attention(q, cache, meta, layer)
    got = cpu_attention(q, cache, meta, layer, kernels=native)
    if native.bf16_dot_products(cache.key.dtype, q.shape[-1]):
        # The attention kernels' bfloat16 dot products round the scaled queries and the softmax weights to bfloat16
        # (8 significant bits): each output off by up to ~1% of the outputs' scale, a few parts in a thousand on
        # average (measured: at most 0.6% and 0.25%; the float32 paths' bugs this file catches are errors of order 1).
        err = (got - want).abs()
        assert err.max() <= 0.02 * want.abs().max(), (err.max(), want.abs().max())
        assert err.mean() <= 0.005 * want.abs().mean(), (err.mean(), want.abs().mean())
        return
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


# (seqs, block_size, heads, kv_heads, dim, window): decodes (query length 1) and chunks (more).
DECODE_CASES = {
    "qwen_around_tiles_and_chunks": ([(1, 1), (15, 1), (16, 1), (17, 1), (129, 1), (300, 1)], 16, 14, 2, 64, None),
    "qwen_long_split": ([(1000, 1)], 16, 14, 2, 64, None),
    "gemma_window": ([(700, 1), (40, 1)], 16, 4, 1, 256, 512),
    "block_5_tail_dims": ([(77, 1), (3, 1)], 5, 6, 2, 40, None),
    "block_1_window": ([(90, 1), (33, 1)], 1, 3, 1, 12, 17),
    "mha_many_heads": ([(50, 1)], 4, 9, 1, 16, None),
    "dims_past_whole_pair_blocks": ([(150, 1), (33, 1)], 16, 8, 2, 48, None),
    # the AVX2 heads-on-lanes path: two score passes of 8 heads, weighted-sum passes of 4; a group of 6 at 128
    "group_of_16_head_128": ([(200, 1), (31, 1)], 16, 16, 1, 128, None),
    "group_of_6_head_128_window": ([(300, 1), (140, 1)], 16, 12, 2, 128, 100),
}
PREFILL_CASES = {
    "qwen_chunk_over_cached_prefix": ([(600, 37), (9, 1)], 16, 14, 2, 64, None),
    "qwen_verify_rows_at_depth": ([(900, 5)], 16, 14, 2, 64, None),
    "gemma_window": ([(700, 300)], 16, 4, 1, 256, 512),
    "block_5_tail_dims": ([(45, 20), (70, 2)], 5, 6, 2, 40, 30),
}


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_attention_reads_every_kv_dtype_in_place(case: str, dtype: torch.dtype, native) -> None:  # type: ignore[no-untyped-def]
    seqs, block_size, heads, kv_heads, dim, window = DECODE_CASES[case]
    q, cache, meta = _cache(seqs, block_size, heads, kv_heads, dim, dtype, seed=len(case) + dim)
    _check(q, cache, meta, window, native)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_attention_reads_every_kv_dtype_in_place(case: str, dtype: torch.dtype, native) -> None:  # type: ignore[no-untyped-def]
    seqs, block_size, heads, kv_heads, dim, window = PREFILL_CASES[case]
    q, cache, meta = _cache(seqs, block_size, heads, kv_heads, dim, dtype, seed=len(case) + dim)
    _check(q, cache, meta, window, native)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("seq_len", "window"), [(1, None), (2, None), (65, None), (129, None), (1000, 300), (4099, None)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["f32", "bf16", "int8"])
def test_split_context_at_its_boundaries(  # type: ignore[no-untyped-def]
    seq_len: int, window: int | None, threads: int, dtype: torch.dtype, native
) -> None:
    """Batch 1 on one KV head and on two: the context split into parts over the threads (some empty when it is
    shorter than the parts), each part's softmax sums merged by their log-sum-exp."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for heads, kv_heads in ((4, 1), (14, 2)):
            q, cache, meta = _cache([(seq_len, 1)], 16, heads, kv_heads, 64, dtype, seed=seq_len + threads)
            _check(q, cache, meta, window, native)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("seqs", "heads", "kv_heads", "window"),
    [([(1100, 5)], 4, 1, None), ([(2000, 4)], 4, 1, 512), ([(700, 6)], 14, 2, None), ([(300, 3)], 14, 2, 100)],
    ids=["gemma_verify", "gemma_verify_window", "qwen_verify", "qwen_verify_window"],
)
def test_verification_rows_split_over_threads(  # type: ignore[no-untyped-def]
    seqs: list[tuple[int, int]], heads: int, kv_heads: int, window: int | None, threads: int, native
) -> None:
    """A speculative verification's few query rows over a long context: the prefill kernel splits each (query tile,
    KV head) item's keys into parts over the threads (parts that see none of a row's keys included) and merges
    them, on a bfloat16 and an int8 cache."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.bfloat16, torch.int8):
            q, cache, meta = _cache(seqs, 16, heads, kv_heads, 64, dtype, seed=seqs[0][0] + threads)
            _check(q, cache, meta, window, native)
    finally:
        torch.set_num_threads(before)


def test_a_cache_without_its_scales_or_of_an_unknown_type_is_refused(native) -> None:  # type: ignore[no-untyped-def]
    """The kernels never guess: an 8-bit cache without scales, a 16-bit one with scales, or an element type they do
    not read is a ValueError naming it, never a misread cache."""
    q, cache, meta = _cache([(20, 1)], 4, 4, 1, 16, torch.int8, seed=3)
    args = (q, cache.key, cache.value, meta.block_tables, meta.seq_lens, None, 0.25)
    with pytest.raises(ValueError, match="needs scales"):
        native.paged_decode_attention(*args)
    bf16 = cache.key.float().to(torch.bfloat16)
    with pytest.raises(ValueError, match="takes no scales"):
        native.paged_decode_attention(q, bf16, bf16, *args[3:], cache.key_scale, cache.value_scale)
    doubles = cache.key.double()
    with pytest.raises(ValueError, match="paged attention reads"):
        native.paged_prefill_attention(q, doubles, doubles, meta.block_tables[0], 20, None, 0.25)
    assert not native.has_paged_attention(doubles) and native.has_paged_attention(bf16)


def test_isa_builds_agree() -> None:
    """The AVX-512 and AVX2 builds group keys by their vector widths (16 and 8) and so sum in different orders: the
    same result within float32 rounding, on a long split context."""
    if "avx512" not in supported_isas():
        pytest.skip("the CPU has no AVX-512")
    q, cache, meta = _cache([(3000, 1), (70, 1)], 16, 14, 2, 64, torch.bfloat16, seed=5)
    layer = AttentionLayerSpec(0.125, None)
    outs = [
        cpu_attention(q, cache, meta, layer, kernels=load_kernels(default_cache_dir() / "kernels", isa=isa))
        for isa in ("avx512", "avx2")
    ]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)


def _fp8_grid(fmt_max: float, mant: int, bias: int) -> torch.Tensor:
    """Every finite magnitude of a float8 format (as float32), the midpoints between neighbours (ties, which round
    to the even code), and points just off each midpoint."""
    values = []
    for e in range(0, 2 ** (7 - mant)):
        for m in range(2**mant):
            v = (m / 2**mant) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mant) * 2.0 ** (e - bias)
            if v <= fmt_max:
                values.append(v)
    grid = torch.tensor(sorted(set(values)), dtype=torch.float64)
    mid = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([grid, mid, mid * (1 + 2**-20), mid * (1 - 2**-20)]).float()
    return torch.cat([points, -points])


@pytest.mark.parametrize(
    ("dtype", "mant", "bias"), [(torch.float8_e4m3fn, 3, 7), (torch.float8_e5m2, 2, 15)], ids=["e4m3", "e5m2"]
)
def test_fp8_write_rounds_like_torch_at_every_code_and_tie(dtype: torch.dtype, mant: int, bias: int, native) -> None:  # type: ignore[no-untyped-def]
    """Rows whose largest magnitude is the format's largest value have a scale of exactly 1 (x / 1 = x), so the
    native encoding of each grid point is compared with torch's cast directly: every code, every tie between two
    codes (round half to even), subnormals, zeros."""
    fmt = quant_format(dtype)
    assert fmt is not None
    points = _fp8_grid(fmt.max_value, mant, bias)
    dim = 63
    rows = math.ceil(points.numel() / dim)
    x = torch.zeros(rows, dim + 1)
    x[:, :dim] = torch.cat([points, torch.zeros(rows * dim - points.numel())]).view(rows, dim)
    x[:, dim] = fmt.max_value  # each row's largest magnitude: its scale is 1
    got, scales = native.store_kv_rows(x, dtype)
    assert scales is not None and torch.equal(scales, torch.ones(rows))
    assert torch.equal(got.view(torch.uint8), x.to(dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype", KV_DTYPES[1:], ids=DTYPE_IDS[1:])
def test_kv_write_equals_the_torch_store_bit_for_bit(dtype: torch.dtype, native) -> None:  # type: ignore[no-untyped-def]
    """The native layer's KV write (kv_dtypes.h's store_row) against kvserve/kv/quant.py's store: random rows over 60
    orders of magnitude, rows of zeros, of one value, with huge and tiny values (float16 overflow, subnormals)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 64, generator=g) * torch.exp(torch.randn(200, 1, generator=g) * 8)
    x[0] = 0
    x[1] = 3.0
    x[2, :32] = 1e-40
    x[3] = torch.linspace(-70000, 70000, 64)
    x[4] = torch.linspace(-1e-6, 1e-6, 64)
    got, scales = native.store_kv_rows(x, dtype)
    fmt = quant_format(dtype)
    if fmt is None:
        assert scales is None
        assert torch.equal(got.view(torch.int16), x.to(dtype).view(torch.int16))
        return
    scale = compute_scales(x, fmt)
    assert scales is not None and torch.equal(scales, scale.squeeze(-1))
    assert torch.equal(got.view(torch.uint8), quantize(x, scale, fmt).view(torch.uint8))
