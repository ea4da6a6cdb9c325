"""`--activation-quantization int8`: activations quantized to 8 bits per run of 32 values before a GGUF matmul, as
llama.cpp's Q8_0 activation blocks are, so that the matmul multiplies integers (kernels/gguf_int8_matmul.cpp).

This is the torch definition of that quantization, which the native kernel is tested against: per run of 32
values along the input axis, d = max|x| / 127 and q = round(x * (1 / d)) rounded half to even (0 where the run is
all zeros), in float32 as the kernel computes it. The matmul with int8 activations then equals the float32 matmul
of the dequantized weights with d q, up to summation order."""

from __future__ import annotations

import torch

RUN = 32  # values per activation scale: one Q4_0 / Q5_0 / Q8_0 block, one K-quant sub-block


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (q int8 [M, K], d float32 [M, K / 32])."""
    x = x.float()
    m, k = x.shape
    if k % RUN:
        raise ValueError(f"int8 activations are quantized in runs of {RUN}; a row of {k} is not whole runs")
    runs = x.reshape(m, k // RUN, RUN)
    d = runs.abs().amax(dim=-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(runs * inverse.unsqueeze(-1)).to(torch.int8)
    return q.reshape(m, k), d


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> d q as float32 [M, K]: what the integer kernel multiplies the weights with."""
    q, d = quantize_activations(x)
    m, k = q.shape
    return (q.reshape(m, k // RUN, RUN).float() * d.unsqueeze(-1)).reshape(m, k)
