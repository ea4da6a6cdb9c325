"""The contract every attention backend keeps, and what it is told about the layer it serves.

A backend is called once per layer per step as `backend(q, cache, meta, layer, kernels)`: the layer has
already written the new tokens' K/V into `cache` (LayerKVCache.write, quantizing if the cache is 8-bit); the
backend attends the T query rows of the flat batch over each sequence's whole context, read through its block
table (`meta`), with `layer`'s scale and sliding window. It reads K/V through `cache.read`, which dequantizes
only the rows read, or hands `cache`'s tensors to a kernel. The cache travels as the one object the engine
allocated, never as its unpacked tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.ops import TORCH_KERNELS, Kernels
from kvserve.kv.cache import LayerKVCache


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    """What a backend needs to know about one attention layer; fixed when the model is built."""

    scale: float  # multiplies q . k before the softmax
    sliding_window: int | None = None  # a query sees only the last `sliding_window` positions; None: all


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], rope already applied
        cache: LayerKVCache,  # this layer's paged K/V (+ scales if 8-bit), the new tokens already written
        meta: AttentionMetadata,
        layer: AttentionLayerSpec,
        kernels: Kernels = TORCH_KERNELS,  # compiled kernels a backend may use (the reference uses none)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
