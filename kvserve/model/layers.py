"""Building blocks of the decoder: RMSNorm, rotary embedding, gated MLP, paged attention wrapper.

Weights follow one convention whatever the checkpoint: RMSNorm multiplies by its stored weight (Gemma's
"1 + w" is folded in by the loader), q/k/v and gate/up projections are fused (one GEMM each).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, AttentionLayerSpec
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.ops import GATED_ACTIVATIONS, TORCH_KERNELS, Kernels
from kvserve.kv.cache import LayerKVCache


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 with a float32 weight, cast back to the input dtype at the end."""

    def __init__(self, dim: int, eps: float, kernels: Kernels = TORCH_KERNELS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float32, [head_dim/2]) for plain, linear or llama3-scaled rope."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """NEOX/HF-style rope (rotate halves); cos/sin are computed per step from the positions."""

    inv_freq: torch.Tensor  # [head_dim / 2] float32, a buffer

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> (cos, signed sin), each [T, 1, head_dim] in the compute dtype, laid out for
        `apply_rope`: cos repeated over both halves, sin negated on the first half. Computed once per step."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1).to(dtype)[:, None, :], torch.cat((-sin, sin), -1).to(dtype)[:, None, :]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one projection and act * up in one kernel."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in GATED_ACTIVATIONS:
            raise NotImplementedError(f"activation {act!r} is not supported ({', '.join(GATED_ACTIVATIONS)})")
        self.act = act
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.kernels: Kernels = TORCH_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.gated_act(self.gate_up_proj(x), self.act).to(x.dtype))


class PagedAttention(nn.Module):
    """Projections, optional per-head q/k norms, rope, KV-cache write, then the attention backend."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        out_bias: bool,
        qk_norm_eps: float | None,
        scale: float,
        sliding_window: int | None,
        backend: AttentionBackend,
        output_gate: bool = False,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.spec = AttentionLayerSpec(scale, sliding_window)
        self.backend = backend
        # Qwen3.5: q_proj gives each head its query and a gate (interleaved per head); the output is multiplied by the
        # gate's sigmoid. Rope may turn only the first rotary_dim dims of each head (partial rope).
        self.output_gate = output_gate
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        q_heads = 2 * num_heads if output_gate else num_heads
        self.qkv_proj = nn.Linear(hidden, (q_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=out_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.kernels: Kernels = TORCH_KERNELS

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads, q_size, dim = self.num_heads, self.num_kv_heads, self.num_heads * self.head_dim, self.head_dim
        qkv = self.qkv_proj(x)
        gate = None
        if self.output_gate:
            q_and_gate = qkv[:, : 2 * q_size].view(t, heads, 2, dim)
            gate = q_and_gate[:, :, 1].reshape(t, q_size)
            k_rows = qkv[:, 2 * q_size : 2 * q_size + kv_heads * dim].view(t, kv_heads, dim)
            qk = torch.cat((q_and_gate[:, :, 0], k_rows), dim=1)
            v = qkv[:, 2 * q_size + kv_heads * dim :].view(t, kv_heads, dim)
        else:
            # Q and K side by side as [T, heads + kv_heads, head_dim]: one norm and one rope call for both.
            qk = qkv[:, : q_size + kv_heads * dim].view(t, heads + kv_heads, dim)
            v = qkv[:, q_size + kv_heads * dim :].view(t, kv_heads, dim)
        qn, kn = self.q_norm, self.k_norm
        if self.rotary_dim == dim:
            # Per-head norms (if any) and rope in one kernel call: rotates the pair (i, i + head_dim / 2).
            qk = self.kernels.qk_norm_rope(
                qk, heads, qn.weight if qn else None, kn.weight if kn else None, qn.eps if qn else 0.0, cos, sin
            )
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k = qk[:, :heads], qk[:, heads:]
            if qn is not None and kn is not None:
                q, k = qn(q), kn(k)
            q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
        kv_cache.write(k, v, meta.slot_mapping)
        out = self.backend(q, kv_cache, meta, self.spec, self.kernels).reshape(t, q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rope on the first cos.shape[-1] dims of each head of x ([T, heads, head_dim]; cos and signed_sin as
    RotaryEmbedding.cos_sin lays them out), rotating the pairs (i, i + rotary_dim / 2); the other dims pass."""
    r = cos.shape[-1]
    rot = x[..., :r]
    swapped = torch.cat((rot[..., r // 2 :], rot[..., : r // 2]), dim=-1)
    return torch.cat((rot * cos + swapped * signed_sin, x[..., r:]), dim=-1)
