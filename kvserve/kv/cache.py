"""The KV cache tensors: one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim] for each of the
layout's `tensors_per_block` layer slots (every layer of a model of one KV cache group; with several groups, layer j of
every group shares slot j, kv/groups.py), plus, for 8-bit dtypes (kv/quant.py), one float32 scale per token and KV
head in the same paged layout ([num_blocks, block_size, kv_heads]), so that block ids index data and scales alike and
prefix sharing, preemption and freeing need to know nothing about quantization."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kvserve.capacity import KVShape
from kvserve.dtypes import dtype_name, torch_dtype
from kvserve.kv.groups import KVCacheLayout, make_kv_cache_layout
from kvserve.kv.huge_pages import empty_huge
from kvserve.kv.quant import load, quant_format, store
from kvserve.units import GiB, MiB
from kvserve.vocab import KV_DTYPES, check_choice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The shape facts that fix the bytes one token (and one block) costs, and the layout of the layers' caches in
    KV cache groups (kv/groups.py; None: one group of every layer, each keeping every token)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the storage dtype; an 8-bit one means a quantized cache with scales
    layout: KVCacheLayout | None = None

    @property
    def groups(self) -> KVCacheLayout:
        """The layout in force (the uniform one when none was given)."""
        return self.layout or make_kv_cache_layout([None] * self.num_layers)

    @property
    def is_quantized(self) -> bool:
        return quant_format(self.dtype) is not None

    @property
    def dtype_name(self) -> str:
        """The --kv-cache-dtype name of the storage (fp8_e4m3, int8, float32, ...), for logs and metrics."""
        return dtype_name(self.dtype)

    def _shape(self) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, self.num_kv_heads, (None,) * self.num_layers)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, every KV head: head_dim elements plus, if 8-bit, one float32 scale;
        computed by kvserve.capacity, so that `kvserve estimate` and the engine cannot disagree. With sliding groups
        a cached token costs this only while every layer still holds it (bytes_per_block is what the pool pays)."""
        return self._shape().bytes_per_token(KV_DTYPES[self.dtype_name])

    @property
    def bytes_per_block(self) -> int:
        """One block id's bytes: block_size tokens of each of the layout's per-layer cache tensors."""
        return self._shape().bytes_per_block(self.groups, KV_DTYPES[self.dtype_name], self.block_size)


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


def allocate_kv_cache(spec: KVCacheConfig, num_blocks: int, device: torch.device) -> list[LayerKVCache]:
    """Caches for every layer (scales of 1 beside 8-bit data); logs the dtype and the block count. The layout's
    `tensors_per_block` tensors are allocated once and shared: layer l reads and writes tensor layer_tensor[l], at the
    block ids of its group's tables (kv/groups.py). Each layer gets its own LayerKVCache over them (its static scales
    are its own).

    The data is not zero-filled: attention never reads a slot before it is written (decode padding re-reads
    the sequence's last token), and filling 1 GiB costs 0.3 s of every start. Pages are touched on first use,
    except under a KV offload tier, which touches them at start (touch_pages). Host tensors are on huge pages where
    the OS allows (kv/huge_pages.py): decode attention reads blocks in any order."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    layout = spec.groups

    def scales() -> torch.Tensor | None:
        return torch.ones(shape[:3], dtype=torch.float32, device=device) if spec.is_quantized else None

    tensors = [
        (
            empty_huge(shape, spec.dtype, device),
            empty_huge(shape, spec.dtype, device),
            scales(),
            scales(),
        )
        for _ in range(layout.tensors_per_block)
    ]
    caches = [LayerKVCache(*tensors[layout.layer_tensor[layer]]) for layer in range(spec.num_layers)]
    logger.info(
        "KV cache dtype %s: %d blocks x %d tokens x %d layers, %d bytes a block (%s)",
        spec.dtype_name,
        num_blocks,
        spec.block_size,
        layout.tensors_per_block,
        spec.bytes_per_block,
        "8-bit with a float32 scale per token and KV head" if spec.is_quantized else "unquantized",
    )
    return caches


def unique_tensors(caches: Sequence[LayerKVCache]) -> list[LayerKVCache]:
    """The caches over distinct tensors, in layer order: with KV cache groups several layers share one tensor, and
    whatever walks the memory (the offload tier's block payload, page touching) must see each tensor once."""
    seen: set[int] = set()
    out = []
    for cache in caches:
        if cache.key.data_ptr() not in seen:
            seen.add(cache.key.data_ptr())
            out.append(cache)
    return out


# touch_pages zeroes a chunk at a time, so that its progress bar moves (a tier's slab is one tensor of GiBs).
_TOUCH_CHUNK_BYTES = 64 * MiB
# Below this, touching takes about a second at most (0.2-1.6 s a GiB measured, docs/KV_OFFLOAD.md): no bar.
_TOUCH_PROGRESS_MIN_BYTES = GiB


def touch_pages(tensors: Sequence[torch.Tensor]) -> int:
    """Zero the host-memory tensors among `tensors`, so that the OS maps their pages now instead of on first use;
    returns the bytes touched. Why: a page's first touch is a fault, and on these VMs a fresh page costs as much as
    the copy into it several times over (docs/KV_OFFLOAD.md, "Memory touched at start"), so a tier pays it once at
    start, not in a request's time to first token. Device tensors are left as they are. A progress bar in bytes shows
    it from a GiB up: on a busy host 4.25 GiB took 29 s, silent until the log line after it."""
    host = [t for t in tensors if t.device.type == "cpu"]
    total = sum(t.numel() * t.element_size() for t in host)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="mapping KV cache and tier memory",
        disable=total < _TOUCH_PROGRESS_MIN_BYTES,
    ) as bar:
        for t in host:
            for chunk in _touch_chunks(t):
                chunk.zero_()
                bar.update(chunk.numel() * chunk.element_size())
    return total


def _touch_chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` as views of about _TOUCH_CHUNK_BYTES each (flat slices); a non-contiguous tensor whole."""
    if not t.is_contiguous():
        return [t]
    flat = t.view(-1)
    step = max(1, _TOUCH_CHUNK_BYTES // t.element_size())
    return [flat[i : i + step] for i in range(0, flat.numel(), step)]


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
