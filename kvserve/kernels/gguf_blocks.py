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


def ggml_type(qtype: int) -> int:
    """The ggml type id of a kernel type id (ROWS4 or not)."""
    return qtype & ~ROWS4


def is_rows4(qtype: int) -> bool:
    return bool(qtype & ROWS4)


def interleave_rows(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Blocks [N, row_bytes] of a native type in the file's layout -> the same bytes in the ROWS4 layout: the
    reference for the native kernels' kvserve_gguf_interleave_rows, which is what the loader runs."""
    n, nbytes = blocks.shape
    size, grouped = NATIVE_GGUF_TYPES[ggml_type(qtype)].nbytes, n // 4 * 4
    head = blocks[:grouped].reshape(n // 4, 4, nbytes // size, size).transpose(1, 2).reshape(grouped, nbytes)
    return torch.cat([head, blocks[grouped:]])


def deinterleave_rows(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """interleave_rows undone: blocks in the ROWS4 layout -> the file's."""
    n, nbytes = blocks.shape
    size, grouped = NATIVE_GGUF_TYPES[ggml_type(qtype)].nbytes, n // 4 * 4
    head = blocks[:grouped].reshape(n // 4, nbytes // size, 4, size).transpose(1, 2).reshape(grouped, nbytes)
    return torch.cat([head, blocks[grouped:]])


def gather_rows(blocks: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of blocks of kernel type `qtype`, as the file stores them ([len(ids), row_bytes]): an
    embedding's lookups in an interleaved tensor (the tied LM head's)."""
    if not is_rows4(qtype):
        return blocks[ids]
    n, nbytes = blocks.shape
    size, grouped = NATIVE_GGUF_TYPES[ggml_type(qtype)].nbytes, n // 4 * 4
    rows = blocks[ids]  # right for the rows after the last whole group
    inside = ids < grouped
    chosen = ids[inside]
    groups = blocks[:grouped].reshape(n // 4, nbytes // size, 4, size)
    rows[inside] = groups[chosen // 4, :, chosen % 4].reshape(-1, nbytes)
    return rows


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights of a native type (ROWS4 or not); ValueError when k is not a whole number of
    blocks."""
    fmt = NATIVE_GGUF_TYPES[ggml_type(qtype)]
    if k % fmt.block:
        raise ValueError(f"{fmt.name} rows are whole blocks of {fmt.block} weights, got {k}")
    return k // fmt.block * fmt.nbytes


def row_length(qtype: int, nbytes: int) -> int:
    """Weights in a row of `nbytes` bytes of a native type (ROWS4 or not)."""
    fmt = NATIVE_GGUF_TYPES[ggml_type(qtype)]
    if nbytes % fmt.nbytes:
        raise ValueError(f"{fmt.name} rows are whole blocks of {fmt.nbytes} bytes, got {nbytes}")
    return nbytes // fmt.nbytes * fmt.block


def dequantize_blocks(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [N, row_bytes] of kernel type `qtype` (ROWS4 or not) -> float32 [N, K], by gguf-py (the reference the
    native kernels are tested against)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    if is_rows4(qtype):
        blocks = deinterleave_rows(blocks, qtype)
    data = blocks.detach().cpu().contiguous().numpy()
    return torch.from_numpy(
        np.ascontiguousarray(dequantize(data, GGMLQuantizationType(ggml_type(qtype))), dtype=np.float32)
    )
