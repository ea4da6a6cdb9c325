"""8-bit KV cache (kvserve/kv/quant.py, kv/cache.py): round-trip error within each format's bound, saturation
instead of inf/NaN, pieces == whole, both attention backends reading quantized caches, and the byte math
agreeing with kvserve.capacity."""

from __future__ import annotations

import logging
import zlib

import pytest
import torch

from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.cpu import cpu_attention
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import reference_attention
from kvserve.capacity import KVShape, num_blocks_for_budget
from kvserve.config import EngineConfig
from kvserve.kv.cache import KVCacheConfig, LayerKVCache, allocate_kv_cache, resolve_kv_cache_dtype
from kvserve.kv.quant import KV_QUANT_FORMATS, KVQuantFormat, compute_scales, dequantize, fake_quantize, quantize
from kvserve.vocab import KV_DTYPES

FORMATS = sorted(KV_QUANT_FORMATS)
CPU = torch.device("cpu")


def error_bound(fmt: KVQuantFormat, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest round-trip error allowed for each element of x given its (broadcastable) scale: half a step
    of the format's grid at that magnitude (relative for fp8 normals, absolute below them and for int8)."""
    if not fmt.is_float:
        return scale / 2
    info = torch.finfo(fmt.storage)
    mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fmt.storage]
    smallest_subnormal = info.smallest_normal * 2.0**-mantissa_bits
    return torch.maximum(x.abs() * 2.0 ** -(mantissa_bits + 1), scale * smallest_subnormal / 2)


def _data(kind: str, seed: int) -> torch.Tensor:
    """[tokens, kv_heads, head_dim] test data; "outliers" puts a few channels 100-1000x above the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 2, 128, generator=g)
    if kind == "outliers":
        x[..., :3] *= 1000.0
        x[::7, :, 50] = -300.0
        x[5] = 0.0  # an all-zero token: scale floor, no 0/0
    elif kind == "tiny":
        x *= 1e-20
    return x


@pytest.mark.parametrize("kind", ["random", "outliers", "tiny"])
@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_within_format_bound(name: str, kind: str) -> None:
    fmt = KV_QUANT_FORMATS[name]
    x = _data(kind, zlib.crc32(f"{name}{kind}".encode()))
    scale = compute_scales(x, fmt)
    y = dequantize(quantize(x, scale, fmt), scale, torch.float32)
    bound = error_bound(fmt, x, scale)
    assert torch.isfinite(y).all()
    assert ((y - x).abs() <= bound * (1 + 1e-5) + 1e-30).all(), (y - x).abs().max()
    # The vector's largest magnitude is represented (almost) exactly: that is what the scale is for.
    amax = x.abs().amax(-1)
    assert torch.allclose(y.abs().amax(-1), amax, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_huge_values_saturate_never_overflow(name: str, dtype: torch.dtype) -> None:
    fmt = KV_QUANT_FORMATS[name]
    big = torch.finfo(dtype).max
    x = torch.tensor([[[big, -big, big / 3, 1.0, 0.0, -1e-3]]], dtype=dtype)
    y = fake_quantize(x, fmt)
    assert torch.isfinite(y).all() and y.dtype == dtype
    assert y[0, 0, 0].item() == pytest.approx(big, rel=1e-2) and y[0, 0, 1].item() == pytest.approx(-big, rel=1e-2)
    # A scale that is far too small (e.g. a wrong static scale) clips to the format's largest value.
    q = quantize(x.float() * 1e6, torch.ones(1, 1, 1), fmt)
    assert torch.isfinite(q.float()).all()
    assert q.float().abs().max() == fmt.max_value


def _paged(spec_dtype: torch.dtype, num_blocks: int = 8, block_size: int = 4) -> LayerKVCache:
    spec = KVCacheConfig(1, 2, 16, block_size, spec_dtype)
    return allocate_kv_cache(spec, num_blocks, CPU)[0]


@pytest.mark.parametrize("name", FORMATS)
def test_block_written_in_pieces_equals_written_whole(name: str) -> None:
    """Prefill chunks then decode appends store exactly the bytes and scales of one whole write."""
    storage = KV_QUANT_FORMATS[name].storage
    torch.manual_seed(0)
    k, v = torch.randn(11, 2, 16) * 5, torch.randn(11, 2, 16)
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7, 28, 29, 30])  # blocks 3, 1, 7: not contiguous
    whole, pieces = _paged(storage), _paged(storage)
    whole.write(k, v, slots)
    for a, b in [(0, 5), (5, 6), (6, 7), (7, 11)]:
        pieces.write(k[a:b], v[a:b], slots[a:b])
    for attr in ("key", "value", "key_scale", "value_scale"):  # the written slots (the rest is uninitialized)
        got, want = (getattr(c, attr).flatten(0, 1)[slots] for c in (pieces, whole))
        assert torch.equal(
            got.view(torch.uint8) if got.dtype == storage else got,
            want.view(torch.uint8) if want.dtype == storage else want,
        ), attr
    rk, rv = whole.read(slots, torch.float32)
    fmt = KV_QUANT_FORMATS[name]
    assert ((rk - k).abs() <= error_bound(fmt, k, compute_scales(k, fmt)) * (1 + 1e-5)).all()
    assert rv.shape == v.shape


def test_unquantized_cache_rejects_scales_and_quantized_needs_them() -> None:
    plain, q = _paged(torch.float32), _paged(torch.int8)
    with pytest.raises(ValueError):
        LayerKVCache(plain.key, plain.value, q.key_scale, q.value_scale).read(torch.tensor([0]), torch.float32)
    with pytest.raises(ValueError):
        LayerKVCache(q.key, q.value).write(torch.ones(1, 2, 16), torch.ones(1, 2, 16), torch.tensor([0]))


def _scenario(seqs: list[tuple[int, int]], block_size: int, heads: tuple[int, int], storage: torch.dtype, seed: int):
    """A paged cache written through LayerKVCache.write (so quantized exactly as the engine does) plus queries."""
    num_heads, num_kv_heads = heads
    torch.manual_seed(seed)
    need = [-(-s // block_size) for s, _ in seqs]
    perm = (torch.randperm(sum(need) + 3) + 1).tolist()  # block 0 is padding
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    cache = _paged_heads(storage, sum(need) + 4, block_size, num_kv_heads)
    full = AttentionMetadata.build(tables, [s for s, _ in seqs], [s for s, _ in seqs], block_size, CPU)
    t = int(full.slot_mapping.numel())
    k = torch.randn(t, num_kv_heads, 32) * torch.linspace(0.1, 8, 32)  # uneven channel magnitudes
    cache.write(k, torch.randn(t, num_kv_heads, 32), full.slot_mapping)
    meta = AttentionMetadata.build(tables, [s for s, _ in seqs], [q for _, q in seqs], block_size, CPU)
    q = torch.randn(sum(q for _, q in seqs), num_heads, 32)
    return q, cache, meta


def _paged_heads(storage: torch.dtype, num_blocks: int, block_size: int, kv_heads: int) -> LayerKVCache:
    return allocate_kv_cache(KVCacheConfig(1, kv_heads, 32, block_size, storage), num_blocks, CPU)[0]


CASES = {"decode": [(1, 1), (9, 1), (23, 1)], "mixed": [(20, 20), (9, 1), (30, 7), (16, 3)]}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("name", FORMATS)
def test_cpu_backend_matches_reference_on_quantized_cache(name, case, heads, window) -> None:
    q, c, meta = _scenario(
        CASES[case], 4, heads, KV_QUANT_FORMATS[name].storage, zlib.crc32(repr((name, case, heads, window)).encode())
    )
    ref = reference_attention(q, c, meta, AttentionLayerSpec(0.2, window))
    fast = cpu_attention(q, c, meta, AttentionLayerSpec(0.2, window))
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,tol", [("fp8_e4m3", 0.08), ("fp8_e5m2", 0.15), ("int8", 0.03)])
def test_quantized_attention_stays_close_to_float32(name: str, tol: float) -> None:
    """Same K/V written into a float32 and an 8-bit cache: attention outputs differ by the format's noise."""
    seed = zlib.crc32(name.encode())
    q, c8, meta = _scenario(CASES["mixed"], 4, (4, 1), KV_QUANT_FORMATS[name].storage, seed)
    _, c32, _ = _scenario(CASES["mixed"], 4, (4, 1), torch.float32, seed)
    out8 = cpu_attention(q, c8, meta, AttentionLayerSpec(0.2, None))
    out32 = cpu_attention(q, c32, meta, AttentionLayerSpec(0.2, None))
    rel = (out8 - out32).norm() / out32.norm()
    assert rel < tol, rel


def test_bf16_compute_reads_quantized_cache() -> None:
    q, c, meta = _scenario(CASES["mixed"], 4, (4, 2), torch.float8_e4m3fn, 1)
    out = cpu_attention(q.bfloat16(), c, meta, AttentionLayerSpec(0.2, None))
    ref = reference_attention(q, c, meta, AttentionLayerSpec(0.2, None))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_bytes_per_token_agrees_with_capacity_math(name: str) -> None:
    """The engine's spec and `kvserve estimate` price a token identically (Gemma 3 270M's shape)."""
    spec = KVCacheConfig(18, 1, 256, 16, resolve_kv_cache_dtype(name, torch.float32))
    shape = KVShape(18, 1, 256, 4, (None,) * 18)
    assert spec.bytes_per_token == shape.bytes_per_token(KV_DTYPES[name])


def test_block_counts_at_the_same_budget() -> None:
    """8-bit: >= 3.8x the blocks of float32 and ~2x those of 16-bit, less the scales' share."""

    def blocks_of(name: str) -> int:
        spec = KVCacheConfig(18, 1, 256, 16, resolve_kv_cache_dtype(name, torch.float32))
        return num_blocks_for_budget(4 << 30, spec.bytes_per_block)

    blocks = {name: blocks_of(name) for name in ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")}
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        assert blocks[name] / blocks["float32"] >= 3.8
        assert 1.9 <= blocks[name] / blocks["bfloat16"] <= 2.0


def test_dtype_names() -> None:
    assert resolve_kv_cache_dtype("fp8", torch.float32) == resolve_kv_cache_dtype("fp8_e4m3", torch.float32)
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("int8", torch.bfloat16) == torch.int8
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
        EngineConfig(kv_cache_dtype=name)
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    assert KVCacheConfig(1, 1, 8, 4, torch.float8_e4m3fn).dtype_name == "fp8_e4m3"
    assert KVCacheConfig(1, 1, 8, 4, torch.bfloat16).dtype_name == "bfloat16"


def test_allocation_puts_scales_beside_blocks_and_logs(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.kv.cache"):
        caches = allocate_kv_cache(KVCacheConfig(3, 2, 8, 4, torch.int8), 5, CPU)
    assert len(caches) == 3
    assert caches[0].key.shape == (5, 4, 2, 8) and caches[0].key.dtype == torch.int8
    assert caches[0].key_scale.shape == (5, 4, 2) and caches[0].value_scale.dtype == torch.float32
    assert "int8" in caplog.text and "5 blocks" in caplog.text
    plain = allocate_kv_cache(KVCacheConfig(1, 2, 8, 4, torch.float16), 5, CPU)[0]
    assert plain.key_scale is None and plain.value_scale is None
