"""LFM2's short convolution: a gated, depthwise, causal convolution of a few taps over the sequence, whose state is
the last `kernel - 1` inputs of each sequence (kv/state.py, kv/state_cache.py).

    B, C, x = in_proj(h).chunk(3)        (each [T, hidden])
    y = C * conv(B * x)                  (depthwise over time, taps w[c, 0..k-1], the newest input last)
    out = out_proj(y)

The gated convolution is one kernel call (Kernels.causal_conv: the torch reference, or kernels/recurrent.cpp)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.ops import TORCH_KERNELS, Kernels
from kvserve.kv.state_cache import LayerStateCache, StateMetadata


class ShortConv(nn.Module):
    """The token mixer of an LFM2 conv layer (HF's Lfm2ShortConv; the conv weight stored as [channels, kernel])."""

    def __init__(self, hidden: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.hidden = hidden
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(hidden, kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.empty(hidden), requires_grad=False) if bias else None
        self.kernels: Kernels = TORCH_KERNELS

    def forward(self, h: torch.Tensor, cache: LayerStateCache, meta: StateMetadata) -> torch.Tensor:
        bcx = self.in_proj(h)
        b, c, x = bcx[:, : self.hidden], bcx[:, self.hidden : 2 * self.hidden], bcx[:, 2 * self.hidden :]
        y = self.kernels.causal_conv(
            x,
            self.conv_weight,
            self.conv_bias,
            cache.conv,
            meta.slots,
            meta.query_start_loc_cpu,
            meta.continues_cpu,
            pre=b,
            gate=c,
        )
        return self.out_proj(y.to(h.dtype))
