"""The compiled kernels against the torch ones (the reference) on shapes and layouts that exercise every
remainder path: the q8_0 matmul (and q8_0 quantization round trips), RMSNorm, the gated activation and the paged
prefill attention; the build's cache and fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import reference_attention
from kvserve.kernels.native import build_native_library, cpu_supports_native, supported_isas
from kvserve.kernels.ops import NativeKernels, TorchKernels, load_kernels
from kvserve.kernels.q8 import GROUP_SIZE, dequantize_q8, quantize_q8
from kvserve.kv.cache import LayerKVCache
from kvserve.model.tokenizer import default_cache_dir

NATIVE_OK, WHY = cpu_supports_native()
needs_native = pytest.mark.skipif(not NATIVE_OK, reason=WHY)


@pytest.fixture(scope="module", params=supported_isas() or ["none"])
def native(request) -> NativeKernels:
    """The kernels built for each instruction set this CPU has (AVX2, and AVX-512 where it has it)."""
    if not NATIVE_OK:
        pytest.skip(WHY)
    kernel = load_kernels(default_cache_dir() / "kernels", isa=request.param)
    assert isinstance(kernel, NativeKernels), "this machine has a compiler and AVX2: the native kernel must build"
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
    torch.testing.assert_close(TorchKernels(slab_rows=128).q8_matmul(x, q, s), x @ dequantize_q8(q, s).T)


@needs_native
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 33])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 64), (130, 640), (7, 2080)])  # 2080 > the kernel's stack buffer
def test_native_matches_torch(native: NativeKernels, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    q, s = quantize_q8(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    got = native.q8_matmul(x, q, s)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, TorchKernels().q8_matmul(x, q, s), atol=1e-4, rtol=1e-4)


@needs_native
def test_native_takes_non_contiguous_and_half_inputs(native: NativeKernels) -> None:
    g = torch.Generator().manual_seed(3)
    q, s = quantize_q8(torch.randn(10, 64, generator=g))
    x = torch.randn(64, 4, generator=g).T  # a transposed view
    torch.testing.assert_close(native.q8_matmul(x, q, s), TorchKernels().q8_matmul(x, q, s), atol=1e-4, rtol=1e-4)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(native.q8_matmul(xb, q, s), TorchKernels().q8_matmul(xb, q, s), atol=1e-4, rtol=1e-4)


@needs_native
def test_native_rejects_mismatched_shapes(native: NativeKernels) -> None:
    q, s = quantize_q8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="do not fit"):
        native.q8_matmul(torch.randn(2, 32), q, s)


@needs_native
def test_build_is_cached(tmp_path: Path) -> None:
    first = build_native_library(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_native_library(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind


def test_build_hash_covers_the_shared_header(tmp_path: Path, monkeypatch) -> None:
    """Editing simd.h (included by the sources) must rebuild the library, as editing a .cpp does."""
    from kvserve.kernels import native

    assert any(h.name == "simd.h" for h in native.HEADERS)
    monkeypatch.setenv("CXX", "/bin/true")  # a "compiler" that succeeds without output: only the names matter
    monkeypatch.setattr(native.os, "replace", lambda src, dst: Path(dst).write_bytes(b""))
    first = build_native_library(tmp_path)
    edited = tmp_path / "simd.h"
    edited.write_text("// edited\n")
    monkeypatch.setattr(native, "HEADERS", (edited,))
    assert build_native_library(tmp_path) != first


def test_each_instruction_set_is_its_own_build(tmp_path: Path, monkeypatch) -> None:
    """An AVX-512 build and an AVX2 build of the same sources are different files with different flags, and the
    default is the best set the CPU has (a library built on one machine is never loaded for another's set)."""
    from kvserve.kernels import native

    calls: list[list[str]] = []
    monkeypatch.setenv("CXX", "/bin/true")
    monkeypatch.setattr(native.os, "replace", lambda src, dst: Path(dst).write_bytes(b""))
    real_run = native.subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    avx2, avx512 = build_native_library(tmp_path, "avx2"), build_native_library(tmp_path, "avx512")
    assert avx2 != avx512
    assert "-mavx512f" in calls[1] and "-mavx512f" not in calls[0]
    monkeypatch.setattr(native, "_cpu_flags", lambda: set(native.ISA_REQUIREMENTS["avx2"][0]))
    if native.cpu_supports_native()[0]:
        assert native.supported_isas() == ["avx2"] and build_native_library(tmp_path) == avx2
    monkeypatch.setattr(native, "_cpu_flags", lambda: set(native.ISA_REQUIREMENTS["avx512"][0]))
    if native.cpu_supports_native()[0]:
        assert native.supported_isas() == ["avx512", "avx2"] and build_native_library(tmp_path) == avx512


@needs_native
def test_a_failed_avx512_build_gives_way_to_avx2(tmp_path: Path, monkeypatch, caplog) -> None:
    """A CPU with AVX-512 but a compiler that cannot build it still gets the native (AVX2) kernels."""
    from kvserve.kernels import native

    avx2_library = build_native_library(default_cache_dir() / "kernels", "avx2")
    compiler = tmp_path / "cxx"  # refuses -mavx512f; otherwise "builds" by copying the real AVX2 library
    compiler.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -mavx512f ] && exit 1; done\n'
        'while [ "$#" -gt 0 ]; do [ "$1" = -o ] && exec cp "$KVSERVE_TEST_LIBRARY" "$2"; shift; done\n'
        "exit 1\n"
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("KVSERVE_TEST_LIBRARY", str(avx2_library))
    monkeypatch.setattr(native, "_cpu_flags", lambda: set(native.ISA_REQUIREMENTS["avx512"][0]))
    with caplog.at_level(logging.WARNING):
        kernels = load_kernels(tmp_path / "cache")
    assert isinstance(kernels, NativeKernels) and kernels.isa == "avx2"
    assert "avx512 build of kvserve's CPU kernels failed" in caplog.text and "slower torch" not in caplog.text


def test_falls_back_to_torch_when_the_build_fails(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING):
        kernel = load_kernels(tmp_path)
    assert isinstance(kernel, TorchKernels)
    assert "slower torch kernels" in caplog.text
    assert load_kernels(tmp_path, native=False).name == "torch"


@needs_native
@pytest.mark.parametrize("shape", [(1, 640), (5, 7), (3, 4, 256), (130, 64)])
def test_native_rms_norm_matches_torch(native: NativeKernels, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    got = native.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, TorchKernels().rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@needs_native
def test_native_rms_norm_on_strided_heads_into_a_view(native: NativeKernels) -> None:
    """The Q and K heads of a fused QKV row, normalized straight into a slice of a wider tensor."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens = 4, 2, 32, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    wq, wk = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    out = torch.full((tokens, heads + kv_heads, dim), float("nan"))
    native.rms_norm(q, wq, 1e-6, out=out[:, :heads])
    native.rms_norm(k, wk, 1e-6, out=out[:, heads:])
    ref = torch.cat([TorchKernels().rms_norm(q, wq, 1e-6), TorchKernels().rms_norm(k, wk, 1e-6)], dim=1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_native
def test_native_rms_norm_falls_back_for_other_dtypes(native: NativeKernels) -> None:
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.ones(64)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), TorchKernels().rms_norm(x, w, 1e-6))


@needs_native
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu", "gelu"])
@pytest.mark.parametrize("shape", [(1, 2 * 1024), (7, 2 * 13), (300, 2 * 128)])
def test_native_gated_act_matches_torch(native: NativeKernels, act: str, shape: tuple[int, int]) -> None:
    """tanh-GELU and SiLU natively (exp from a polynomial), exact GELU through the torch fallback."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 4
    got = native.gated_act(x, act)
    assert got.shape == (shape[0], shape[1] // 2)
    torch.testing.assert_close(got, TorchKernels().gated_act(x, act), atol=1e-5, rtol=1e-5)


def _conv_case(query_lens: list[int], continues: list[bool], channels: int, kernel: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    bcx = torch.randn(sum(query_lens), 3 * channels, generator=g)
    weight = torch.randn(channels, kernel, generator=g)
    b = torch.randn(channels, generator=g) if bias else None
    states = torch.randn(len(query_lens) + 3, kernel - 1, channels, generator=g)
    slots = torch.randperm(len(query_lens) + 3, generator=g)[: len(query_lens)]
    return bcx, weight, b, states, slots, _starts(query_lens), continues


def _starts(query_lens: list[int]) -> list[int]:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


STEPS = [
    ([1, 1, 1], [True, True, True]),  # a decode step
    ([5, 1, 17], [False, True, True]),  # a prompt starting beside a decode and a later chunk
    ([2, 40], [True, False]),  # a chunk shorter than the kernel, a long one from zeros
    ([1], [False]),  # one token from zeros
]


@needs_native
@pytest.mark.parametrize("step", range(len(STEPS)))
@pytest.mark.parametrize(
    "channels,kernel,bias,form", [(64, 3, False, "lfm2"), (13, 3, True, "lfm2"), (1024, 4, False, "silu")]
)
def test_native_causal_conv_matches_torch(native: NativeKernels, step, channels, kernel, bias, form) -> None:
    """The causal convolution (LFM2's gated form on column slices of one projection; Qwen3.5's plain form with SiLU)
    and the states it leaves behind, against the torch reference; slots not in the step keep their state."""
    query_lens, continues = STEPS[step]
    bcx, weight, b, states, slots, starts, cont = _conv_case(query_lens, continues, channels, kernel, bias, 7)
    if form == "lfm2":
        x, kw = bcx[:, 2 * channels :], dict(pre=bcx[:, :channels], gate=bcx[:, channels : 2 * channels])
    else:
        x, kw = bcx[:, :channels].contiguous(), dict(silu=True)
    want_states = states.clone()
    want = TorchKernels().causal_conv(x, weight, b, want_states, slots, starts, cont, **kw)
    got = native.causal_conv(x, weight, b, states, slots, starts, cont, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states, atol=0, rtol=0)


def test_torch_causal_conv_equals_a_causal_conv1d() -> None:
    """The reference itself, against torch's conv1d over each whole sequence (HF's causal_conv1d_fn): two chunks of
    a sequence through its state give the same outputs as the sequence at once."""
    channels, kernel = 6, 3
    bcx, weight, _, states, _, _, _ = _conv_case([11], [False], channels, kernel, False, 3)
    x = bcx[:, :channels]
    conv = torch.nn.functional.conv1d(x.T[None], weight[:, None, :], padding=kernel - 1, groups=channels)
    want = conv[0, :, :11].T
    slot = torch.tensor([1])
    first = TorchKernels().causal_conv(x[:4], weight, None, states, slot, [0, 4], [False])
    rest = TorchKernels().causal_conv(x[4:], weight, None, states, slot, [0, 7], [True])
    torch.testing.assert_close(torch.cat((first, rest)), want, atol=1e-5, rtol=1e-5)


def _delta_case(query_lens: list[int], k_heads: int, v_heads: int, key_dim: int, value_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(query_lens)
    # q, k, v as column slices of one [T, ...] buffer (the layer's convolution output), g and beta of another
    mixed = torch.randn(tokens, 2 * k_heads * key_dim + v_heads * value_dim, generator=g)
    q = mixed[:, : k_heads * key_dim].view(tokens, k_heads, key_dim)
    k = mixed[:, k_heads * key_dim : 2 * k_heads * key_dim].view(tokens, k_heads, key_dim)
    v = mixed[:, 2 * k_heads * key_dim :].view(tokens, v_heads, value_dim)
    ab = torch.randn(tokens, 2 * v_heads, generator=g)
    log_decay = -torch.nn.functional.softplus(ab[:, :v_heads])
    beta = ab[:, v_heads:].sigmoid()
    states = torch.randn(len(query_lens) + 2, v_heads, key_dim, value_dim, generator=g) * 0.1
    slots = torch.randperm(len(query_lens) + 2, generator=g)[: len(query_lens)]
    return q, k, v, log_decay, beta, states, slots


@needs_native
@pytest.mark.parametrize("step", range(len(STEPS)))
@pytest.mark.parametrize("k_heads,v_heads,key_dim,value_dim", [(2, 4, 16, 8), (1, 1, 128, 128), (3, 3, 5, 7)])
def test_native_gated_delta_rule_matches_torch(native: NativeKernels, step, k_heads, v_heads, key_dim, value_dim):
    """The Gated DeltaNet recurrence (grouped value heads, strided inputs, odd head sizes) and its final states."""
    query_lens, continues = STEPS[step]
    q, k, v, g, beta, states, slots = _delta_case(query_lens, k_heads, v_heads, key_dim, value_dim, 5)
    want_states = states.clone()
    starts = _starts(query_lens)
    want = TorchKernels().gated_delta_rule(q, k, v, g, beta, want_states, slots, starts, continues)
    got = native.gated_delta_rule(q, k, v, g, beta, states, slots, starts, continues)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("strength", [8.0, 30.0])
def test_native_gated_delta_rule_through_long_decays(native: NativeKernels, strength):
    """The blocked prefill keeps the decay as one scale a block and writes a token out whole when that scale falls
    below 1e-20: strong decays (e^-8 to e^-30 a token over 48 tokens) and one that underflows to 0 (e^-200) give the
    torch reference's outputs and states."""
    q, k, v, g, beta, states, slots = _delta_case([48, 20], 2, 2, 32, 40, 7)
    g = g * strength
    g[10] = -200.0
    want_states = states.clone()
    want = TorchKernels().gated_delta_rule(q, k, v, g, beta, want_states, slots, [0, 48, 68], [True, False])
    got = native.gated_delta_rule(q, k, v, g, beta, states, slots, [0, 48, 68], [True, False])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-4)


def test_torch_gated_delta_rule_equals_hf_transformers() -> None:
    """The reference against HF's own chunked form (transformers' torch_chunk_gated_delta_rule, Qwen3.5's prefill
    path): a 70-token sequence run as chunks of 30 and 40 through its state, within 1e-4."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, states, _ = _delta_case([70], 2, 4, 16, 8, 9)
    want, _ = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], use_qk_l2norm_in_kernel=True
    )
    slot = torch.tensor([0])
    first = TorchKernels().gated_delta_rule(q[:30], k[:30], v[:30], g[:30], beta[:30], states, slot, [0, 30], [False])
    rest = TorchKernels().gated_delta_rule(q[30:], k[30:], v[30:], g[30:], beta[30:], states, slot, [0, 40], [True])
    torch.testing.assert_close(torch.cat((first, rest)), want[0], atol=1e-4, rtol=1e-4)


def _paged_prompt(seq_len: int, q_len: int, block_size: int, heads: int, kv_heads: int, dim: int, seed: int):
    """One sequence's context in a random paged cache (shuffled blocks, NaN in every slot it does not own)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-seq_len // block_size)
    table = (torch.randperm(blocks + 3, generator=g)[:blocks] + 1).tolist()
    k_cache = torch.full((blocks + 4, block_size, kv_heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for p in range(seq_len):
        k_cache[table[p // block_size], p % block_size] = torch.randn(kv_heads, dim, generator=g)
        v_cache[table[p // block_size], p % block_size] = torch.randn(kv_heads, dim, generator=g)
    meta = AttentionMetadata.build([table], [seq_len], [q_len], block_size, torch.device("cpu"))
    return torch.randn(q_len, heads, dim, generator=g), k_cache, v_cache, meta


@needs_native
@pytest.mark.parametrize(
    "seq_len,q_len,block_size,heads,kv_heads,dim,window",
    [
        (1, 1, 16, 4, 1, 256, None),  # a one-token prompt
        (9, 1, 5, 4, 1, 64, 4),  # one query at the end of a context: the decode shape
        (67, 67, 16, 4, 1, 256, None),  # a chunk that is no multiple of the query and key tiles
        (130, 35, 5, 8, 2, 40, 50),  # a later chunk in a window, GQA 4, head_dim 40 (8 x 5)
        (200, 199, 3, 3, 3, 24, 1),  # window 1: each query sees only itself
        (90, 90, 7, 2, 1, 20, 33),  # head_dim 20: no multiple of 8
        (1485, 85, 16, 4, 1, 256, None),  # a chat turn after a prefix hit: one tall item a thread, many key tiles
        (1485, 85, 16, 4, 1, 256, 512),  # the same on a sliding-window layer
        (300, 70, 16, 8, 1, 96, 100),  # head_dim 96: AVX-512's 64-column output step, then AVX2's
    ],
)
def test_native_paged_prefill_attention_matches_reference(
    native: NativeKernels,
    seq_len: int,
    q_len: int,
    block_size: int,
    heads: int,
    kv_heads: int,
    dim: int,
    window: int | None,
) -> None:
    q, kc, vc, meta = _paged_prompt(seq_len, q_len, block_size, heads, kv_heads, dim, seed=seq_len + q_len)
    got = native.paged_prefill_attention(q, kc, vc, meta.block_tables[0], seq_len, window, 0.125)
    ref = reference_attention(q, LayerKVCache(kc, vc), meta, AttentionLayerSpec(0.125, window))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif("avx512" not in supported_isas(), reason="the CPU has no AVX-512")
@pytest.mark.parametrize("window", [None, 512])
def test_avx512_prefill_attention_is_bit_identical_to_avx2(window: int | None) -> None:
    """The AVX-512 build runs each value's sums in the AVX2 build's order (prefill_attention.cpp), so a chat turn's
    prefill attends to the same bits whichever of the two the host has."""
    q, kc, vc, meta = _paged_prompt(1485, 85, 16, 4, 1, 256, seed=3)
    outs = [
        load_kernels(default_cache_dir() / "kernels", isa=isa).paged_prefill_attention(
            q, kc, vc, meta.block_tables[0], 1485, window, 0.0625
        )
        for isa in ("avx512", "avx2")
    ]
    assert torch.equal(outs[0], outs[1])


@needs_native
def test_native_paged_prefill_attention_writes_into_out(native: NativeKernels) -> None:
    """Into a contiguous `out` in place; a strided one gets a copy."""
    q, kc, vc, meta = _paged_prompt(40, 24, 16, 4, 2, 32, seed=1)
    want = native.paged_prefill_attention(q, kc, vc, meta.block_tables[0], 40, None, 0.2)
    out = torch.empty(24, 4, 32)
    assert native.paged_prefill_attention(q, kc, vc, meta.block_tables[0], 40, None, 0.2, out=out) is out
    strided = torch.empty(4, 24, 32).transpose(0, 1)
    native.paged_prefill_attention(q, kc, vc, meta.block_tables[0], 40, None, 0.2, out=strided)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(strided, want, atol=0, rtol=0)


@needs_native
def test_native_paged_prefill_attention_rejects_a_short_block_table(native: NativeKernels) -> None:
    q, kc, vc, meta = _paged_prompt(40, 8, 16, 4, 1, 32, seed=2)
    with pytest.raises(ValueError, match="paged prefill attention"):
        native.paged_prefill_attention(q, kc, vc, meta.block_tables[0][:2], 40, None, 0.2)  # 32 < 40 slots


def test_torch_kernels_have_no_paged_prefill_attention() -> None:
    kernels = TorchKernels()
    assert not kernels.has_paged_attention(torch.zeros(2, 4, 1, 8))
    with pytest.raises(NotImplementedError):
        kernels.paged_prefill_attention(
            torch.zeros(2, 1, 8),
            torch.zeros(2, 4, 1, 8),
            torch.zeros(2, 4, 1, 8),
            torch.zeros(2, dtype=torch.int64),
            2,
            None,
            1.0,
        )


def _qk_slice(tokens: int, q_heads: int, kv_heads: int, dim: int, seed: int) -> torch.Tensor:
    """Q and K heads as the attention layer sees them: a strided view into a fused [T, (q + 2 kv) * dim] output."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(seed))
    return qkv[:, : (q_heads + kv_heads) * dim].view(tokens, q_heads + kv_heads, dim)


@pytest.mark.parametrize("norm", [True, False])
def test_torch_qk_norm_rope_matches_the_hf_formula(norm: bool) -> None:
    """The reference itself against HF's rotate_half formulation, with the norms written out."""
    from kvserve.model.layers import RotaryEmbedding

    tokens, q_heads, kv_heads, dim, eps = 5, 4, 2, 32, 1e-6
    qk = _qk_slice(tokens, q_heads, kv_heads, dim, 0)
    qw, kw = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if norm else (None, None)
    positions = torch.tensor([0, 1, 7, 100, 5000])
    cos, sin = RotaryEmbedding(dim, 10000.0, None).cos_sin(positions, torch.float32)
    got = TorchKernels().qk_norm_rope(qk, q_heads, qw, kw, eps, cos, sin)
    x = qk.clone()
    if norm:
        w = torch.cat([qw.expand(q_heads, dim), kw.expand(kv_heads, dim)])
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    freqs = positions.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))[None]
    emb = torch.cat((freqs, freqs), -1)[:, None, :]
    rotate_half = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), -1)
    torch.testing.assert_close(got, x * emb.cos() + rotate_half * emb.sin(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "q_heads", "kv_heads", "dim", "norm"),
    [
        (1, 4, 1, 256, True),
        (9, 4, 1, 256, True),
        (300, 4, 1, 256, True),
        (3, 8, 2, 64, False),
        (5, 2, 2, 16, True),
        (4, 2, 1, 8, True),  # head_dim 8: not a multiple of 16, so the native kernel hands it to torch
    ],
)
def test_native_qk_norm_rope_matches_torch(
    native: NativeKernels, tokens: int, q_heads: int, kv_heads: int, dim: int, norm: bool
) -> None:
    from kvserve.model.layers import RotaryEmbedding

    qk = _qk_slice(tokens, q_heads, kv_heads, dim, 1)
    g = torch.Generator().manual_seed(2)
    qw, kw = (torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5) if norm else (None, None)
    cos, sin = RotaryEmbedding(dim, 1e6, None).cos_sin(torch.randint(0, 30000, (tokens,), generator=g), torch.float32)
    want = TorchKernels().qk_norm_rope(qk, q_heads, qw, kw, 1e-6, cos, sin)
    got = native.qk_norm_rope(qk, q_heads, qw, kw, 1e-6, cos, sin)
    assert got.is_contiguous() and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_native
def test_native_int8_kv_quantizer_equals_the_torch_one(native: NativeKernels) -> None:
    """The native layer's int8 KV write (kv_dtypes.h) gives kvserve/kv/quant.py's bytes and scales to the bit: random
    rows, a zero row, huge and tiny magnitudes, and values that land exactly halfway between two integers (rounded
    half to even). The other element types: tests/unit/test_kv_dtype_kernels.py."""
    from kvserve.kv.quant import compute_scales, quant_format, quantize

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)
    x[0] = 0.0
    x[1] = torch.arange(96) - 47.5  # amax 47.5: x / scale lands on many .5 ties
    x[2, :3] = torch.tensor([127.0, 0.5, -0.5])
    fmt = quant_format(torch.int8)
    assert fmt is not None
    scale = compute_scales(x, fmt)
    q, scales = native.store_kv_rows(x, torch.int8)
    assert torch.equal(scales, scale.squeeze(-1))
    assert torch.equal(q, quantize(x, scale, fmt))


@needs_native
def test_native_copy_rows_moves_each_part_row_and_refuses_rows_out_of_range(native: NativeKernels) -> None:
    """The offload tier's one-call copy (layout.py): parts of different widths, rows strided and out of order."""
    g = torch.Generator().manual_seed(0)
    slab = torch.randint(0, 256, (9, 40), dtype=torch.uint8, generator=g)
    parts = [torch.zeros(6, 16, dtype=torch.uint8), torch.zeros(6, 24, dtype=torch.uint8)]
    src = [slab[:, :16], slab[:, 16:]]
    native.copy_rows(parts, src, [4, 0, 5], [8, 2, 3])
    for part, s in zip(parts, src):
        assert torch.equal(part[[4, 0, 5]], s[[8, 2, 3]])
        assert not part[[1, 2, 3]].any()  # untouched rows
    with pytest.raises(ValueError, match="out of range"):
        native.copy_rows(parts, src, [6], [0])
    with pytest.raises(ValueError, match="out of range"):
        native.copy_rows(parts, src, [0], [9])
    with pytest.raises(ValueError, match="bytes"):
        native.copy_rows(parts, [slab[:, :16], slab[:, :16]], [0], [0])


@needs_native
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 1000])
def test_native_row_max_is_torch_max(native: NativeKernels, cols: int) -> None:
    """Values and first indices as torch's max(dim=-1), NaN preferred, on rows shorter or longer than a vector and
    on strided rows; a float64 tensor goes to torch."""
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(cols))
    x[1] = -float("inf")
    x[2, cols // 2] = float("nan")
    x[3] = 0.5
    for t in (x, x[:, : max(1, cols - 1)], x[::2]):
        values, ids = native.row_max(t)
        want_values, want_ids = t.max(dim=-1)
        assert torch.equal(ids, want_ids) and torch.equal(values.isnan(), want_values.isnan())
        assert torch.equal(values.nan_to_num(), want_values.nan_to_num())
    assert torch.equal(native.row_max(x.double())[1], x.double().max(dim=-1)[1])


@needs_native
def test_native_row_max_of_one_long_row_split_across_threads(native: NativeKernels) -> None:
    """At batch 1 a row's columns are split across the threads (row_max.cpp): ties across the parts give the first,
    a NaN in a later part beats an earlier maximum, an all -inf row gives index 0, as torch's max(dim=-1)."""
    x = torch.randn(1, 262_147, generator=torch.Generator().manual_seed(2))
    cases = [x.clone() for _ in range(5)]
    cases[1][0, [5, 262_140]] = 1e9
    cases[2][0, 3] = 1e9
    cases[2][0, 200_001] = float("nan")
    cases[3][0] = -float("inf")
    cases[4][0] = 2.0
    for t in cases:
        values, ids = native.row_max(t)
        want_values, want_ids = t.max(dim=-1)
        assert torch.equal(ids, want_ids) and torch.equal(values.nan_to_num(7.0), want_values.nan_to_num(7.0))
