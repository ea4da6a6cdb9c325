"""The fast CPU path: torch scaled_dot_product_attention over K/V gathered from the paged cache.

- Decode rows (query_len 1) of all sequences go through one batched SDPA call: each sequence's context
  (only the part inside the sliding window, if any) is gathered into a padded [B, kv_heads, S, D] tensor
  with a padding mask. The query heads sharing a KV head are folded into the query-length
  axis ([B, kv_heads, group, D]), so GQA/MQA never copies K/V per query head and each step is a small
  matmul instead of `group` matrix-vector products.
- With the native kernels and float32 queries, decode rows skip the gather: kernels.paged_decode_attention
  reads K/V through the block tables in place (kvserve/kernels/paged_attention.cpp), in the cache's own element
  type (float32, bfloat16, float16, and the 8-bit ones with their scales: kernels/kv_dtypes.h); so do prefill
  chunks, through kernels.paged_prefill_attention (a flash-attention kernel, kvserve/kernels/prefill_attention.cpp).
- Otherwise an 8-bit cache is dequantized in the gather (LayerKVCache.read): only the context rows of this step's
  sequences are ever converted, never the whole cache.
- Otherwise prefill chunks run one SDPA call per sequence (enable_gqa), with `is_causal` when the chunk is the
  whole context and no window applies, else an explicit mask (later chunks, sliding windows).
- The index tensors a step needs (slots, masks) depend only on its metadata and the layer's window, so they
  are built by the first layer and reused by the rest (AttentionMetadata.memo).
Checked against attention/reference.py in tests/unit/test_attention.py.
"""

from __future__ import annotations

from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import context_slots
from kvserve.kernels.ops import TORCH_KERNELS, Kernels
from kvserve.kv.cache import LayerKVCache


def cpu_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    layer: AttentionLayerSpec,
    kernels: Kernels = TORCH_KERNELS,
) -> torch.Tensor:
    """The AttentionBackend "cpu" (kvserve/attention/backend.py); the paths are in the module's docstring."""
    window, scale = layer.sliding_window, layer.scale
    k_cache, v_cache, k_scales, v_scales = cache.key, cache.value, cache.key_scale, cache.value_scale
    paged = kernels.has_paged_attention(k_cache) and q.dtype == torch.float32
    if meta.is_decode_only:
        if paged:
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, window, scale, k_scales, v_scales
            )
        slots, mask = meta.memo(
            ("decode", window),
            lambda: _decode_gather(meta.block_tables, meta.seq_lens, meta.seq_lens_cpu, meta.block_size, window),
        )
        return _decode_batch(q, cache, slots, mask, scale)
    out = torch.empty_like(q)
    decode_idx = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
    starts = [0, *accumulate(meta.query_lens_cpu)]
    if decode_idx:
        idx = meta.memo(("decode-idx",), lambda: torch.tensor(decode_idx, dtype=torch.int64, device=q.device))
        rows = meta.memo(("decode-rows",), lambda: meta.query_start_loc[idx])
        if paged:
            tables, lens = meta.memo(("decode-tables",), lambda: (meta.block_tables[idx], meta.seq_lens[idx]))
            out[rows] = kernels.paged_decode_attention(
                q[rows], k_cache, v_cache, tables, lens, window, scale, k_scales, v_scales
            )
        else:
            slots, mask = meta.memo(
                ("decode-subset", window),
                lambda: _decode_gather(
                    meta.block_tables[idx],
                    meta.seq_lens[idx],
                    [meta.seq_lens_cpu[i] for i in decode_idx],
                    meta.block_size,
                    window,
                ),
            )
            out[rows] = _decode_batch(q[rows], cache, slots, mask, scale)
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        if q_len == 1:
            continue
        s, e = starts[i], starts[i + 1]
        if paged:
            kernels.paged_prefill_attention(
                q[s:e],
                k_cache,
                v_cache,
                meta.block_tables[i],
                seq_len,
                window,
                scale,
                out=out[s:e],
                k_scales=k_scales,
                v_scales=v_scales,
            )
            continue
        slots, mask = meta.memo(
            ("prefill", i, window),
            partial(_prefill_gather, meta.block_tables[i], seq_len, q_len, meta.block_size, window),
        )
        out[s:e] = _prefill_one(q[s:e], cache, slots, mask, scale)
    return out


def _prefill_gather(
    block_table: torch.Tensor, seq_len: int, q_len: int, block_size: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Context slots a prefill chunk reads, and its mask (None: plain causal over the whole context)."""
    first = max(0, seq_len - q_len - window + 1) if window is not None else 0  # earliest key any query sees
    slots = context_slots(block_table, seq_len, block_size)[first:]
    if first == 0 and q_len == seq_len and (window is None or window >= seq_len):
        return slots, None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=slots.device)[:, None]
    k_pos = torch.arange(first, seq_len, device=slots.device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return slots, mask


def _prefill_one(
    q: torch.Tensor,  # [L, H, D]
    cache: LayerKVCache,
    slots: torch.Tensor,  # [S']
    mask: torch.Tensor | None,  # [L, S'], None: causal
    scale: float,
) -> torch.Tensor:
    k, v = cache.read(slots, q.dtype)  # [S', Hkv, D]
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S', D]
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    if mask is None:
        o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _decode_gather(
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    seq_lens_cpu: list[int],
    block_size: int,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [B, W] of each sequence's (windowed) context, padded, and the padding mask [B, 1, 1, W]."""
    lo = (seq_lens - window).clamp(min=0) if window is not None else torch.zeros_like(seq_lens)
    # Padded width from host-side lengths (no device sync).
    width = max(min(n, window) if window is not None else n for n in seq_lens_cpu)
    k_pos = lo[:, None] + torch.arange(width, device=seq_lens.device)[None, :]  # [B, W]
    mask = k_pos < seq_lens[:, None]
    # Padding columns re-read the sequence's last (just written) token, so never-written or stale slots,
    # whatever they hold (even NaN), cannot leak into the result; the mask removes them.
    k_pos = torch.minimum(k_pos, seq_lens[:, None] - 1)
    slots = block_tables.gather(1, k_pos // block_size) * block_size + k_pos % block_size
    return slots, mask[:, None, None, :]


def _decode_batch(
    q: torch.Tensor,  # [B, H, D], one query per sequence at position seq_len - 1
    cache: LayerKVCache,
    slots: torch.Tensor,  # [B, W]
    mask: torch.Tensor,  # [B, 1, 1, W]
    scale: float,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = cache.num_kv_heads
    k, v = cache.read(slots, q.dtype)  # [B, W, Hkv, D]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, W, D]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(batch, num_heads, head_dim)
