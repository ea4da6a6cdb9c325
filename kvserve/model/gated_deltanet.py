"""Qwen3.5's Gated DeltaNet layer (HF's Qwen3_5GatedDeltaNet): linear attention whose state is a matrix per value
head, carried from token to token (kv/state.py), after a short causal convolution over its q, k and v.

    qkv, z = in_proj_qkvz(h);  b, a = in_proj_ba(h)  (HF's in_proj_qkv and _z, _b and _a, fused in pairs)
    q, k, v = silu(conv(qkv))                         (depthwise, conv_kernel taps; its state: the last taps - 1 rows)
    beta = sigmoid(b);  g = -exp(A_log) softplus(a + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta)            (Kernels.gated_delta_rule: S = e^g S + k (beta (v - S^T k))^T)
    out = out_proj(rms_norm(o) * silu(z))             (per value head; the norm multiplies by its weight)

Both recurrent parts are one kernel call each (Kernels.causal_conv, Kernels.gated_delta_rule: the torch reference,
or kernels/recurrent.cpp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.ops import TORCH_KERNELS, Kernels
from kvserve.kv.state_cache import LayerStateCache, StateMetadata
from kvserve.model.layers import RMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(
        self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int, eps: float
    ) -> None:
        super().__init__()
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        self.value_size = value_heads * value_dim
        self.in_proj_qkvz = nn.Linear(hidden, self.conv_dim + self.value_size, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(value_heads), requires_grad=False)
        self.norm = RMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)
        self.kernels: Kernels = TORCH_KERNELS

    @property
    def fused_parts(self) -> dict[str, tuple[str, int, int]]:
        """HF's four input projections -> (fused projection, first row, rows) (load_weights)."""
        c, v, n = self.conv_dim, self.value_size, self.value_heads
        return {
            "in_proj_qkv": ("in_proj_qkvz", 0, c),
            "in_proj_z": ("in_proj_qkvz", c, v),
            "in_proj_b": ("in_proj_ba", 0, n),
            "in_proj_a": ("in_proj_ba", n, n),
        }

    def forward(self, h: torch.Tensor, cache: LayerStateCache, meta: StateMetadata) -> torch.Tensor:
        t = h.shape[0]
        proj, ba = self.in_proj_qkvz(h), self.in_proj_ba(h)
        c, v, n = self.conv_dim, self.value_size, self.value_heads
        slots, starts, continues = meta.slots, meta.query_start_loc_cpu, meta.continues_cpu
        qkv = self.kernels.causal_conv(
            proj[:, :c], self.conv_weight, None, cache.conv, slots, starts, continues, silu=True
        )
        kd = self.key_heads * self.key_dim
        q = qkv[:, :kd].view(t, self.key_heads, self.key_dim)
        k = qkv[:, kd : 2 * kd].view(t, self.key_heads, self.key_dim)
        values = qkv[:, 2 * kd :].view(t, n, self.value_dim)
        z = proj[:, c : c + v].reshape(t, n, self.value_dim)
        beta = ba[:, :n].float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(ba[:, n:].float() + self.dt_bias.float())
        if cache.recurrent is None:
            raise ValueError("a Gated DeltaNet layer needs a recurrent state")
        o = self.kernels.gated_delta_rule(q, k, values, g, beta, cache.recurrent, slots, starts, continues)
        o = self.norm(o.to(h.dtype)) * F.silu(z.float()).to(h.dtype)
        return self.out_proj(o.reshape(t, v))
