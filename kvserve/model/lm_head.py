"""`--lm-head-quantization q4_0`: the LM head as 4-bit blocks (opt-in, lossy).

Why: at batch 1 a decode step reads every weight once, and a large vocabulary's LM head is most of them: Gemma 3
270M's tied 262,144 x 640 head is 178 MB of the file's Q8_0 against 69 MB for all 18 decoder layers. Q4_0 (18
bytes per 32 weights) is 94 MB. The input embedding keeps the file's blocks (a lookup reads one row per token), so
only the logits change. The blocks are made at load time from the file's dequantized rows with gguf-py's own
quantizer (the reference Q4_0), about 2 s for Gemma's head, and run on the same native GGUF block kernels as
every other layer. `kvserve bench quantization --methods gguf,gguf+lm-head-q4_0` reports what it costs and buys:
on this project's 2-core Intel host it did not pay (a slower batch-1 step: decoding nibbles there is bound by
instructions, not bytes; +8.9% perplexity; docs/PERFORMANCE_NOTES.md attempt 36), so it stays opt-in, for
machines with less memory bandwidth per core.
"""

from __future__ import annotations

import logging
import time

import torch

from kvserve.kernels.ops import Kernels
from kvserve.model.gguf_layers import GGUFEmbedding, GGUFLinear

log = logging.getLogger(__name__)

# kvserve.vocab.LM_HEAD_QUANTIZATIONS -> ggml type ids (GGMLQuantizationType)
GGML_TYPES = {"q4_0": 2}
_SLAB_ROWS = 16384  # rows dequantized and re-quantized at a time: 42 MB of float32 for a 640-wide head


def requantize_rows(blocks: torch.Tensor, qtype: int, target: int, kernels: Kernels) -> torch.Tensor:
    """GGUF rows (uint8 [rows, row_bytes] of `qtype`) re-quantized to `target` blocks, slab by slab."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    slabs = []
    for start in range(0, blocks.shape[0], _SLAB_ROWS):
        rows = kernels.gguf_dequantize(blocks[start : start + _SLAB_ROWS], qtype).numpy()
        slabs.append(torch.from_numpy(quantize(rows, GGMLQuantizationType(target))))
    return torch.cat(slabs)


def quantize_lm_head(model: torch.nn.Module, method: str, kernels: Kernels) -> None:
    """Give the model's LM head its own `method` blocks. The head must be GGUF blocks (--quantization gguf): the
    tied embedding (GGUFEmbedding) or an untied one-part GGUFLinear. Raises ValueError otherwise."""
    target = GGML_TYPES[method]
    head = getattr(model, "lm_head", None) or getattr(model, "embed_tokens", None)
    start = time.perf_counter()
    if isinstance(head, GGUFEmbedding):
        head.set_head_blocks(target, requantize_rows(head.qweight, head.qtype, target, kernels))
    elif isinstance(head, GGUFLinear) and len(head.qtypes) == 1:
        head.replace_blocks(target, requantize_rows(head.part_blocks(0), head.qtypes[0], target, kernels))
    else:
        raise ValueError(
            f"--lm-head-quantization {method} re-quantizes an LM head held as GGUF blocks "
            "(--quantization gguf, the default for a GGUF file on CPU with the native kernels); "
            f"this model's head is a {type(head).__name__}"
        )
    log.info(
        "--lm-head-quantization %s: the LM head re-quantized from the file's blocks in %.1f s",
        method,
        time.perf_counter() - start,
    )
