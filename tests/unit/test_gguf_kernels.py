"""The GGUF block matmul (kernels/gguf_matmul.cpp) and its torch fallback against the reference: gguf-py's
dequantization (what HF transformers loads GGUF weights with) and a float32 matmul, on random blocks of each
native type, at odd shapes: M = 1, 3, 17 (the micro-kernel's 3- or 4-row tiles and their tails) and every M from 1
to 12 (the in-register decode path, and the blocked one with each tail of both tile widths), N not a multiple of the
4-row weight block, K of one block, of several, and over the driver's 1024-weight k-chunk. Each test runs on every
build this CPU can run (AVX2; AVX-512 where it has it: kvserve/kernels/native.py).

Tolerance: the result may differ from the reference only by summation order, so by a few float32 ulps of the
accumulated magnitude: |y - ref| <= 1e-5 * sqrt(K) * (rms of |x| |w| products' scale), stated below as
atol = 1e-4 * sqrt(K) on inputs and weights of order 1. The dequantized weights themselves must be bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.kernels.gguf_blocks import NATIVE_GGUF_TYPES, dequantize_blocks, row_bytes
from kvserve.kernels.native import cpu_supports_native, supported_isas
from kvserve.kernels.ops import NativeKernels, TorchKernels, load_kernels
from kvserve.model.tokenizer import default_cache_dir

NATIVE_OK, WHY = cpu_supports_native()
TYPES = sorted(NATIVE_GGUF_TYPES)
# Byte offsets of each type's float16 scale fields inside a block (the rest of a block is any bits).
_F16_FIELDS = {2: (0,), 6: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes]: random bits, with each block's float16 scales set to finite values that keep the
    dequantized weights of order 1."""
    fmt = NATIVE_GGUF_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // fmt.block, fmt.nbytes), dtype=np.uint8)
    per_weight = {32: 1 / 16, 256: 1 / 64}[fmt.block]
    for offset in _F16_FIELDS[qtype]:
        scales = (rng.uniform(0.2, 1.0, size=(n, k // fmt.block)) * per_weight).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(n, k // fmt.block, 2)
    return torch.from_numpy(raw.reshape(n, row_bytes(qtype, k)))


def shapes_for(qtype: int) -> list[tuple[int, int, int]]:
    """(M, N, K): K of one block, several, and beyond one 1024-weight chunk; N with a tail after the 4-row
    blocks; M = 1, 3, 17."""
    block = NATIVE_GGUF_TYPES[qtype].block
    ks = [block, 5 * block, 2048 + block] if block == 32 else [256, 1024, 2560]
    return [(m, n, k) for m, n, k in zip((1, 3, 17), (7, 13, 30), ks)] + [(17, 5, ks[-1]), (1, 66, ks[0])]


def reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    return x.double() @ dequantize_blocks(blocks, qtype).double().T


@pytest.fixture(scope="module", params=supported_isas() or ["none"])
def native(request) -> NativeKernels:
    if not NATIVE_OK:
        pytest.skip(WHY)
    kernels = load_kernels(default_cache_dir() / "kernels", isa=request.param)
    assert isinstance(kernels, NativeKernels), "this machine has a compiler and AVX2: the native kernels must build"
    return kernels


@pytest.mark.parametrize("qtype", TYPES, ids=[NATIVE_GGUF_TYPES[t].name for t in TYPES])
def test_native_dequantize_is_bit_exact(native, qtype: int) -> None:
    blocks = random_blocks(qtype, 9, shapes_for(qtype)[1][2], seed=qtype)
    assert torch.equal(native.gguf_dequantize(blocks, qtype), dequantize_blocks(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=[NATIVE_GGUF_TYPES[t].name for t in TYPES])
def test_native_matmul_matches_dequantized_float_matmul(native, qtype: int) -> None:
    for i, (m, n, k) in enumerate(shapes_for(qtype)):
        blocks = random_blocks(qtype, n, k, seed=100 * qtype + i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        got = native.gguf_matmul(x, blocks, qtype)
        torch.testing.assert_close(
            got.double(),
            reference(x, blocks, qtype),
            rtol=0,
            atol=1e-4 * k**0.5,
            msg=lambda s, m=m, n=n, k=k: f"M={m} N={n} K={k}: {s}",
        )


@pytest.mark.parametrize("qtype", TYPES, ids=[NATIVE_GGUF_TYPES[t].name for t in TYPES])
def test_native_matmul_at_every_decode_row_count(native, qtype: int) -> None:
    """M = 1..12 covers the in-register path at each of its activation-row counts (1-4) and the blocked one past
    it with every tail of its 3-row (AVX2) or 4-row (AVX-512) tiles; N = 11 and 13 leave a tail after the 4-row
    weight groups, N = 3 has no full group at all, and N = 23 has more than two groups (each prefetching the
    next)."""
    block = NATIVE_GGUF_TYPES[qtype].block
    for n, k in ((11, 3 * block), (3, block), (23, 2 * block), (13, 5 * block)):
        blocks = random_blocks(qtype, n, k, seed=qtype + n)
        for m in range(1, 13):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            torch.testing.assert_close(
                native.gguf_matmul(x, blocks, qtype).double(),
                reference(x, blocks, qtype),
                rtol=0,
                atol=1e-4 * k**0.5,
                msg=lambda s, m=m, n=n: f"M={m} N={n}: {s}",
            )


@pytest.mark.parametrize("qtype", TYPES, ids=[NATIVE_GGUF_TYPES[t].name for t in TYPES])
def test_native_matmul_writes_a_column_slice_in_place(native, qtype: int) -> None:
    """A fused layer's parts each write their columns of one output buffer (rows ldy apart)."""
    k = NATIVE_GGUF_TYPES[qtype].block * 4
    blocks = random_blocks(qtype, 6, k, seed=qtype)
    for m in (2, 5):  # the in-register path (up to 3 rows) and the blocked one
        x = torch.randn(m, k)
        out = torch.full((m, 20), 7.0)
        native.gguf_matmul(x, blocks, qtype, out=out[:, 9:15])
        torch.testing.assert_close(out[:, 9:15].double(), reference(x, blocks, qtype), rtol=0, atol=1e-4 * k**0.5)
        assert (out[:, :9] == 7).all() and (out[:, 15:] == 7).all()


@pytest.mark.parametrize("qtype", TYPES, ids=[NATIVE_GGUF_TYPES[t].name for t in TYPES])
def test_torch_fallback_matches_reference(qtype: int) -> None:
    m, n, k = shapes_for(qtype)[2]
    blocks = random_blocks(qtype, n, k, seed=qtype)
    x = torch.randn(m, k)
    got = TorchKernels(slab_rows=8).gguf_matmul(x, blocks, qtype)  # several slabs
    torch.testing.assert_close(got.double(), reference(x, blocks, qtype), rtol=0, atol=1e-4 * k**0.5)


def test_native_rejects_misshaped_blocks(native) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        native.gguf_matmul(torch.randn(2, 64), random_blocks(8, 3, 32), 8)
