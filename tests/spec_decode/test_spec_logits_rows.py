"""The runner puts sampled rows and every drafted request's verified rows through the LM head in one call
(engine/runner.py). That is lossless only because the q8_0 kernel computes each output row the same way
whichever rows share the call: checked bit for bit here, on row counts that cross its register-block (3 rows) and
activation-tile boundaries and on a weight whose row count is not a multiple of its 4-row blocks."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.native import cpu_supports_native
from kvserve.kernels.ops import NativeKernels, load_kernels
from kvserve.kernels.q8 import quantize_q8
from kvserve.model.tokenizer import default_cache_dir

NATIVE_OK, WHY = cpu_supports_native()


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    if not NATIVE_OK:
        pytest.skip(WHY)
    kernels = load_kernels(default_cache_dir() / "kernels")
    assert isinstance(kernels, NativeKernels)
    return kernels


@pytest.mark.parametrize("k", [640, 2048 + 64])  # one k-chunk; several (kMaxChunk 1024)
def test_q8_rows_are_the_same_whatever_rows_share_the_call(native: NativeKernels, k: int) -> None:
    g = torch.Generator().manual_seed(0)
    q, s = quantize_q8(torch.randn(1030, k, generator=g))  # 1030 = 257 blocks of 4 rows + 2
    spans = [1, 5, 1, 3, 5, 2, 5, 128]  # sampled rows, drafted chunks, and a run past the activation tile
    x = torch.randn(sum(spans), k, generator=g)
    together = native.q8_matmul(x, q, s)
    apart = torch.cat([native.q8_matmul(part, q, s) for part in x.split(spans)])
    assert torch.equal(together, apart)
