"""Plain per-sequence paged attention in torch: slow, obviously correct, the truth that tests compare against.

Shared contract of every attention backend (see `AttentionBackend`): the layer has already written the new
tokens' K/V into the caches (`write_kv`); the backend attends the T query rows of the flat batch over each
sequence's whole context, read through its block table. An 8-bit cache comes with its per-token-head scales
(k_scales, v_scales); backends read through `LayerKVCache.read`, which dequantizes only the rows read.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.ops import TORCH_KERNELS, Kernels
from kvserve.kv.cache import LayerKVCache


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], rope already applied
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scales: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32, 8-bit caches only
        v_scales: torch.Tensor | None = None,
        kernels: Kernels = TORCH_KERNELS,  # compiled kernels a backend may use (the reference uses none)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots (block_id * block_size + offset),
    quantized with fresh per-token-head scales when the cache is 8-bit."""
    LayerKVCache(k_cache, v_cache, k_scales, v_scales).write(k, v, slot_mapping)


def context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0 .. seq_len-1 of one sequence."""
    positions = torch.arange(seq_len, device=block_table.device)
    return block_table[positions // block_size] * block_size + positions % block_size


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kernels: Kernels = TORCH_KERNELS,
) -> torch.Tensor:
    """Per sequence: gather (and dequantize) the context, repeat KV heads, masked softmax in float32."""
    cache = LayerKVCache(k_cache, v_cache, k_scales, v_scales)
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        k, v = cache.read(context_slots(meta.block_tables[i], seq_len, cache.block_size), torch.float32)
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[start : start + q_len].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", qi, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start : start + q_len] = torch.einsum("hls,shd->lhd", scores.softmax(dim=-1), v).to(q.dtype)
        start += q_len
    return out
