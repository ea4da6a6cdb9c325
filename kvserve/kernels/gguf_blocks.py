"""GGUF quantized blocks as weights, kept as the file stores them: which ggml types the native matmul
(kvserve/kernels/gguf_matmul.cpp) takes, how many bytes a row of them is, and the reference dequantization
(gguf-py's, the one HF transformers loads GGUF files with). A weight [N, K] is held as uint8 [N, row_bytes]:
each row the run of blocks that the file stores for it, or, for the native kernels, the same bytes with the rows
interleaved four at a time (ROWS4 below)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str
    block: int  # weights per block, along the input axis
    nbytes: int  # bytes per block


# ggml type id -> its block format, for the types the native kernel computes with.
NATIVE_GGUF_TYPES: dict[int, BlockFormat] = {
    2: BlockFormat("Q4_0", 32, 18),
    6: BlockFormat("Q5_0", 32, 22),
    8: BlockFormat("Q8_0", 32, 34),
    12: BlockFormat("Q4_K", 256, 144),
    13: BlockFormat("Q5_K", 256, 176),
    14: BlockFormat("Q6_K", 256, 210),
}


# Added to a ggml type id where a weight's rows are interleaved four at a time: each whole group of four rows
# (4g .. 4g + 3) stored block by block, block b of row 4g + r at the group's start + (4 b + r) * block bytes; the
# last N % 4 rows as in the file. The native gemvs read four rows at a time, and one stream of bytes where four
# streams came slower from memory (kernels/gguf_formats.h's RowBlocks: the layout's definition and why).
ROWS4 = 256
# Added as well (Q5_0 only, K a multiple of 128) where each group of four rows is stored as tiles of 128 weights
# instead, 352 bytes each: the sixteen f16 scales, the fifth bits in bit planes, the low nibbles two blocks to 32
# bytes (gguf_formats.h's Q5Tile: the layout and why). The int8 gemv reads them in place; the other paths copy
# each block back out of its tile.
Q5_TILES = 512
_Q5_0 = 6
_TILE = (128, 352)  # weights, bytes


def ggml_type(qtype: int) -> int:
    """The ggml type id of a kernel type id (ROWS4, Q5_TILES or not)."""
    return qtype & ~(ROWS4 | Q5_TILES)


def is_rows4(qtype: int) -> bool:
    return bool(qtype & ROWS4)


def interleave_rows(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Blocks [N, row_bytes] of a native type in the file's layout -> the same bytes in the ROWS4 layout (no tiles):
    the reference for the native kernels' kvserve_gguf_interleave_rows, which is what the loader runs."""
    n, nbytes = blocks.shape
    size, grouped = NATIVE_GGUF_TYPES[ggml_type(qtype)].nbytes, n // 4 * 4
    head = blocks[:grouped].reshape(n // 4, 4, nbytes // size, size).transpose(1, 2).reshape(grouped, nbytes)
    return torch.cat([head, blocks[grouped:]])


def _untile(groups: torch.Tensor) -> torch.Tensor:
    """Groups of four Q5_0 rows stored as tiles, uint8 [G, 4 * row_bytes] -> the file's blocks [G, 4, row_bytes]."""
    count, tiles = groups.shape[0], groups.shape[1] // _TILE[1]
    tile = groups.reshape(count, tiles, _TILE[1]).long()
    scales = tile[:, :, :32].reshape(count, tiles, 4, 4, 2)  # [.., row, block, byte]
    planes = tile[:, :, 32:96].reshape(count, tiles, 4, 1, 16)  # [.., row, -, byte t]
    nibbles = tile[:, :, 96:].reshape(count, tiles, 4, 2, 32)  # [.., row, block pair, byte t]
    block = torch.arange(4).reshape(1, 1, 1, 4, 1)
    fifth = torch.cat([(planes >> (2 * block)) & 1, (planes >> (2 * block + 1)) & 1], dim=-1)  # [.., r, i, weight]
    mask = (fifth << torch.arange(32)).sum(-1)  # the block's 32-bit mask of fifth bits
    mask_bytes = torch.stack([(mask >> (8 * b)) & 255 for b in range(4)], dim=-1)
    low = torch.stack([nibbles[:, :, :, i // 2] >> (4 * (i % 2)) & 15 for i in range(4)], dim=3)  # [.., r, i, w]
    packed = low[..., :16] | low[..., 16:] << 4
    blocks = torch.cat([scales, mask_bytes, packed], dim=-1).to(torch.uint8)  # [G, tiles, row, block, 22]
    return blocks.permute(0, 2, 1, 3, 4).reshape(count, 4, -1)


def deinterleave_rows(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """interleave_rows (or the native Q5_TILES layout) undone: blocks in the ROWS4 layout -> the file's."""
    n, nbytes = blocks.shape
    size, grouped = NATIVE_GGUF_TYPES[ggml_type(qtype)].nbytes, n // 4 * 4
    if qtype & Q5_TILES:
        head = _untile(blocks[:grouped].reshape(n // 4, 4 * nbytes)).reshape(grouped, nbytes)
    else:
        head = blocks[:grouped].reshape(n // 4, nbytes // size, 4, size).transpose(1, 2).reshape(grouped, nbytes)
    return torch.cat([head, blocks[grouped:]])


def gather_rows(blocks: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of blocks of kernel type `qtype`, as the file stores them ([len(ids), row_bytes]): an
    embedding's lookups in an interleaved tensor (the tied LM head's). Each chosen row's group of four is
    de-interleaved and the row taken from it."""
    if not is_rows4(qtype):
        return blocks[ids]
    n, nbytes = blocks.shape
    grouped = n // 4 * 4
    rows = blocks[ids]  # right for the rows after the last whole group
    inside = ids < grouped
    chosen = ids[inside]
    groups = blocks[:grouped].reshape(n // 4, 4 * nbytes)[chosen // 4].reshape(-1, nbytes)
    plain = deinterleave_rows(groups, qtype).reshape(-1, 4, nbytes)
    rows[inside] = plain[torch.arange(len(chosen)), chosen % 4]
    return rows


def q5_tiles_fit(qtype: int, k: int) -> bool:
    """Whether a weight of ggml type `qtype` and K weights a row can be stored as Q5_TILES."""
    return qtype == _Q5_0 and k % _TILE[0] == 0


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights of a native type (in any layout); ValueError when k is not a whole number of
    blocks."""
    fmt = NATIVE_GGUF_TYPES[ggml_type(qtype)]
    if k % fmt.block:
        raise ValueError(f"{fmt.name} rows are whole blocks of {fmt.block} weights, got {k}")
    return k // fmt.block * fmt.nbytes


def row_length(qtype: int, nbytes: int) -> int:
    """Weights in a row of `nbytes` bytes of a native type (in any layout)."""
    fmt = NATIVE_GGUF_TYPES[ggml_type(qtype)]
    if nbytes % fmt.nbytes:
        raise ValueError(f"{fmt.name} rows are whole blocks of {fmt.nbytes} bytes, got {nbytes}")
    return nbytes // fmt.nbytes * fmt.block


def dequantize_blocks(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [N, row_bytes] of kernel type `qtype` (in any layout) -> float32 [N, K], by gguf-py (the reference the
    native kernels are tested against)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    if is_rows4(qtype):
        blocks = deinterleave_rows(blocks, qtype)
    data = blocks.detach().cpu().contiguous().numpy()
    return torch.from_numpy(
        np.ascontiguousarray(dequantize(data, GGMLQuantizationType(ggml_type(qtype))), dtype=np.float32)
    )
