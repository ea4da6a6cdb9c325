"""`--activation-quantization int8` (kernels/gguf_int8_matmul.cpp): the native integer matmul against its torch
definition (kernels/activation_quant.py: the activations quantized per run of 32, then a float32 matmul of the
dequantized weights with them), on random blocks of every native type, on every build this CPU can run (AVX-512
VNNI with its 32-row panels, AVX-VNNI, and the AVX2 vpmaddubsw path on any x86-64 host with AVX2).

Shapes: M = 1-4 (the in-register path) and 5, 17, 33 (the panel path, with tails of its 4-row micro-kernel),
N with tails of 4-row groups and 32-row panels, K of one block, several, and past 2048.

Tolerance: the native result and the reference multiply the same numbers (dequantized weights times d q) and
differ only by summation order: |y - ref| <= 1e-4 sqrt(K), as for the float32 kernel (weights and inputs of
order 1). The quantization itself must be bit-equal (the same float32 ops, rounding half to even)."""

from __future__ import annotations

import pytest
import torch
from test_gguf_kernels import TYPES, random_blocks

from kvserve.kernels.activation_quant import fake_quantize_activations, quantize_activations
from kvserve.kernels.gguf_blocks import NATIVE_GGUF_TYPES
from kvserve.kernels.native import cpu_supports_native, supported_isas
from kvserve.kernels.ops import NativeKernels, TorchKernels, load_kernels
from kvserve.model.tokenizer import default_cache_dir

NATIVE_OK, WHY = cpu_supports_native()
REFERENCE = TorchKernels(activation_quantization="int8")
EXPECTED_DOT = {
    "avx512bf16": "avx512vnni",
    "avx512vnni": "avx512vnni",
    "avxvnni": "avxvnni",
    "avx512": "avx2",
    "avx2": "avx2",
}


@pytest.fixture(scope="module", params=supported_isas() or ["none"])
def native(request) -> NativeKernels:
    if not NATIVE_OK:
        pytest.skip(WHY)
    kernels = load_kernels(default_cache_dir() / "kernels", isa=request.param, activation_quantization="int8")
    assert isinstance(kernels, NativeKernels)
    assert kernels.int8_dot_product() == EXPECTED_DOT[request.param]
    return kernels


def shapes(qtype: int) -> list[tuple[int, int, int]]:
    ks = [32, 160, 2080] if NATIVE_GGUF_TYPES[qtype].block == 32 else [256, 1024, 2560]
    return [
        (1, 7, ks[0]),
        (2, 13, ks[1]),
        (3, 5, ks[2]),
        (4, 66, ks[0]),
        (5, 33, ks[1]),
        (17, 30, ks[2]),
        (33, 70, ks[1]),
    ]


def test_native_quantization_equals_the_torch_definition(native) -> None:
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(0)) * 4
    x[2] = 0.0  # an all-zero run: d = 0 and q = 0
    x[3, :32] = torch.linspace(-1, 1, 32) * 127 / 2  # exact halves: rounding half to even
    q, d = native.quantize_int8_activations(x)
    want_q, want_d = quantize_activations(x)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    assert int(q.abs().max()) == 127 and torch.all(d[2] == 0)


@pytest.mark.parametrize("qtype", TYPES, ids=[NATIVE_GGUF_TYPES[t].name for t in TYPES])
def test_native_int8_matmul_matches_its_definition(native, qtype: int) -> None:
    for i, (m, n, k) in enumerate(shapes(qtype)):
        blocks = random_blocks(qtype, n, k, seed=100 * qtype + i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        got = native.gguf_matmul(x, blocks, qtype)
        torch.testing.assert_close(
            got.double(),
            REFERENCE.gguf_matmul(x, blocks, qtype).double(),
            rtol=0,
            atol=1e-4 * k**0.5,
            msg=lambda s, m=m, n=n, k=k: f"M={m} N={n} K={k}: {s}",
        )


# Each type's weight bytes (outside its scales) and the bytes that give its largest codes: all 1 bits (Q4_0 15,
# Q5_0 31, Q4_K 15, Q5_K 31, Q6_K 63); Q8_0's -128 (|w| 128 in the sign trick) and 127 (code 255 where it goes in
# as w + 128).
EXTREME_BYTES = {
    2: (2, 18, (0xFF,)),
    6: (2, 22, (0xFF,)),
    8: (2, 34, (0x80, 0x7F)),
    12: (16, 144, (0xFF,)),
    13: (16, 176, (0xFF,)),
    14: (0, 192, (0xFF,)),
}


@pytest.mark.parametrize("qtype", TYPES, ids=[NATIVE_GGUF_TYPES[t].name for t in TYPES])
def test_int8_matmul_at_its_extremes(native, qtype: int) -> None:
    """The largest codes against activations of the largest magnitude, all one sign: the AVX2 path's 16-bit pair
    sums (63 x 127 x 2, and Q8_0's 128 x 127 x 2) stay below saturation, and the offsets taken back (up to 128 x
    sum(x)) are exact. Random blocks rarely put such values side by side. Tolerance: relative 1e-5 (summation
    order, on outputs of order k x 127)."""
    block = NATIVE_GGUF_TYPES[qtype].block
    k = 2 * block
    start, end, values = EXTREME_BYTES[qtype]
    for value in values:
        blocks = random_blocks(qtype, 7, k, seed=qtype)
        blocks.view(-1, blocks.shape[1] * block // k)[:, start:end] = value
        for m in (1, 4, 5):
            for sign in (1.0, -1.0):
                x = torch.full((m, k), sign)
                torch.testing.assert_close(
                    native.gguf_matmul(x, blocks, qtype).double(),
                    REFERENCE.gguf_matmul(x, blocks, qtype).double(),
                    rtol=1e-5,
                    atol=1e-3,
                    msg=lambda e, m=m, value=value: f"M={m}, bytes {value:#x}: {e}",
                )


def test_int8_writes_only_its_columns_of_a_wider_output(native) -> None:
    blocks = random_blocks(8, 40, 64, seed=3)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    wide = torch.full((6, 50), 7.0)
    native.gguf_matmul(x, blocks, 8, out=wide[:, 5:45])
    torch.testing.assert_close(wide[:, 5:45], REFERENCE.gguf_matmul(x, blocks, 8), rtol=0, atol=1e-3)
    assert torch.all(wide[:, :5] == 7.0) and torch.all(wide[:, 45:] == 7.0)


def test_int8_activations_cost_what_8_bits_per_value_cost() -> None:
    """The quantization error is the rounding of 8 bits per run of 32: |x - d q| <= d / 2 = max|x| / 254."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5))
    err = (fake_quantize_activations(x) - x).abs().reshape(4, 8, 32)
    bound = x.abs().reshape(4, 8, 32).amax(dim=-1, keepdim=True) / 254 * (1 + 1e-6)
    assert torch.all(err <= bound) and float(err.max()) > 0
    with pytest.raises(ValueError, match="runs of 32"):
        quantize_activations(torch.zeros(1, 40))


@pytest.mark.parametrize("qtype", TYPES, ids=[NATIVE_GGUF_TYPES[t].name for t in TYPES])
def test_weights_packed_once_give_the_same_bits(native, qtype: int) -> None:
    """Panels packed ahead of time (the LM head's, model/gguf_layers.py) are the panels the matmul packs at each
    call: the same bits at every row count, into a wider output too; a packing of other sizes is refused. Builds
    without the panel path pack nothing."""
    packed_any = False
    for i, (m, n, k) in enumerate(shapes(qtype)):
        blocks = random_blocks(qtype, n, k, seed=100 * qtype + i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        packed = native.pack_int8_panels(blocks, qtype)
        if packed is None:
            assert native.int8_dot_product() != "avx512vnni"
            continue
        packed_any = True
        assert torch.equal(native.gguf_matmul_packed(x, blocks, packed, qtype), native.gguf_matmul(x, blocks, qtype))
        wide = torch.full((m, n + 3), 7.0)
        native.gguf_matmul_packed(x, blocks, packed, qtype, out=wide[:, 2 : 2 + n])
        assert torch.equal(wide[:, 2 : 2 + n], native.gguf_matmul(x, blocks, qtype))
        assert torch.all(wide[:, :2] == 7.0) and torch.all(wide[:, 2 + n :] == 7.0)
        with pytest.raises(ValueError, match="do not fit"):
            native.gguf_matmul_packed(x, blocks, packed[:-1], qtype)
    assert packed_any == (native.int8_dot_product() == "avx512vnni")


def test_the_tied_lm_head_packs_its_panels_once(native) -> None:
    """GGUFEmbedding.attend with int8 activations above 4 rows multiplies panels packed at its first such call and
    kept (the same bits as packing at every call); 4 rows and fewer read the blocks; new kernels pack anew."""
    from kvserve.model.gguf_layers import GGUFEmbedding

    blocks = random_blocks(8, 70, 64, seed=9)
    head = GGUFEmbedding(8, blocks, torch.float32, native)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(9))
    assert torch.equal(head.attend(x), native.gguf_matmul(x, blocks, 8))
    assert torch.equal(head.attend(x[:3]), native.gguf_matmul(x[:3], blocks, 8))
    if native.int8_dot_product() != "avx512vnni":
        assert head._panels is None
        return
    assert head._panels is not None
    first = head._panels[2]
    head.attend(x)
    assert head._panels[2] is first  # kept
    head.kernels = load_kernels(default_cache_dir() / "kernels", isa=native.isa, activation_quantization="int8")
    assert torch.equal(head.attend(x), native.gguf_matmul(x, blocks, 8)) and head._panels[2] is not first
