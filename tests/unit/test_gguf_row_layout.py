"""GGUF weights with their rows interleaved four at a time (kernels/gguf_blocks.py's ROWS4; gguf_formats.h's
RowBlocks): the layout the loader gives every GGUF matrix when the native kernels run it. It is only another order
of the same bytes, so every kernel must give the same bits on it as on the file's layout: the float32 and int8
matmuls at every row count (the four-row gemvs, the blocked and panel paths), the dequantization, the int8 panels
packed ahead of time; the torch reference must read it too (it de-interleaves), and an embedding tied to an
interleaved LM head must look up the same rows. N runs through 4 (one group), tails of 1-3 rows after whole groups,
and fewer than four rows (not interleaved at all). Q5_0 rows of a multiple of 128 weights may be stored as tiles
(Q5_TILES, for int8 activations): there the int8 gemv (1-4 rows) sums in its own order and is held to the int8
reference within 1e-4 sqrt(K) (weights and inputs of order 1, as tests/unit/test_gguf_int8_kernels.py), every other
path bit-equal again. Each test runs on every build this CPU can run."""

from __future__ import annotations

import pytest
import torch
from test_gguf_kernels import TYPES, random_blocks

from kvserve.kernels.gguf_blocks import (
    NATIVE_GGUF_TYPES,
    Q5_TILES,
    ROWS4,
    deinterleave_rows,
    dequantize_blocks,
    gather_rows,
    interleave_rows,
)
from kvserve.kernels.native import cpu_supports_native, supported_isas
from kvserve.kernels.ops import NativeKernels, TorchKernels, load_kernels
from kvserve.model.gguf_layers import GGUFEmbedding, GGUFLinear, interleave_gguf_rows
from kvserve.model.tokenizer import default_cache_dir

NATIVE_OK, WHY = cpu_supports_native()
NAMES = [NATIVE_GGUF_TYPES[t].name for t in TYPES]
ROW_COUNTS = (4, 5, 7, 30, 66)


def k_of(qtype: int) -> int:
    return 160 if NATIVE_GGUF_TYPES[qtype].block == 32 else 512


@pytest.fixture(scope="module", params=[(isa, act) for isa in supported_isas() or ["none"] for act in ("none", "int8")])
def native(request) -> NativeKernels:
    if not NATIVE_OK:
        pytest.skip(WHY)
    isa, activations = request.param
    kernels = load_kernels(default_cache_dir() / "kernels", isa=isa, activation_quantization=activations)
    assert isinstance(kernels, NativeKernels)
    return kernels


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_the_native_interleave_is_the_reference_one_and_undoes(native, qtype: int) -> None:
    for n in ROW_COUNTS:
        blocks = random_blocks(qtype, n, k_of(qtype), seed=n)
        interleaved = native.interleave_rows(blocks, qtype)
        assert interleaved is not None and interleaved[0] == qtype + ROWS4
        rows4 = interleaved[1]
        assert rows4.shape == blocks.shape and torch.equal(rows4, interleave_rows(blocks, qtype))
        assert torch.equal(deinterleave_rows(rows4, qtype), blocks)
        if n > 4:  # the layout moved bytes: a test of it could fail
            assert not torch.equal(rows4, blocks)
        assert torch.equal(rows4[n // 4 * 4 :], blocks[n // 4 * 4 :])  # the tail rows stay as the file has them
    assert native.interleave_rows(random_blocks(qtype, 3, k_of(qtype)), qtype) is None  # no whole group


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_every_row_count_gives_the_same_bits_on_both_layouts(native, qtype: int) -> None:
    """1-4 rows (gemvs), 5-9 (blocked float32, widened or panel int8 paths), 33: bit-equal outputs."""
    for n in ROW_COUNTS:
        k = k_of(qtype)
        blocks = random_blocks(qtype, n, k, seed=7 * n)
        interleaved = native.interleave_rows(blocks, qtype)
        assert interleaved is not None
        rows4 = interleaved[1]
        for m in (1, 2, 3, 4, 5, 9, 33):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            expected = native.gguf_matmul(x, blocks, qtype)
            assert torch.equal(native.gguf_matmul(x, rows4, qtype + ROWS4), expected), (n, m)
        assert torch.equal(native.gguf_dequantize(rows4, qtype + ROWS4), native.gguf_dequantize(blocks, qtype))
        packed = native.pack_int8_panels(rows4, qtype + ROWS4)
        if packed is not None:  # AVX-512 VNNI builds with int8 activations
            assert torch.equal(packed, native.pack_int8_panels(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_the_torch_reference_reads_the_layout(qtype: int) -> None:
    """dequantize_blocks de-interleaves (also a slice that starts on a group, as the torch matmul's slabs do), and
    the torch kernels give the file layout's numbers."""
    blocks = random_blocks(qtype, 30, k_of(qtype), seed=3)
    rows4 = interleave_rows(blocks, qtype)
    assert torch.equal(dequantize_blocks(rows4, qtype + ROWS4), dequantize_blocks(blocks, qtype))
    assert torch.equal(dequantize_blocks(rows4[8:], qtype + ROWS4), dequantize_blocks(blocks[8:], qtype))
    torch_kernels = TorchKernels()
    x = torch.randn(3, k_of(qtype), generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch_kernels.gguf_matmul(x, rows4, qtype + ROWS4), torch_kernels.gguf_matmul(x, blocks, qtype))


def test_gather_rows_finds_each_row_in_either_layout() -> None:
    blocks = random_blocks(8, 31, 64, seed=5)  # 7 whole groups and a tail of 3
    ids = torch.tensor([0, 3, 4, 27, 28, 30, 5, 5, 29])
    assert torch.equal(gather_rows(blocks, 8, ids), blocks[ids])
    assert torch.equal(gather_rows(interleave_rows(blocks, 8), 8 + ROWS4, ids), blocks[ids])


def test_the_loader_step_interleaves_layers_and_a_tied_head(native) -> None:
    """interleave_gguf_rows: a fused GGUFLinear (parts of different types) and a tied embedding: their outputs and
    lookups bit-equal to the file layout's, each module interleaved once; torch kernels interleave nothing."""
    q, kv = random_blocks(6, 12, 64, seed=1), random_blocks(8, 8, 64, seed=2)
    linear = GGUFLinear([(6, q), (8, kv)], torch.randn(20), native)
    embed = GGUFEmbedding(8, random_blocks(8, 70, 64, seed=3), torch.float32, native)
    model = torch.nn.ModuleList([linear, embed])
    x, ids = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)), torch.tensor([[0, 69, 33], [68, 1, 2]])
    before = [linear(x[:1]), linear(x), embed.attend(x[:2]), embed.attend(x), embed(ids)]
    assert interleave_gguf_rows(model, TorchKernels()) == 0
    assert interleave_gguf_rows(model, native) == 2 and linear.rows4 and embed.rows4
    assert linear.kernel_qtypes == (6 + ROWS4, 8 + ROWS4) and linear.qtypes == (6, 8)
    after = [linear(x[:1]), linear(x), embed.attend(x[:2]), embed.attend(x), embed(ids)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert "rows x4" in repr(linear) and "rows x4" in repr(embed)
    assert interleave_gguf_rows(model, native) == 0  # once


def test_an_embedding_beside_its_own_lm_head_keeps_the_file_layout(native) -> None:
    """Only looked up (an untied model: `lm_head` set), the embedding is left as the file stores it."""

    class Untied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = GGUFEmbedding(8, random_blocks(8, 16, 64, seed=3), torch.float32, native)
            self.lm_head = GGUFLinear([(8, random_blocks(8, 16, 64, seed=4))], None, native)

    model = Untied()
    assert interleave_gguf_rows(model, native) == 1 and model.lm_head.rows4 and not model.embed.rows4


@pytest.mark.parametrize("n", ROW_COUNTS)
def test_q5_0_tiles(native, n: int) -> None:
    """Tiles where asked for and where K is a multiple of 128 (else plain ROWS4); undone by the reference; the int8
    gemv on them within tolerance of the int8 reference, every other path bit-equal to the file layout's."""
    assert native.interleave_rows(random_blocks(6, 8, 96), 6, tiles=True)[0] == 6 + ROWS4  # type: ignore[index]
    k = 384
    blocks = random_blocks(6, n, k, seed=n)
    interleaved = native.interleave_rows(blocks, 6, tiles=True)
    assert interleaved is not None
    qtype, tiles = interleaved
    assert qtype == 6 + ROWS4 + Q5_TILES
    assert not torch.equal(tiles, interleave_rows(blocks, 6))  # tiles are not the plain interleave
    assert torch.equal(deinterleave_rows(tiles, qtype), blocks)
    ids = torch.tensor([n - 1, 0, n // 2, 1])
    assert torch.equal(gather_rows(tiles, qtype, ids), blocks[ids])
    assert torch.equal(native.gguf_dequantize(tiles, qtype), native.gguf_dequantize(blocks, 6))
    reference = TorchKernels(activation_quantization=native.activation_quantization)
    for m in (1, 2, 3, 4, 5, 9, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = native.gguf_matmul(x, tiles, qtype)
        if native.activation_quantization == "int8" and m <= 4:
            assert torch.allclose(got, reference.gguf_matmul(x, blocks, 6), rtol=0, atol=1e-4 * k**0.5), m
            assert not torch.equal(got, torch.zeros_like(got))
        else:
            assert torch.equal(got, native.gguf_matmul(x, blocks, 6)), m
    packed = native.pack_int8_panels(tiles, qtype)
    if packed is not None:
        assert torch.equal(packed, native.pack_int8_panels(blocks, 6))


def test_int8_layers_store_q5_0_as_tiles(native) -> None:
    """GGUFLinear.interleave_rows: Q5_0 parts of a multiple of 128 weights as tiles with int8 activations only."""
    q, v = random_blocks(6, 12, 128, seed=1), random_blocks(8, 8, 128, seed=2)
    linear = GGUFLinear([(6, q), (8, v)], None, native)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4))
    before = linear(x)
    assert linear.interleave_rows(native)
    tiled = native.activation_quantization == "int8"
    assert linear.kernel_qtypes == (6 + ROWS4 + (Q5_TILES if tiled else 0), 8 + ROWS4)
    assert ("Q5_0 tiles" in repr(linear)) == tiled
    assert torch.allclose(linear(x), before, rtol=0, atol=1e-4 * 128**0.5)
