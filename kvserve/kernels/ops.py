"""The operations kvserve runs through its own kernels, with two implementations of each:
- `NativeKernels`: the compiled library (kvserve/kernels/native.py): AVX2 + FMA, OpenMP.
- `TorchKernels`: plain torch; the fallback where the library cannot be built or run (no compiler, no AVX2,
  tensors not on the CPU) and the reference the native kernels are tested against.
`load_kernels` picks the native ones when it can and says why when it cannot. Modules hold the `Kernels`
they were given (no module-level state)."""

from __future__ import annotations

import ctypes
import logging
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.dtypes import dtype_name
from kvserve.kernels.abi import (
    KV_DTYPE_CODES,
    STRUCTS,
    DecodeAttentionArgs,
    LayerDesc,
    PrefillAttentionArgs,
    QkNormRopeArgs,
    StepDesc,
)
from kvserve.kernels.activation_quant import fake_quantize_activations
from kvserve.kernels.gguf_blocks import (
    NATIVE_GGUF_TYPES,
    Q5_TILES,
    ROWS4,
    dequantize_blocks,
    ggml_type,
    q5_tiles_fit,
    row_length,
)
from kvserve.kernels.native import build_native_library, cpu_supports_native, load_native_library, supported_isas
from kvserve.kernels.q8 import GROUP_SIZE, dequantize_q8
from kvserve.kv.huge_pages import empty_huge

log = logging.getLogger(__name__)


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}
# The activations kvserve_gated_act computes (its `act` code); exact-erf GELU stays with torch.
NATIVE_ACTIVATIONS = {"gelu_pytorch_tanh": 0, "gelu_tanh": 0, "gelu_new": 0, "silu": 1, "swish": 1}


class Kernels(Protocol):
    @property
    def name(self) -> str:
        """ "torch" or "native" (read-only, so that the frozen dataclasses below satisfy the protocol)."""
        ...

    @property
    def activation_quantization(self) -> str:
        """ "none" (float32 activations) or "int8" (kvserve.vocab.ACTIVATION_QUANTIZATIONS): how gguf_matmul
        takes its activations (kernels/activation_quant.py)."""
        ...

    def q8_matmul(
        self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] @ dequant(q [N, K] int8, scales [N, K/32] float32)^T -> [M, N] float32; into `out` ([M, N]
        float32 contiguous) when given, and then `out` is returned."""
        ...

    def gguf_matmul(
        self, x: torch.Tensor, blocks: torch.Tensor, qtype: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] @ W^T with W [N, K] held as GGUF blocks of ggml type `qtype` (uint8 [N, row_bytes], see
        kernels/gguf_blocks.py; `qtype` plus ROWS4, and Q5_TILES, for the native layouts) -> [M, N] float32;
        into `out` ([M, N] float32 whose rows may be a column slice of a wider buffer) when given, and then `out` is
        returned. With activation_quantization "int8", x is first quantized to 8 bits per run of 32
        (kernels/activation_quant.py)."""
        ...

    def gguf_dequantize(self, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        """uint8 [N, row_bytes] GGUF blocks of `qtype` -> float32 [N, K] (an embedding's looked-up rows)."""
        ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm over the last axis of x ([T, D] or [T, G, D]) in float32 times weight [D]; into `out` (same
        shape, float32, may be a strided view) when given, else a new contiguous tensor."""
        ...

    def gated_act(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up for gate_up = [..., gate | up] (equal halves); act is one of GATED_ACTIVATIONS."""
        ...

    def qk_norm_rope(
        self,
        qk: torch.Tensor,
        q_heads: int,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> torch.Tensor:
        """qk [T, heads, D] (Q heads then K heads; rows may be strided, as slices of the fused QKV output): the
        per-head RMSNorm (q_weight on the first q_heads, k_weight on the rest; none when the weights are None),
        then NEOX rope with cos / signed_sin [T, 1, D] (cos over both halves, sin negated on the first half)
        -> a new contiguous [T, heads, D] in qk's dtype."""
        ...

    def causal_conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        states: torch.Tensor,
        slots: torch.Tensor,
        starts: Sequence[int],
        continues: Sequence[bool],
        pre: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        silu: bool = False,
    ) -> torch.Tensor:
        """A depthwise causal convolution of a flat batch of sequences, each continuing its state (kv/state.py):
        [T, C] rows -> [T, C] = gate * act(bias + conv(pre * x)) (pre, gate: [T, C] or None; act: SiLU or none).
        Each sequence's state (states[slots[s]], [kernel - 1, C]; zeros where not continues[s]) is read first and
        left holding its last kernel - 1 inputs (pre * x). starts: S + 1 row offsets. LFM2's short convolution is
        C * conv(B * x); Qwen3.5's Gated DeltaNet convolves its q, k, v with SiLU."""
        ...

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        starts: Sequence[int],
        continues: Sequence[bool],
    ) -> torch.Tensor:
        """Qwen3.5's Gated DeltaNet over a flat batch of sequences: q, k [T, k_heads, key_dim] (L2-normalized here, q
        scaled by key_dim^-1/2), v [T, v_heads, value_dim], g (log decay) and beta [T, v_heads] -> [T, v_heads,
        value_dim]. Per value head (key head h // (v_heads // k_heads)), token by token: S = exp(g) S, S += k (beta
        (v - S^T k))^T, out = S^T q, S ([key_dim, value_dim]) starting from states[slots[s]] (zeros where not
        continues[s]) and left there."""
        ...

    def has_paged_attention(self, cache: torch.Tensor) -> bool:
        """Whether `paged_decode_attention` and `paged_prefill_attention` take this cache (else the caller
        gathers K/V and uses SDPA): a contiguous CPU cache of one of kernels/abi.py's KV_DTYPE_CODES."""
        ...

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int | None,
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, H, D] (one token per sequence, at position seq_len - 1) over each sequence's context in the
        paged cache [blocks, block_size, kv_heads, D] of any KV dtype has_paged_attention takes, read in place through
        block_tables [B, W] -> [B, H, D] float32. An 8-bit cache comes with its k_scales and v_scales ([blocks,
        block_size, kv_heads], kvserve/kv/quant.py's layout)."""
        ...

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        window: int | None,
        scale: float,
        out: torch.Tensor | None = None,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [L, H, D] (one sequence's chunk, at positions seq_len - L .. seq_len - 1), causal over its context
        in the paged cache, read in place through block_table [W] -> [L, H, D] float32; into `out` (contiguous)
        when given. Caches and scales as paged_decode_attention's."""
        ...


@dataclass(frozen=True, slots=True)
class TorchKernels:
    """Plain torch. The q8 matmul widens `slab_rows` weight rows at a time, so the float32 copy never exceeds
    slab_rows x K."""

    slab_rows: int = 16384
    name: str = "torch"
    activation_quantization: str = "none"

    def q8_matmul(
        self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x.float()
        if q.shape[0] <= self.slab_rows:
            return torch.matmul(x, dequantize_q8(q, scales).T, out=out)
        if out is None:
            out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, q.shape[0], self.slab_rows):
            end = min(start + self.slab_rows, q.shape[0])
            out[:, start:end] = x @ dequantize_q8(q[start:end], scales[start:end]).T
        return out

    def gguf_matmul(
        self, x: torch.Tensor, blocks: torch.Tensor, qtype: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x.float()
        if self.activation_quantization == "int8":
            x = fake_quantize_activations(x.reshape(-1, x.shape[-1]))
        if out is None:
            out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, blocks.shape[0], self.slab_rows):
            end = min(start + self.slab_rows, blocks.shape[0])
            out[:, start:end] = x @ dequantize_blocks(blocks[start:end], qtype).to(x.device).T
        return out

    def gguf_dequantize(self, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        return dequantize_blocks(blocks, qtype).to(blocks.device)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = F.rms_norm(x.float(), weight.shape, weight, eps)
        return y if out is None else out.copy_(y)

    def gated_act(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return GATED_ACTIVATIONS[act](gate) * up

    def qk_norm_rope(
        self,
        qk: torch.Tensor,
        q_heads: int,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> torch.Tensor:
        if q_weight is not None and k_weight is not None:
            normed = torch.empty(qk.shape, dtype=torch.float32, device=qk.device)
            self.rms_norm(qk[:, :q_heads], q_weight, eps, out=normed[:, :q_heads])
            self.rms_norm(qk[:, q_heads:], k_weight, eps, out=normed[:, q_heads:])
            qk = normed.to(qk.dtype)
        # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) = x * cos + swap_halves(x) * (-sin, sin)
        return torch.addcmul(qk * cos, qk.roll(qk.shape[-1] // 2, dims=-1), signed_sin)

    def causal_conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        states: torch.Tensor,
        slots: torch.Tensor,
        starts: Sequence[int],
        continues: Sequence[bool],
        pre: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        silu: bool = False,
    ) -> torch.Tensor:
        xs = x if pre is None else pre * x
        keep = weight.shape[1] - 1
        w = weight.to(xs.dtype)
        decode_only = all(e - a == 1 for a, e in zip(starts, starts[1:])) and all(continues)
        if decode_only:  # one token a sequence: one vectorized expression for the batch
            window = torch.cat((states.index_select(0, slots).to(xs.dtype), xs[:, None, :]), dim=1)  # [S, k, C]
            conv = torch.einsum("skc,ck->sc", window, w)
            states.index_copy_(0, slots, window[:, 1:].to(states.dtype))
        else:
            conv = torch.empty_like(xs)
            for i, slot in enumerate(slots.tolist()):
                a, e = starts[i], starts[i + 1]
                state = states[slot].to(xs.dtype) if continues[i] else xs.new_zeros(keep, xs.shape[1])
                window = torch.cat((state, xs[a:e]), dim=0)  # [keep + n, C]
                conv[a:e] = (window.unfold(0, keep + 1, 1) * w).sum(-1)  # unfold: [n, C, k]
                states[slot] = window[-keep:].to(states.dtype)
        if bias is not None:
            conv = conv + bias.to(xs.dtype)
        if silu:
            conv = F.silu(conv)
        return conv if gate is None else gate * conv

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        starts: Sequence[int],
        continues: Sequence[bool],
    ) -> torch.Tensor:
        group = v.shape[1] // k.shape[1]
        q = _l2norm(q.float()) * q.shape[-1] ** -0.5
        k = _l2norm(k.float())
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)  # [T, v_heads, key_dim]
        v, g, beta = v.float(), g.float(), beta.float()
        out = torch.empty_like(v)
        for i, slot in enumerate(slots.tolist()):
            a, e = starts[i], starts[i + 1]
            state = states[slot].float() if continues[i] else states.new_zeros(states.shape[1:], dtype=torch.float32)
            for t in range(a, e):  # the recurrence, every head at once
                state = state * g[t].exp()[:, None, None]
                delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
                state = state + k[t][:, :, None] * delta[:, None, :]
                out[t] = torch.einsum("hkv,hk->hv", state, q[t])
            states[slot] = state.to(states.dtype)
        return out

    def has_paged_attention(self, cache: torch.Tensor) -> bool:
        return False  # torch has no paged attention: attention/cpu.py gathers K/V and calls SDPA

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int | None,
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError("the torch kernels have no paged attention; check has_paged_attention first")

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        window: int | None,
        scale: float,
        out: torch.Tensor | None = None,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError("the torch kernels have no paged attention; check has_paged_attention first")


@dataclass(frozen=True, slots=True)
class NativeKernels:
    """The compiled kernels; anything they cannot take (other devices, dtypes or layouts) goes to `fallback`."""

    library: ctypes.CDLL
    fallback: TorchKernels = TorchKernels()
    name: str = "native"
    isa: str = "avx2"  # the instruction set the library was built for (kvserve.kernels.native.ISA_REQUIREMENTS)
    activation_quantization: str = "none"  # "int8": gguf_matmul through kernels/gguf_int8_matmul.cpp

    def q8_matmul(
        self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.device.type != "cpu" or q.device.type != "cpu":
            return self.fallback.q8_matmul(x, q, scales, out)
        x = x.float().contiguous()
        m, k = x.shape
        n = q.shape[0]
        if q.shape[1] != k or scales.shape != (n, k // GROUP_SIZE) or k % GROUP_SIZE:
            raise ValueError(
                f"q8 matmul shapes do not fit: x {tuple(x.shape)}, q {tuple(q.shape)}, scales {tuple(scales.shape)}"
            )
        if out is not None and (out.shape != (m, n) or out.dtype != torch.float32 or not out.is_contiguous()):
            raise ValueError(
                f"q8 matmul output must be a contiguous float32 [{m}, {n}], got {out.dtype} {tuple(out.shape)}"
            )
        y = torch.empty(m, n, dtype=torch.float32) if out is None else out
        if m:
            self.library.kvserve_q8_matmul(x.data_ptr(), m, k, q.data_ptr(), scales.data_ptr(), n, y.data_ptr())
        return y

    def gguf_matmul(
        self, x: torch.Tensor, blocks: torch.Tensor, qtype: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if ggml_type(qtype) not in NATIVE_GGUF_TYPES or x.device.type != "cpu" or blocks.device.type != "cpu":
            return self.fallback.gguf_matmul(x, blocks, qtype, out)
        x, y = _gguf_matmul_operands(x, blocks, qtype, out)
        m, k = x.shape
        n = blocks.shape[0]
        if m and n:
            matmul = (
                self.library.kvserve_gguf_matmul_int8
                if self.activation_quantization == "int8"
                else self.library.kvserve_gguf_matmul
            )
            matmul(x.data_ptr(), m, k, blocks.data_ptr(), qtype, n, y.data_ptr(), y.stride(0))
        return y

    def pack_int8_panels(self, blocks: torch.Tensor, qtype: int) -> torch.Tensor | None:
        """GGUF blocks [n, row bytes] packed once into the int8 matmul's 32-row panels (gguf_int8_matmul.cpp), for
        gguf_matmul_packed; None where that matmul has no panel path (builds without AVX-512 VNNI, float32
        activations, types it has no kernel for). About the bytes of the weights as int8 plus float32 scales: 1.0x
        Q8_0's for the tied LM head."""
        native = ggml_type(qtype) in NATIVE_GGUF_TYPES
        if self.activation_quantization != "int8" or not native or blocks.device.type != "cpu":
            return None
        blocks = blocks.contiguous()
        n, k = blocks.shape[0], row_length(qtype, blocks.shape[1])
        size = self._packed_panels_bytes(qtype, n, k)
        if size == 0 or n == 0:
            return None
        packed = torch.empty(size, dtype=torch.uint8)
        self.library.kvserve_gguf_pack_panels_int8(blocks.data_ptr(), qtype, n, k, packed.data_ptr())
        return packed

    def _packed_panels_bytes(self, qtype: int, n: int, k: int) -> int:
        size = ctypes.c_int64(0)
        self.library.kvserve_gguf_packed_panels_bytes(qtype, n, k, ctypes.addressof(size))
        return size.value

    def gguf_matmul_packed(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        packed: torch.Tensor,
        qtype: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gguf_matmul with int8 activations on weights pack_int8_panels packed from these `blocks` (read in place
        above 4 rows; the blocks themselves at 1-4). Raises ValueError for a packing of other sizes."""
        if x.device.type != "cpu" or blocks.device.type != "cpu":
            raise ValueError("gguf_matmul_packed takes host tensors")
        x, y = _gguf_matmul_operands(x, blocks, qtype, out)
        m, k = x.shape
        n = blocks.shape[0]
        size = self._packed_panels_bytes(qtype, n, k)
        if self.activation_quantization != "int8" or packed.dtype != torch.uint8 or packed.numel() != size:
            raise ValueError(f"packed panels of {packed.numel()} bytes do not fit [{n}, {k}] (expected {size})")
        if m and n:
            self.library.kvserve_gguf_matmul_int8_packed(
                x.data_ptr(), m, k, blocks.data_ptr(), packed.data_ptr(), qtype, n, y.data_ptr(), y.stride(0)
            )
        return y

    def row_max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x.max(dim=-1) of a 2-D float32 tensor, (values, indices): each row's largest value and its first index,
        NaN preferred as torch's CPU max gives them, with the rows split across the threads (greedy sampling of
        a batch; engine/sampler.py). Other tensors go to torch."""
        native = x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"
        if not (native and x.shape[1] > 0 and x.stride(1) == 1):
            values, ids = x.max(dim=-1)
            return values, ids
        rows = x.shape[0]
        values = torch.empty(rows, dtype=torch.float32)
        ids = torch.empty(rows, dtype=torch.int64)
        if rows:
            self.library.kvserve_row_max(x.data_ptr(), rows, x.shape[1], x.stride(0), values.data_ptr(), ids.data_ptr())
        return values, ids

    def copy_rows(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        dst_rows: Sequence[int],
        src_rows: Sequence[int],
    ) -> None:
        """Row dst_rows[i] of each dst[p] <- row src_rows[i] of src[p], in one call across the threads: the offload
        tier's copies between the KV cache and its host memory (kv/offload/layout.py). Each part is a pair of 2-D
        uint8 host tensors with contiguous rows of equal length; rows may be any distance apart. Raises ValueError
        for a part it cannot take or a row out of range (nothing is copied then)."""
        if len(dst) != len(src) or len(dst_rows) != len(src_rows):
            raise ValueError(f"copy_rows: {len(dst)} destinations for {len(src)} sources, or rows of unequal counts")
        for d, s in zip(dst, src):
            if not all(t.device.type == "cpu" and t.dtype == torch.uint8 and t.dim() == 2 for t in (d, s)):
                raise ValueError("copy_rows takes 2-D uint8 host tensors")
            if d.shape[1] != s.shape[1] or d.stride(1) != 1 or s.stride(1) != 1:
                raise ValueError(f"copy_rows: rows of {d.shape[1]} and {s.shape[1]} bytes, or not contiguous")
        if not dst_rows or not dst:
            return
        for wanted, tensors in ((dst_rows, dst), (src_rows, src)):
            if min(wanted) < 0 or max(wanted) >= min(t.shape[0] for t in tensors):
                raise ValueError(f"copy_rows: a row of {min(wanted)}..{max(wanted)} is out of range")
        table = np.array(
            [
                [t.data_ptr() for t in dst],
                [t.stride(0) for t in dst],
                [t.data_ptr() for t in src],
                [t.stride(0) for t in src],
                [t.shape[1] for t in dst],
            ],
            dtype=np.int64,
        )
        rows = np.array([dst_rows, src_rows], dtype=np.int64)
        address = table.ctypes.data
        step = table.strides[0]
        self.library.kvserve_copy_rows(
            len(dst),
            address,
            address + step,
            address + 2 * step,
            address + 3 * step,
            address + 4 * step,
            rows.shape[1],
            rows.ctypes.data,
            rows.ctypes.data + rows.strides[0],
        )

    def interleave_rows(self, blocks: torch.Tensor, qtype: int, tiles: bool = False) -> tuple[int, torch.Tensor] | None:
        """Host blocks [N, row_bytes] of ggml type `qtype` in the file's layout -> (kernel type, the same bytes with
        the rows interleaved four at a time): qtype + ROWS4, or with `tiles` and Q5_0 rows of a multiple of 128
        weights qtype + ROWS4 + Q5_TILES (gguf_blocks.py). On huge pages like the file's numpy copies; None where
        there is no whole group of four rows or the blocks are not this library's."""
        if ggml_type(qtype) != qtype or qtype not in NATIVE_GGUF_TYPES or blocks.device.type != "cpu":
            return None
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[0] < 4:
            return None
        blocks = blocks.contiguous()
        n, k = blocks.shape[0], row_length(qtype, blocks.shape[1])
        kernel_type = qtype + ROWS4 + (Q5_TILES if tiles and q5_tiles_fit(qtype, k) else 0)
        out = empty_huge(tuple(blocks.shape), torch.uint8, blocks.device)
        self.library.kvserve_gguf_interleave_rows(blocks.data_ptr(), kernel_type, n, k, out.data_ptr())
        return kernel_type, out

    def gguf_dequantize(self, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        if ggml_type(qtype) not in NATIVE_GGUF_TYPES or blocks.device.type != "cpu":
            return self.fallback.gguf_dequantize(blocks, qtype)
        blocks = blocks.contiguous()
        rows, k = blocks.shape[0], row_length(qtype, blocks.shape[1])
        out = torch.empty(rows, k, dtype=torch.float32)
        if rows and k:
            self.library.kvserve_gguf_dequantize(blocks.data_ptr(), qtype, rows, k, out.data_ptr())
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not (
            _rows_layout(x)
            and (out is None or (_rows_layout(out) and out.dtype == torch.float32))
            and x.dtype == weight.dtype == torch.float32
            and x.device.type == "cpu"
            and weight.is_contiguous()
        ):
            return self.fallback.rms_norm(x, weight, eps, out)
        dst = torch.empty(x.shape, dtype=torch.float32) if out is None else out
        tokens = x.shape[0] if x.dim() > 1 else 1
        groups = x.shape[1] if x.dim() == 3 else 1
        if tokens:
            self.library.kvserve_rms_norm(
                x.data_ptr(),
                tokens,
                x.stride(0) if x.dim() > 1 else 0,
                groups,
                x.shape[-1],
                weight.data_ptr(),
                eps,
                dst.data_ptr(),
                dst.stride(0) if dst.dim() > 1 else 0,
            )
        return dst

    def qk_norm_rope(
        self,
        qk: torch.Tensor,
        q_heads: int,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> torch.Tensor:
        tokens, heads, dim = qk.shape
        weights = (q_weight, k_weight) if q_weight is not None and k_weight is not None else (None, None)
        if not (
            qk.dtype == cos.dtype == signed_sin.dtype == torch.float32
            and qk.device.type == "cpu"
            and qk.stride(2) == 1
            and qk.stride(1) == dim
            and dim % 16 == 0
            and cos.is_contiguous()
            and signed_sin.is_contiguous()
            and cos.numel() == signed_sin.numel() == tokens * dim
            and all(w is None or (w.dtype == torch.float32 and w.is_contiguous() and w.numel() == dim) for w in weights)
        ):
            return self.fallback.qk_norm_rope(qk, q_heads, q_weight, k_weight, eps, cos, signed_sin)
        out = torch.empty(tokens, heads, dim, dtype=torch.float32)
        if tokens:
            q_ptr, k_ptr = (w.data_ptr() if w is not None else None for w in weights)
            args = QkNormRopeArgs(
                qk.data_ptr(),
                q_ptr,
                k_ptr,
                cos.data_ptr(),
                signed_sin.data_ptr(),
                out.data_ptr(),
                tokens,
                qk.stride(0),
                heads,
                q_heads,
                dim,
                dim,
                eps,
            )
            self.library.kvserve_qk_norm_rope(ctypes.addressof(args))
        return out

    def gated_act(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        code = NATIVE_ACTIVATIONS.get(act)
        if code is None or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu":
            return self.fallback.gated_act(gate_up, act)
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        rows = gate_up.numel() // gate_up.shape[-1] if gate_up.numel() else 0
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=torch.float32)
        if rows:
            self.library.kvserve_gated_act(gate_up.data_ptr(), rows, inter, code, out.data_ptr())
        return out

    def causal_conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        states: torch.Tensor,
        slots: torch.Tensor,
        starts: Sequence[int],
        continues: Sequence[bool],
        pre: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        silu: bool = False,
    ) -> torch.Tensor:
        rows = [t for t in (x, pre, gate) if t is not None]
        whole = [weight, states] + ([] if bias is None else [bias])
        if not (
            all(t.dtype == torch.float32 and t.device.type == "cpu" for t in rows + whole)
            and all(t.is_contiguous() for t in whole)
            and all(t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == x.stride(0) for t in rows)
        ):
            return self.fallback.causal_conv(x, weight, bias, states, slots, starts, continues, pre, gate, silu)
        channels = x.shape[1]
        out = torch.empty(x.shape[0], channels, dtype=torch.float32)
        if x.shape[0]:
            slot_ids, offsets, flags = _step_arrays(slots, starts, continues)
            self.library.kvserve_causal_conv(
                x.data_ptr(),
                None if pre is None else pre.data_ptr(),
                None if gate is None else gate.data_ptr(),
                x.stride(0),
                weight.data_ptr(),
                None if bias is None else bias.data_ptr(),
                states.data_ptr(),
                slot_ids.data_ptr(),
                offsets.data_ptr(),
                flags.data_ptr(),
                len(continues),
                channels,
                weight.shape[1],
                int(silu),
                out.data_ptr(),
            )
        return out

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        starts: Sequence[int],
        continues: Sequence[bool],
    ) -> torch.Tensor:
        tensors = (q, k, v, g, beta, states)
        if not (
            all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and states.is_contiguous()
            and q.stride(0) == k.stride(0)
            and g.stride(0) == beta.stride(0)
            and all(t.stride(-1) == 1 for t in (q, k, v, g, beta))
            and all(t.stride(1) == t.shape[2] for t in (q, k, v))
        ):
            return self.fallback.gated_delta_rule(q, k, v, g, beta, states, slots, starts, continues)
        tokens, v_heads, value_dim = v.shape
        out = torch.empty(tokens, v_heads, value_dim, dtype=torch.float32)
        if tokens:
            slot_ids, offsets, flags = _step_arrays(slots, starts, continues)
            self.library.kvserve_gated_delta_rule(
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                q.stride(0),
                v.stride(0),
                g.data_ptr(),
                beta.data_ptr(),
                g.stride(0),
                states.data_ptr(),
                slot_ids.data_ptr(),
                offsets.data_ptr(),
                flags.data_ptr(),
                len(continues),
                k.shape[1],
                v_heads,
                k.shape[2],
                value_dim,
                out.data_ptr(),
            )
        return out

    def has_paged_attention(self, cache: torch.Tensor) -> bool:
        return kv_dtype_code(cache.dtype) is not None and cache.device.type == "cpu" and cache.is_contiguous()

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int | None,
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        code, k_ptr, v_ptr, keep = _paged_cache_args(k_cache, v_cache, k_scales, v_scales)
        q = q.float().contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        out = torch.empty(batch, heads, dim, dtype=torch.float32)
        if not batch:
            return out
        args = DecodeAttentionArgs(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_ptr,
            v_ptr,
            tables.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            tables.shape[1],
            batch,
            heads,
            kv_heads,
            dim,
            block_size,
            window or 0,
            code,
            scale,
        )
        self.library.kvserve_paged_decode_attention(ctypes.addressof(args))
        del keep
        return out

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        window: int | None,
        scale: float,
        out: torch.Tensor | None = None,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q_len, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        table = block_table.to(torch.int64).contiguous()
        if not 0 < q_len <= seq_len or table.numel() * block_size < seq_len or heads % kv_heads:
            raise ValueError(
                f"paged prefill attention: {q_len} queries, context {seq_len}, a table of "
                f"{table.numel()} blocks of {block_size}, {heads} heads over {kv_heads} KV heads"
            )
        code, k_ptr, v_ptr, keep = _paged_cache_args(k_cache, v_cache, k_scales, v_scales)
        q = q.float().contiguous()
        direct = out is not None and out.is_contiguous() and out.dtype == torch.float32
        dst = out if out is not None and direct else torch.empty(q_len, heads, dim, dtype=torch.float32)
        args = PrefillAttentionArgs(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_ptr,
            v_ptr,
            table.data_ptr(),
            dst.data_ptr(),
            q_len,
            seq_len,
            heads,
            kv_heads,
            dim,
            block_size,
            window or 0,
            code,
            scale,
        )
        self.library.kvserve_paged_prefill_attention(ctypes.addressof(args))
        del keep
        return dst if out is None or direct else out.copy_(dst)

    def decoder_layer(
        self,
        layer: LayerDesc,
        step: StepDesc,
        h: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        kv_dtype: int = 0,
    ) -> None:
        """A whole decoder layer (decoder_layer.cpp) on the residual stream h [T, hidden] float32, in place, its new
        K/V written into caches of kv_dtype (a KV_DTYPE_CODES code; an 8-bit cache comes with its scales,
        kvserve/kv/quant.py's layout). Only for the native layer path (model/native_layer.py), which has checked
        every layout and dtype the call relies on, once per model or once per step: this is the hot path, so it
        checks nothing."""
        self.library.kvserve_decoder_layer(
            ctypes.addressof(layer),
            ctypes.addressof(step),
            h.data_ptr(),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            None if k_scales is None else k_scales.data_ptr(),
            None if v_scales is None else v_scales.data_ptr(),
            kv_dtype,
        )

    def short_conv_layer(self, layer: LayerDesc, step: StepDesc, h: torch.Tensor, conv_states: torch.Tensor) -> None:
        """An LFM2 short-convolution layer (decoder_layer.cpp) on h [T, hidden] float32, in place, each sequence's
        convolution state read from and left in its slot of conv_states (the step's state_slots). As decoder_layer:
        for the native layer path only, which checked the layouts once."""
        self.library.kvserve_short_conv_layer(
            ctypes.addressof(layer), ctypes.addressof(step), h.data_ptr(), conv_states.data_ptr()
        )

    def gated_deltanet_layer(
        self, layer: LayerDesc, step: StepDesc, h: torch.Tensor, conv_states: torch.Tensor, recurrent: torch.Tensor
    ) -> None:
        """A Qwen3.5 Gated DeltaNet layer (decoder_layer.cpp) on h [T, hidden] float32, in place, each sequence's
        convolution and recurrent states read from and left in its slot (the step's state_slots). As decoder_layer:
        for the native layer path only, which checked the layouts once."""
        self.library.kvserve_gated_deltanet_layer(
            ctypes.addressof(layer), ctypes.addressof(step), h.data_ptr(), conv_states.data_ptr(), recurrent.data_ptr()
        )

    def store_kv_rows(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [rows, dim] float32 -> (rows of `dtype` [rows, dim], float32 scales [rows] for an 8-bit dtype, else
        None): the native layer's KV write (kv_dtypes.h), for tests against kvserve/kv/quant.py's store."""
        code = kv_dtype_code(dtype)
        if code is None:
            raise ValueError(f"no native KV cache element type for {dtype}")
        x = x.float().contiguous()
        q = torch.empty(x.shape, dtype=dtype)
        scales = torch.empty(x.shape[0], dtype=torch.float32) if dtype.itemsize == 1 else None
        self.library.kvserve_store_kv_rows(
            x.data_ptr(), x.shape[0], x.shape[1], code, q.data_ptr(), None if scales is None else scales.data_ptr()
        )
        return q, scales

    def quantize_int8_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] float32 -> (int8 [M, K], float32 [M, K / 32]): the int8 matmul's activation quantization
        (tested against kernels/activation_quant.py's)."""
        x = x.float().contiguous()
        q = torch.empty(x.shape, dtype=torch.int8)
        d = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32)
        if x.numel():
            rows, k = x.shape
            self.library.kvserve_quantize_int8_activations(x.data_ptr(), rows, k, q.data_ptr(), d.data_ptr())
        return q, d

    def bf16_dot_products(self, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether paged attention (prefill and decode) on a cache of kv_dtype rounds its queries and softmax weights
        to bfloat16 for AVX512_BF16's dot products (kernels/prefill_attention.cpp's and paged_attention.cpp's
        condition): a bfloat16 cache, head_dim a multiple of 16, on the avx512bf16 build."""
        return self.isa == "avx512bf16" and kv_dtype == torch.bfloat16 and head_dim % 16 == 0

    def int8_dot_product(self) -> str:
        """The integer dot product this build's int8 matmul uses: "avx512vnni", "avxvnni" or "avx2"."""
        code = ctypes.c_int64()
        self.library.kvserve_int8_dot_isa(ctypes.addressof(code))
        return ("avx2", "avxvnni", "avx512vnni")[code.value]

    def abi_matches(self) -> bool:
        """Whether the library's struct sizes are those of kernels/abi.py's ctypes mirror (kernels.h's order)."""
        sizes = (ctypes.c_int64 * len(STRUCTS))()
        self.library.kvserve_abi_sizes(ctypes.addressof(sizes))
        return list(sizes) == [ctypes.sizeof(struct) for struct in STRUCTS]

    def decoder_layer_scratch(self, layer: LayerDesc, tokens: int, decode_count: int) -> int:
        """Floats of scratch memory `decoder_layer` needs for a step of `tokens` rows (`decode_count`: the
        decode rows of a mixed step, 0 when all rows are decodes)."""
        floats = ctypes.c_int64()
        self.library.kvserve_decoder_layer_scratch(
            ctypes.addressof(layer), tokens, decode_count, ctypes.addressof(floats)
        )
        return floats.value


TORCH_KERNELS = TorchKernels()  # stateless: the default of every module until the loader hands out its kernels


def kv_dtype_code(dtype: torch.dtype) -> int | None:
    """kernels.h's KvserveKvDtype code of a KV cache's storage dtype, or None where the native kernels take none."""
    return KV_DTYPE_CODES.get(dtype_name(dtype))


def _paged_cache_args(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None
) -> tuple[int, int | None, int | None, list[torch.Tensor]]:
    """The attention kernels' view of a cache: its element type code and its scales' addresses (an 8-bit cache must
    come with both, a 16/32-bit one with none), and the tensors those addresses point into (kept alive by the caller
    until the call returns). ValueError for a cache the kernels cannot read."""
    code = kv_dtype_code(k_cache.dtype)
    if code is None or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"paged attention reads contiguous K/V caches of {', '.join(KV_DTYPE_CODES)}, not these")
    scaled = k_cache.dtype.itemsize == 1
    given = [k_scales is not None, v_scales is not None]
    if given != [scaled, scaled]:
        raise ValueError(f"a {k_cache.dtype} KV cache {'needs' if scaled else 'takes no'} scales")
    if k_scales is None or v_scales is None:
        return code, None, None, []
    keep = [k_scales.float().contiguous(), v_scales.float().contiguous()]
    return code, keep[0].data_ptr(), keep[1].data_ptr(), keep


def _gguf_matmul_operands(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The native GGUF matmuls' operands checked: x as contiguous float32 [m, k], and the output [m, n] (`out`, or a
    new tensor). Raises ValueError for blocks or an output that do not fit."""
    x = x.float().contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or row_length(qtype, blocks.shape[1]) != k:
        raise ValueError(
            f"gguf matmul shapes do not fit: x {tuple(x.shape)}, {NATIVE_GGUF_TYPES[ggml_type(qtype)].name} "
            f"blocks {blocks.dtype} {tuple(blocks.shape)}"
        )
    if out is not None and (
        out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1 or (m > 1 and out.stride(0) < n)
    ):
        raise ValueError(
            f"gguf matmul output must be float32 [{m}, {n}] with unit column stride, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    return x, torch.empty(m, n, dtype=torch.float32) if out is None else out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (the FLA library's form, which Qwen3.5 was trained with)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _step_arrays(
    slots: torch.Tensor, starts: Sequence[int], continues: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's per-sequence arrays as the recurrent kernels read them: int64 slots, row offsets, continue flags."""
    return (
        slots.to(dtype=torch.int64).contiguous(),
        torch.tensor(list(starts), dtype=torch.int64),
        torch.tensor([int(c) for c in continues], dtype=torch.int64),
    )


def _rows_layout(t: torch.Tensor) -> bool:
    """[D], [T, D] or [T, G, D] whose groups of D are contiguous and adjacent: what the native norm walks."""
    if t.dim() == 1:
        return t.stride(0) == 1
    if t.dim() == 2:
        return t.stride(1) == 1
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def load_kernels(
    cache_dir: Path, native: bool = True, isa: str | None = None, activation_quantization: str = "none"
) -> Kernels:
    """The native kernels when this machine can build and run them, else the torch ones (with a warning).

    isa: build for this key of kvserve.kernels.native.ISA_REQUIREMENTS instead of the best the CPU has (tests
    and A/B measurements: `--kernel-isa`). Without it, a set whose build fails (a compiler too old for AVX-512)
    gives way to the next one the CPU has, with a warning. activation_quantization: "int8" quantizes the GGUF
    matmuls' activations (kernels/activation_quant.py), on either implementation."""
    fallback = TorchKernels(activation_quantization=activation_quantization)
    if not native:
        return fallback
    ok, why = cpu_supports_native()
    if ok and isa is not None and isa not in supported_isas():
        raise ValueError(f"--kernel-isa {isa}: this CPU lacks it (it has: {', '.join(supported_isas())})")
    if ok:
        for candidate in [isa] if isa else supported_isas():
            try:
                kernels = NativeKernels(
                    load_native_library(build_native_library(cache_dir, candidate)),
                    fallback=fallback,
                    isa=candidate,
                    activation_quantization=activation_quantization,
                )
                if not kernels.abi_matches():  # a build of other sources: its structs would be misread
                    raise RuntimeError("the library's structs differ from kernels/abi.py's (kernels.h)")
                if activation_quantization == "int8":
                    log.info(
                        "kvserve's CPU kernels: the %s build, int8 activations on %s dot products",
                        candidate,
                        kernels.int8_dot_product(),
                    )
                else:
                    log.info("kvserve's CPU kernels: the %s build", candidate)
                return kernels
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                why = str(e)
                log.warning("the %s build of kvserve's CPU kernels failed: %s", candidate, why)
    log.warning("using the slower torch kernels: %s", why)
    return fallback
