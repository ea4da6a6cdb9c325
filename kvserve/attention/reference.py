"""Plain per-sequence paged attention in torch: slow, obviously correct, the truth that tests compare against.

It keeps the contract of kvserve/attention/backend.py like every backend.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.ops import TORCH_KERNELS, Kernels
from kvserve.kv.cache import LayerKVCache


def context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0 .. seq_len-1 of one sequence."""
    positions = torch.arange(seq_len, device=block_table.device)
    return block_table[positions // block_size] * block_size + positions % block_size


def reference_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    layer: AttentionLayerSpec,
    kernels: Kernels = TORCH_KERNELS,
) -> torch.Tensor:
    """Per sequence: gather (and dequantize) the context, repeat KV heads, masked softmax in float32. With a sliding
    window the context starts at the first key any of the chunk's queries sees: the blocks before it may already be
    given back (their table entries are the null block, kv/groups.py), so they are never read."""
    group = q.shape[1] // cache.num_kv_heads
    out = torch.empty_like(q)
    start = 0
    window = layer.sliding_window
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        slots = context_slots(meta.block_tables[i], seq_len, cache.block_size)[first:]
        k, v = cache.read(slots, torch.float32)
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[start : start + q_len].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", qi, k) * layer.scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start : start + q_len] = torch.einsum("hls,shd->lhd", scores.softmax(dim=-1), v).to(q.dtype)
        start += q_len
    return out
