"""The attention backend "triton": paged attention in Triton kernels, for CUDA (attention/triton_kernels.py).

- A decode-only step (every sequence has one query row, the step CUDA graphs capture) runs the split-K
  decode kernel: no host value is read from a device tensor, so the call is capturable.
- Any other step (prefill, chunked prefill, decode rows mixed with prefill chunks) is one launch of the
  flash-attention prefill kernel over the ragged batch; its tile map is built from the host-side query
  lengths once per step and shared by every layer (AttentionMetadata.memo).
- 8-bit caches are handed to the kernels with their scales and dequantized there, row by row as read.
Triton is imported at the first call, not with this module, so registering the backend costs CPU installs
nothing. Checked against attention/reference.py in Triton's interpreter (tests/attention/).
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.ops import TORCH_KERNELS, Kernels
from kvserve.kv.cache import LayerKVCache


def triton_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    layer: AttentionLayerSpec,
    kernels: Kernels = TORCH_KERNELS,  # the CPU kernels: unused here
) -> torch.Tensor:
    """The AttentionBackend "triton" (kvserve/attention/backend.py); the paths are in the module's docstring."""
    try:
        from kvserve.attention import triton_kernels as tk  # lazy: only users of this backend import triton
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise RuntimeError(
            "--attention-backend triton needs the triton package: pip install -e '.[cuda]' "
            "(torch's CUDA wheels for Linux bring it)"
        ) from e
    kv = tk.PagedKV(cache.key, cache.value, cache.key_scale, cache.value_scale, meta.block_tables, meta.seq_lens)
    if meta.is_decode_only:
        return tk.paged_decode(q, kv, layer.scale, layer.sliding_window)
    tiling = tk.PrefillTiling.for_shape(q.shape[1], cache.num_kv_heads, q.shape[2])
    tiles = meta.memo(
        ("triton-prefill-tiles", tiling.block_q),
        lambda: tk.prefill_tiles(meta.query_lens_cpu, tiling.block_q, q.device),
    )
    return tk.paged_prefill(q, kv, meta.query_start_loc, tiles, tiling, layer.scale, layer.sliding_window)
