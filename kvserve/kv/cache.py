"""The KV cache tensors: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape facts that fix the bytes one token (and one block) costs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """`auto` follows the model's compute dtype."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    if kv_cache_dtype not in _DTYPES:
        raise ValueError(f"unsupported --kv-cache-dtype {kv_cache_dtype!r}; choose from auto, {', '.join(_DTYPES)}")
    return _DTYPES[kv_cache_dtype]


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]
