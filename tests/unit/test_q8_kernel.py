"""The q8_0 matmul: quantization round trips, the compiled kernel against the torch one (the reference) on
shapes that exercise every remainder path, and the build's cache and fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvserve.kernels.q8 import (
    GROUP_SIZE,
    NativeQ8Kernel,
    TorchQ8Kernel,
    build_native_library,
    cpu_supports_native,
    dequantize_q8,
    load_q8_kernel,
    quantize_q8,
)

NATIVE_OK, WHY = cpu_supports_native()
needs_native = pytest.mark.skipif(not NATIVE_OK, reason=WHY)


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> NativeQ8Kernel:
    if not NATIVE_OK:
        pytest.skip(WHY)
    kernel = load_q8_kernel(tmp_path_factory.mktemp("kernels"))
    assert isinstance(kernel, NativeQ8Kernel), "this machine has a compiler and AVX2: the native kernel must build"
    return kernel


def test_quantize_round_trip_is_exact_for_q8_values() -> None:
    """Weights that already are int8 x a per-block scale (a GGUF Q8_0 tensor) come back unchanged."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (6, 4 * GROUP_SIZE), generator=g, dtype=torch.int8)
    q[:, ::GROUP_SIZE] = 127  # each block's largest value sets its scale, as Q8_0 does
    scales = torch.rand(6, 4, generator=g) + 0.01
    w = dequantize_q8(q, scales)
    q2, s2 = quantize_q8(w)
    torch.testing.assert_close(dequantize_q8(q2, s2), w, atol=0, rtol=1e-6)


def test_quantize_error_is_half_a_step() -> None:
    w = torch.randn(33, 96, generator=torch.Generator().manual_seed(1))
    q, scales = quantize_q8(w)
    assert q.dtype == torch.int8 and scales.shape == (33, 3)
    step = scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert ((dequantize_q8(q, scales) - w).abs() <= step / 2 + 1e-7).all()
    zero_q, zero_s = quantize_q8(torch.zeros(2, 32))
    assert not zero_q.any() and not zero_s.any()  # an all-zero block is not a division by zero


def test_quantize_rejects_unaligned_input() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8(torch.randn(4, 40))


def test_torch_kernel_slabs_match_one_matmul() -> None:
    g = torch.Generator().manual_seed(2)
    q, s = quantize_q8(torch.randn(1000, 64, generator=g))
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(TorchQ8Kernel(slab_rows=128).matmul(x, q, s), x @ dequantize_q8(q, s).T)


@needs_native
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 33])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 64), (130, 640), (7, 2080)])  # 2080 > the kernel's stack buffer
def test_native_matches_torch(native: NativeQ8Kernel, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    q, s = quantize_q8(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    got = native.matmul(x, q, s)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, TorchQ8Kernel().matmul(x, q, s), atol=1e-4, rtol=1e-4)


@needs_native
def test_native_takes_non_contiguous_and_half_inputs(native: NativeQ8Kernel) -> None:
    g = torch.Generator().manual_seed(3)
    q, s = quantize_q8(torch.randn(10, 64, generator=g))
    x = torch.randn(64, 4, generator=g).T  # a transposed view
    torch.testing.assert_close(native.matmul(x, q, s), TorchQ8Kernel().matmul(x, q, s), atol=1e-4, rtol=1e-4)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(native.matmul(xb, q, s), TorchQ8Kernel().matmul(xb, q, s), atol=1e-4, rtol=1e-4)


@needs_native
def test_native_rejects_mismatched_shapes(native: NativeQ8Kernel) -> None:
    q, s = quantize_q8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="do not fit"):
        native.matmul(torch.randn(2, 32), q, s)


@needs_native
def test_build_is_cached(tmp_path: Path) -> None:
    first = build_native_library(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_native_library(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind


def test_falls_back_to_torch_when_the_build_fails(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING):
        kernel = load_q8_kernel(tmp_path)
    assert isinstance(kernel, TorchQ8Kernel)
    assert "slower torch kernel" in caplog.text
    assert load_q8_kernel(tmp_path, native=False).name == "torch"
