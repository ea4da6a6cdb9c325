"""Plain per-sequence paged attention in torch: slow, obviously correct, the truth that tests compare against.

Shared contract of every attention backend (see `AttentionBackend`): the layer has already written the new
tokens' K/V into the caches (`write_kv`); the backend attends the T query rows of the flat batch over each
sequence's whole context, read through its block table.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], rope already applied
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots (block_id * block_size + offset)."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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
) -> torch.Tensor:
    """Per sequence: gather the context, repeat KV heads, masked softmax in float32."""
    num_heads = q.shape[1]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        slots = context_slots(meta.block_tables[i], seq_len, block_size)
        k = k_flat[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, H, D]
        v = v_flat[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
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
