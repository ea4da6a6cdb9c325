"""The KV cache tensors: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim],
plus, for 8-bit dtypes (kv/quant.py), one float32 scale per token and KV head in the same paged layout
([num_blocks, block_size, kv_heads]), so that block ids index data and scales alike and prefix sharing,
preemption and freeing need to know nothing about quantization."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.capacity import KVShape
from kvserve.dtypes import dtype_name, torch_dtype
from kvserve.kv.quant import load, quant_format, store
from kvserve.vocab import KV_DTYPES, check_choice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape facts that fix the bytes one token (and one block) costs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the storage dtype; an 8-bit one means a quantized cache with scales

    @property
    def is_quantized(self) -> bool:
        return quant_format(self.dtype) is not None

    @property
    def dtype_name(self) -> str:
        """The --kv-cache-dtype name of the storage (fp8_e4m3, int8, float32, ...), for logs and metrics."""
        return dtype_name(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: head_dim elements plus, if 8-bit, one float32 scale; computed
        by kvserve.capacity, so that `kvserve estimate` and the engine cannot disagree."""
        shape = KVShape(self.num_layers, self.num_kv_heads, self.head_dim, self.num_kv_heads, (None,) * self.num_layers)
        return shape.bytes_per_token(KV_DTYPES[self.dtype_name])

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass(slots=True)
class LayerKVCache:
    """One layer's paged K and V; key_scale/value_scale are set exactly when the storage dtype is 8-bit."""

    key: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value: torch.Tensor
    key_scale: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads] float32
    value_scale: torch.Tensor | None = None
    # A checkpoint's per-tensor scales: every written token takes them instead of its own (computed) scale.
    static_key_scale: float | None = None
    static_value_scale: float | None = None

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[2]

    @property
    def is_quantized(self) -> bool:
        """8-bit storage: reads dequantize through the scales, so kernels over plain tensors cannot take it."""
        return self.key_scale is not None

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kv_heads, head_dim]) at `slots`, quantizing if 8-bit."""
        store(self.key, self.key_scale, k, slots, self.static_key_scale)
        store(self.value, self.value_scale, v, slots, self.static_value_scale)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any index shape) as [*slots.shape, kv_heads, head_dim] in `dtype`; only
        these rows are dequantized."""
        return load(self.key, self.key_scale, slots, dtype), load(self.value, self.value_scale, slots, dtype)


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """`auto` follows the model's compute dtype; fp8 means fp8_e4m3."""
    if check_choice("--kv-cache-dtype", kv_cache_dtype, ("auto", *KV_DTYPES)) == "auto":
        return compute_dtype
    return torch_dtype(kv_cache_dtype)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[LayerKVCache]:
    """Caches for every layer (scales of 1 beside 8-bit data); logs the dtype and the block count.

    The data is not zero-filled: attention never reads a slot before it is written (decode padding re-reads
    the sequence's last token), and filling 1 GiB costs 0.3 s of every start. Pages are touched on first use,
    except under a KV offload tier, which touches them at start (touch_pages)."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def scales() -> torch.Tensor | None:
        return torch.ones(shape[:3], dtype=torch.float32, device=device) if spec.is_quantized else None

    caches = [
        LayerKVCache(
            torch.empty(shape, dtype=spec.dtype, device=device),
            torch.empty(shape, dtype=spec.dtype, device=device),
            scales(),
            scales(),
        )
        for _ in range(spec.num_layers)
    ]
    logger.info(
        "KV cache dtype %s: %d blocks x %d tokens, %d bytes/token (%s)",
        spec.dtype_name,
        num_blocks,
        spec.block_size,
        spec.bytes_per_token,
        "8-bit with a float32 scale per token and KV head" if spec.is_quantized else "unquantized",
    )
    return caches


def touch_pages(tensors: Sequence[torch.Tensor]) -> int:
    """Zero the host-memory tensors among `tensors`, so that the OS maps their pages now instead of on first use;
    returns the bytes touched. Why: a page's first touch is a fault, and on these VMs a fresh page costs as much as
    the copy into it several times over (docs/KV_OFFLOAD.md, "Memory touched at start"), so a tier pays it once at
    start, not in a request's time to first token. Device tensors are left as they are."""
    touched = 0
    for t in tensors:
        if t.device.type == "cpu":
            t.zero_()
            touched += t.numel() * t.element_size()
    return touched


def use_static_kv_scales(caches: list[LayerKVCache], scales: list[tuple[float, float]] | None, dtype_name: str) -> None:
    """A checkpoint's calibrated per-tensor KV scales are for fp8_e4m3 (how vLLM and llm-compressor make them): with
    that KV dtype every layer quantizes with them, otherwise they are ignored (logged)."""
    if scales is None:
        return
    if dtype_name != "fp8_e4m3":
        logger.info("the checkpoint's static fp8 KV scales are unused with --kv-cache-dtype %s", dtype_name)
        return
    for cache, (k_scale, v_scale) in zip(caches, scales):
        cache.static_key_scale, cache.static_value_scale = k_scale, v_scale
    logger.info("fp8 KV cache uses the checkpoint's per-tensor scales for all %d layers", len(scales))
