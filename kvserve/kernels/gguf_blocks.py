"""GGUF quantized blocks as weights, kept as the file stores them: which ggml types the native matmul
(kvserve/kernels/gguf_matmul.cpp) takes, how many bytes a row of them is, and the reference dequantization
(gguf-py's, the one HF transformers loads GGUF files with). A weight [N, K] is held as uint8 [N, row_bytes]:
each row the run of blocks that the file stores for it."""

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


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights of a native type; ValueError when k is not a whole number of blocks."""
    fmt = NATIVE_GGUF_TYPES[qtype]
    if k % fmt.block:
        raise ValueError(f"{fmt.name} rows are whole blocks of {fmt.block} weights, got {k}")
    return k // fmt.block * fmt.nbytes


def row_length(qtype: int, nbytes: int) -> int:
    """Weights in a row of `nbytes` bytes of a native type."""
    fmt = NATIVE_GGUF_TYPES[qtype]
    if nbytes % fmt.nbytes:
        raise ValueError(f"{fmt.name} rows are whole blocks of {fmt.nbytes} bytes, got {nbytes}")
    return nbytes // fmt.nbytes * fmt.block


def dequantize_blocks(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [N, row_bytes] -> float32 [N, K], by gguf-py (the reference the native kernels are tested against)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    data = blocks.detach().cpu().contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(dequantize(data, GGMLQuantizationType(qtype)), dtype=np.float32))
