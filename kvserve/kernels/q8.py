"""The q8_0 weight format: int8 weights with one float32 scale per 32 values along the input axis (llama.cpp's
Q8_0 blocks, with the scales in their own array). Quantize and dequantize here; the matmul on this format is
`Kernels.q8_matmul` (kvserve/kernels/ops.py)."""

from __future__ import annotations

import torch

GROUP_SIZE = 32


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], float32 scales [N, K/32]); symmetric, round to nearest.

    A block that came from a GGUF Q8_0 tensor round-trips exactly (same blocks, same amax / 127 scale)."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"q8_0 needs the input size to be a multiple of {GROUP_SIZE}, got {k}")
    groups = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = groups.abs().amax(dim=-1) / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(groups * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scales.contiguous()


def dequantize_q8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight that (q, scales) stands for; rows may be any subset (an embedding lookup)."""
    *lead, k = q.shape
    return (q.float().reshape(*lead, k // GROUP_SIZE, GROUP_SIZE) * scales[..., None]).reshape(*lead, k)
