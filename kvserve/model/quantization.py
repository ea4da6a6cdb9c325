"""Weight quantization after loading (`--quantization`, vLLM's flag): fewer bytes per weight, because on a
CPU a decode step's time is the bytes of weights it reads.

- "none": the checkpoint's weights in the compute dtype (float32 on CPU): the reference.
- "q8_0": every linear layer (and the embedding, which Gemma's tied LM head shares) as int8 with one float32
  scale per 32 inputs, llama.cpp's Q8_0 layout. 3.6x fewer bytes than float32; activations stay float32.
  A GGUF's own Q8_0 tensors round-trip exactly; its 4- and 6-bit tensors are represented to within half a
  step of 1/127 of each block's largest value.
Layers whose input size is not a multiple of 32 stay unquantized.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.capacity import QUANTIZATION_METHODS
from kvserve.kernels.ops import Kernels
from kvserve.kernels.q8 import GROUP_SIZE, dequantize_q8, quantize_q8

if TYPE_CHECKING:
    from kvserve.model.protocol import Model

log = logging.getLogger(__name__)


class Q8Linear(nn.Module):
    """A linear layer whose weight is q8_0; computes in float32 and returns the input's dtype."""

    qweight: torch.Tensor  # [out_features, in_features] int8, a buffer
    scales: torch.Tensor  # [out_features, in_features / 32] float32, a buffer

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, kernels: Kernels) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.kernels = kernels

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels: Kernels, quantize: bool = True) -> Q8Linear:
        """`quantize=False`: uninitialized buffers of the right shapes, to be filled from a quantized cache."""
        q, scales = quantize_q8(linear.weight) if quantize else _empty_q8(linear.weight)
        return cls(q, scales, linear.bias, kernels)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: an [N, out_features] float32 buffer to write into (N = x's rows; x then float32)."""
        lead = x.shape[:-1]
        y = self.kernels.q8_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales, out)
        if self.bias is not None:
            y = y.add_(self.bias) if out is not None else y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0, kernels={self.kernels.name}"


class TiedEmbedding(nn.Embedding):
    """An embedding that can also serve as the output projection (tied LM head)."""

    def reset_parameters(self) -> None:
        """No random init: the loader fills the weight. (nn.Embedding's normal_ on the meta device imports
        torch._dynamo: 1.7 s of every start.)"""

    def attend(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.matmul(hidden.to(self.weight.dtype), self.weight.T, out=out)


class Q8Embedding(nn.Module):
    """A q8_0 embedding: lookups widen only the rows asked for; `attend` is the tied LM head's matmul."""

    qweight: torch.Tensor  # [num_embeddings, embedding_dim] int8, a buffer
    scales: torch.Tensor  # [num_embeddings, embedding_dim / 32] float32, a buffer

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, kernels: Kernels) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.dtype = dtype
        self.kernels = kernels

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, kernels: Kernels, quantize: bool = True) -> Q8Embedding:
        q, scales = quantize_q8(embedding.weight) if quantize else _empty_q8(embedding.weight)
        return cls(q, scales, embedding.weight.dtype, kernels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_q8(self.qweight[ids], self.scales[ids]).to(self.dtype)

    def attend(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.q8_matmul(hidden.reshape(-1, self.embedding_dim), self.qweight, self.scales, out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q8_0, kernels={self.kernels.name}"


def _empty_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    return (
        torch.empty(n, k, dtype=torch.int8, device=weight.device),
        torch.empty(n, k // GROUP_SIZE, dtype=torch.float32, device=weight.device),
    )


def quantize_model(model: nn.Module, method: str, kernels: Kernels, quantize: bool = True) -> int:
    """Replace the model's linear layers and embeddings in place; returns how many were replaced.

    The float weights are dropped as each layer is replaced, so peak memory is the float model plus one layer.
    `quantize=False` only gives the model the quantized layout (uninitialized), for loading a saved state."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    if method == "none":
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % GROUP_SIZE == 0:
                setattr(parent, name, Q8Linear.from_linear(child, kernels, quantize))
            elif isinstance(child, nn.Embedding) and child.embedding_dim % GROUP_SIZE == 0:
                setattr(parent, name, Q8Embedding.from_embedding(child, kernels, quantize))
            else:
                continue
            count += 1
    log.info("%s %d layers to q8_0 (%s kernels)", "quantized" if quantize else "laid out", count, kernels.name)
    return count


def weight_bytes(model: Model) -> int:
    """Bytes of every parameter and buffer: what the model holds in memory, quantized or not."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
