"""8-bit KV cache (fp8 e4m3, fp8 e5m2, int8): quantize on write, dequantize on read, and the scales.

Why per token and KV head, computed at write time (one float32 scale per head vector of head_dim values):
- A block is filled token by token (prefill chunks, then decode appends). A scale owned by one token never
  changes after it is written, so a block written in pieces holds exactly what it would hold written whole,
  nothing is ever re-quantized, and shared prefix blocks stay immutable. Per-block or per-tensor scales
  would have to grow (re-quantizing old tokens) or be guessed before the data is seen.
- Measured on Gemma 3 270M's real K/V (docs/KV_QUANT.md): per-token-head scales have the lowest error of
  the three granularities; the cost is 4 bytes per 256-byte head vector (1.6%).
Symmetric scaling: scale = amax / format_max, so the largest value of each vector maps to the format's
largest finite value and nothing can overflow; values are clamped before the cast (saturate, never
inf/NaN). int8 uses [-127, 127] so that the grid is symmetric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.dtypes import TORCH_DTYPES
from kvserve.vocab import KV_DTYPES, canonical_kv_dtype

# Floor for a scale, so an all-zero vector quantizes to zeros instead of 0/0.
_MIN_SCALE = 1e-30


@dataclass(frozen=True, slots=True)
class KVQuantFormat:
    """One 8-bit storage format: the torch storage dtype and its largest representable magnitude."""

    name: str
    storage: torch.dtype
    max_value: float

    @property
    def is_float(self) -> bool:
        return self.storage.is_floating_point


def _format(name: str) -> KVQuantFormat:
    """The format stored as the registry's dtype for `name`: fp8 saturates at its largest finite value, int8 at
    127 (not -128, so that the grid is symmetric)."""
    storage = TORCH_DTYPES[name]
    return KVQuantFormat(name, storage, torch.finfo(storage).max if storage.is_floating_point else 127.0)


# The 8-bit names of the registry (kvserve/vocab.py), aliases excluded: fp8_e4m3, fp8_e5m2, int8.
KV_QUANT_FORMATS: dict[str, KVQuantFormat] = {
    name: _format(name) for name, dtype in KV_DTYPES.items() if dtype.is_8bit and canonical_kv_dtype(name) == name
}
_BY_STORAGE = {f.storage: f for f in KV_QUANT_FORMATS.values()}


def quant_format(storage: torch.dtype) -> KVQuantFormat | None:
    """The 8-bit format stored as `storage`, or None for a plain (unquantized) cache dtype."""
    return _BY_STORAGE.get(storage)


def compute_scales(x: torch.Tensor, fmt: KVQuantFormat, dims: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """Symmetric float32 scales, one per group that `dims` reduces (kept as size-1 dims, so they broadcast):
    dims=(-1,) is per token and head; adding the token axis gives per block or per tensor scales."""
    amax = x.detach().float().abs().amax(dim=dims, keepdim=True)
    scale = (amax / fmt.max_value).clamp_(min=_MIN_SCALE)
    # Rounding may leave max_value * scale just above amax, which is inf at the top of float32's range.
    return torch.where(scale * fmt.max_value > amax, torch.nextafter(scale, torch.zeros_like(scale)), scale)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """x / scale, rounded to the format and saturated at its largest finite value."""
    y = (x.float() / scale).clamp_(-fmt.max_value, fmt.max_value)
    if not fmt.is_float:
        y = y.round_()
    return y.to(fmt.storage)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values q stands for, in `dtype` (multiplied in float32, then cast)."""
    return (q.float() * scale).to(dtype)


def fake_quantize(x: torch.Tensor, fmt: KVQuantFormat, dims: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """Round trip at a given scale granularity: what attention would read back (for measurements)."""
    scale = compute_scales(x, fmt, dims)
    return dequantize(quantize(x, scale, fmt), scale, x.dtype)


def store(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    x: torch.Tensor,
    slots: torch.Tensor,
    static_scale: float | None = None,
) -> None:
    """Write x ([T, kv_heads, head_dim]) at `slots` of a paged cache [num_blocks, block_size, kv_heads, head_dim];
    with `scales` ([num_blocks, block_size, kv_heads] float32), quantize per token and head first, using
    `static_scale` (a checkpoint's calibrated per-tensor scale) for every token when it is given."""
    rows = cache.view(-1, *cache.shape[2:])
    quantized = _quantized(cache, scales)
    if quantized is None:
        rows.index_copy_(0, slots, x.to(cache.dtype))
        return
    fmt, scales = quantized
    if static_scale is None:
        scale = compute_scales(x, fmt)  # [T, kv_heads, 1]
    else:
        scale = torch.full((*x.shape[:-1], 1), static_scale, dtype=torch.float32, device=x.device)
    # index_copy_ has no float8 kernel on CPU: copy the bytes through a same-size integer view.
    rows.view(torch.uint8).index_copy_(0, slots, quantize(x, scale, fmt).view(torch.uint8))
    scales.view(-1, scales.shape[-1]).index_copy_(0, slots, scale.squeeze(-1))


def load(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows at `slots` (any index shape) of a paged cache, as [*slots.shape, kv_heads, head_dim] in `dtype`;
    only these rows are dequantized, never the whole cache."""
    quantized = _quantized(cache, scales)
    if quantized is None:
        return cache.view(-1, *cache.shape[2:])[slots].to(dtype)
    # Indexed as bytes, like `store` writes: indexing kernels for float8 are not on every device and torch version.
    rows = cache.view(torch.uint8).view(-1, *cache.shape[2:])[slots].view(cache.dtype)
    _, scales = quantized
    return dequantize(rows, scales.view(-1, scales.shape[-1])[slots].unsqueeze(-1), dtype)


def _quantized(cache: torch.Tensor, scales: torch.Tensor | None) -> tuple[KVQuantFormat, torch.Tensor] | None:
    """The cache's 8-bit format and its scales (None for a plain cache), insisting that an 8-bit cache comes with
    its scales and a plain one without."""
    fmt = quant_format(cache.dtype)
    if fmt is None and scales is None:
        return None
    if fmt is None or scales is None:
        raise ValueError(f"a {cache.dtype} KV cache {'needs' if fmt else 'takes no'} scales")
    return fmt, scales
