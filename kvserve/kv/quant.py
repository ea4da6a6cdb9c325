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

    def error_bound(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Largest round-trip error allowed for each element of x given its (broadcastable) scale: half a step
        of the format's grid at that magnitude (relative for fp8 normals, absolute below them and for int8)."""
        if not self.is_float:
            return scale / 2
        info = torch.finfo(self.storage)
        mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[self.storage]
        smallest_subnormal = info.smallest_normal * 2.0**-mantissa_bits
        return torch.maximum(x.abs() * 2.0 ** -(mantissa_bits + 1), scale * smallest_subnormal / 2)


KV_QUANT_FORMATS: dict[str, KVQuantFormat] = {
    f.name: f
    for f in (
        KVQuantFormat("fp8_e4m3", torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max),
        KVQuantFormat("fp8_e5m2", torch.float8_e5m2, torch.finfo(torch.float8_e5m2).max),
        KVQuantFormat("int8", torch.int8, 127.0),
    )
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
    fmt = _format_with_scales(cache, scales)
    if fmt is None:
        rows.index_copy_(0, slots, x.to(cache.dtype))
        return
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
    rows = cache.view(-1, *cache.shape[2:])[slots]
    if _format_with_scales(cache, scales) is None:
        return rows.to(dtype)
    return dequantize(rows, scales.view(-1, scales.shape[-1])[slots].unsqueeze(-1), dtype)


def _format_with_scales(cache: torch.Tensor, scales: torch.Tensor | None) -> KVQuantFormat | None:
    """The cache's 8-bit format (None if plain), insisting that an 8-bit cache comes with its scales."""
    fmt = quant_format(cache.dtype)
    if (fmt is None) != (scales is None):
        raise ValueError(f"a {cache.dtype} KV cache {'needs' if fmt else 'takes no'} scales")
    return fmt
