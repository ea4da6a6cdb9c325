"""`--quantization gguf`: a GGUF file's quantized tensors run as the file stores them (Q4_K, Q5_0, Q6_K, Q8_0,
...; kvserve/kernels/gguf_blocks.py lists the native types), so the output equals a float32 model on the weights
HF transformers dequantizes from the same file (up to summation order), and a decode step reads the file's bytes.

A fused projection (QKV, gate/up) keeps one block tensor per source tensor, since a file may store Q, K and V in
different types; each part writes its own columns of the output. A layer any of whose parts has a type without a
native kernel (Q3_K, IQ4_XS, F16, ...) stays a float32 nn.Linear, filled from the dequantized tensors (logged).

With the native kernels the loader then interleaves each matrix's rows four at a time (interleave_gguf_rows: the
same bytes, read by the gemvs as one stream; kernels/gguf_blocks.py's ROWS4, and Q5_TILES for Q5_0 with int8
activations); `qtypes` stay the file's types, `kernel_qtypes` are the ids the kernels take (the layout's)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kvserve.kernels.gguf_blocks import NATIVE_GGUF_TYPES, Q5_TILES, ROWS4, gather_rows, row_length
from kvserve.kernels.ops import Kernels, NativeKernels


class GGUFLinear(nn.Module):
    """A linear layer whose weight is one or more runs of GGUF blocks stacked along the output axis."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], bias: torch.Tensor | None, kernels: Kernels) -> None:
        super().__init__()
        self.qtypes = tuple(qtype for qtype, _ in parts)
        self.part_rows = tuple(blocks.shape[0] for _, blocks in parts)
        lengths = {row_length(qtype, blocks.shape[1]) for qtype, blocks in parts}
        if len(lengths) != 1:
            raise ValueError(f"the parts of a fused GGUF layer have different input sizes: {sorted(lengths)}")
        self.in_features, self.out_features = lengths.pop(), sum(self.part_rows)
        for i, (_, blocks) in enumerate(parts):
            self.register_buffer(f"blocks{i}", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.kernels = kernels
        self.rows4 = False  # the blocks' rows interleaved four at a time (interleave_rows)
        self.kernel_qtypes = self.qtypes  # the parts' type ids as the kernels take them (the file's, or its layout's)

    def packed_weight_counts(self) -> list[tuple[torch.Tensor, int]]:
        """(buffer, weights it holds): a buffer of packed blocks has far fewer elements than weights, so FLOP
        counts (bench/floor.py) ask the layer rather than the buffer's numel()."""
        return [(getattr(self, f"blocks{i}"), rows * self.in_features) for i, rows in enumerate(self.part_rows)]

    def part_blocks(self, i: int) -> torch.Tensor:
        return getattr(self, f"blocks{i}")

    def replace_blocks(self, qtype: int, blocks: torch.Tensor) -> None:
        """A one-part layer's weights as other blocks of the same rows in the file's layout (--lm-head-quantization)."""
        if len(self.qtypes) != 1 or blocks.shape[0] != self.out_features:
            raise ValueError("replace_blocks takes the rows of a one-part layer")
        self.qtypes = self.kernel_qtypes = (qtype,)
        self.rows4 = False
        self.register_buffer("blocks0", blocks)

    def interleave_rows(self, kernels: NativeKernels) -> bool:
        """Every part's blocks in the ROWS4 layout (NativeKernels.interleave_rows), Q5_0 parts as Q5_TILES where the
        activations are int8 (the int8 gemv reads tiles in place; the float32 one would copy blocks out of them);
        False, unchanged, where a part cannot be (fewer than four rows) or the blocks already are."""
        if self.rows4:
            return False
        tiles = kernels.activation_quantization == "int8"
        interleaved = [kernels.interleave_rows(self.part_blocks(i), q, tiles) for i, q in enumerate(self.qtypes)]
        if any(part is None for part in interleaved):
            return False
        kernel_qtypes = []
        for i, part in enumerate(interleaved):
            assert part is not None
            kernel_qtypes.append(part[0])
            self.register_buffer(f"blocks{i}", part[1])
        self.kernel_qtypes, self.rows4 = tuple(kernel_qtypes), True
        return True

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: an [N, out_features] float32 buffer to write into (N = x's rows)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).float()
        y = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32, device=x.device) if out is None else out
        start = 0
        for i, (qtype, rows) in enumerate(zip(self.kernel_qtypes, self.part_rows)):
            dst = y if len(self.qtypes) == 1 else y[:, start : start + rows]
            self.kernels.gguf_matmul(flat, getattr(self, f"blocks{i}"), qtype, out=dst)
            start += rows
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        tiles = ", Q5_0 tiles" if any(q & Q5_TILES for q in self.kernel_qtypes) else ""
        types = "+".join(NATIVE_GGUF_TYPES[t].name for t in self.qtypes) + (", rows x4" if self.rows4 else "") + tiles
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}, kernels={self.kernels.name}"


class GGUFEmbedding(nn.Module):
    """An embedding held as GGUF blocks: lookups dequantize only the rows asked for; `attend` is the tied LM
    head's matmul on the same blocks (Q8_0 in the default file: 1.06 bytes a weight)."""

    qweight: torch.Tensor  # [num_embeddings, bytes per row] uint8 GGUF blocks, a buffer

    head_qweight: torch.Tensor | None  # the LM head's own blocks (--lm-head-quantization), else None: qweight

    def __init__(self, qtype: int, blocks: torch.Tensor, dtype: torch.dtype, kernels: Kernels) -> None:
        super().__init__()
        self.qtype = qtype
        self.num_embeddings, self.embedding_dim = blocks.shape[0], row_length(qtype, blocks.shape[1])
        self.register_buffer("qweight", blocks)  # the name bench/floor.py counts as the embedding
        self.head_qtype = qtype
        self.register_buffer("head_qweight", None)  # bench/floor.py counts it as the LM head, when set
        self.dtype = dtype
        self.kernels = kernels
        # qweight's / head_qweight's rows interleaved four at a time (interleave_rows): the matrix `attend` reads
        self.rows4 = self.head_rows4 = False
        # (kernels, blocks, their int8 panels): the LM head's weights packed once for int8 activations above 4 rows
        # (NativeKernels.pack_int8_panels), made at the first such call; packing them at every call took about as
        # long as the multiply at 32 rows. Not a buffer: derived, and dropped when the kernels or blocks change.
        self._panels: tuple[Kernels, torch.Tensor, torch.Tensor] | None = None

    def set_head_blocks(self, qtype: int, blocks: torch.Tensor) -> None:
        """`attend` (the tied LM head) reads these blocks of the same rows; lookups keep the file's."""
        if blocks.shape[0] != self.num_embeddings or row_length(qtype, blocks.shape[1]) != self.embedding_dim:
            raise ValueError("the head's blocks must hold the embedding's rows")
        self.head_qtype = qtype
        self.head_qweight = blocks
        self.head_rows4 = False

    def interleave_rows(self, kernels: NativeKernels) -> bool:
        """The blocks `attend` reads (the LM head's) in the ROWS4 layout; lookups then gather their rows from it.
        False, unchanged, where they cannot be or already are."""
        if self.head_qweight is None:
            part = None if self.rows4 else kernels.interleave_rows(self.qweight, self.qtype)
            if part is not None:
                self.qweight, self.rows4 = part[1], True
        else:
            part = None if self.head_rows4 else kernels.interleave_rows(self.head_qweight, self.head_qtype)
            if part is not None:
                self.head_qweight, self.head_rows4 = part[1], True
        return part is not None

    def packed_weight_counts(self) -> list[tuple[torch.Tensor, int]]:
        """See GGUFLinear.packed_weight_counts."""
        weights = self.num_embeddings * self.embedding_dim
        return [(self.qweight, weights)] + ([] if self.head_qweight is None else [(self.head_qweight, weights)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        qtype = self.qtype + ROWS4 if self.rows4 else self.qtype
        rows = self.kernels.gguf_dequantize(gather_rows(self.qweight, qtype, ids.reshape(-1)), self.qtype)
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def attend(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.head_qweight is None:
            blocks, qtype = self.qweight, self.qtype + ROWS4 if self.rows4 else self.qtype
        else:
            blocks, qtype = self.head_qweight, self.head_qtype + ROWS4 if self.head_rows4 else self.head_qtype
        x = hidden.reshape(-1, self.embedding_dim)
        kernels = self.kernels
        if isinstance(kernels, NativeKernels) and kernels.activation_quantization == "int8" and x.shape[0] > 4:
            panels = self._int8_panels(kernels, blocks, qtype)
            if panels is not None:
                return kernels.gguf_matmul_packed(x, blocks, panels, qtype, out)
        return kernels.gguf_matmul(x, blocks, qtype, out)

    def _int8_panels(self, kernels: NativeKernels, blocks: torch.Tensor, qtype: int) -> torch.Tensor | None:
        if self._panels is None or self._panels[0] is not kernels or self._panels[1] is not blocks:
            packed = kernels.pack_int8_panels(blocks, qtype)
            if packed is None:
                return None
            self._panels = (kernels, blocks, packed)
        return self._panels[2]

    def extra_repr(self) -> str:
        name = NATIVE_GGUF_TYPES[self.qtype].name
        head = "" if self.head_qweight is None else f", LM head {NATIVE_GGUF_TYPES[self.head_qtype].name}"
        rows4 = ", rows x4" if self.rows4 or self.head_rows4 else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, {name}{head}{rows4}, kernels={self.kernels.name}"


# A fused module's sub-name -> the checkpoint sub-names of its parts, in row order (DecoderModel.load_weights).
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
}


def _source_names(module_name: str) -> list[str]:
    """The canonical weight names a module of the model is made of."""
    for fused, parts in FUSED_PARTS.items():
        if module_name.endswith(fused):
            prefix = module_name.removesuffix(fused)
            return [f"{prefix}{part}.weight" for part in parts]
    return [f"{module_name}.weight"]


def use_gguf_blocks(model: nn.Module, blocks: Mapping[str, tuple[int, torch.Tensor]], kernels: Kernels) -> set[str]:
    """Replace each linear layer and embedding of `model` whose weights all have native blocks (canonical name ->
    (ggml type, uint8 [rows, row_bytes])) by a GGUF layer; returns the canonical names consumed. Biases are left
    for `load_weights` (a GGUFLinear keeps a `bias` parameter where the nn.Linear had one)."""
    used: set[str] = set()
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            sources = _source_names(full)
            if not isinstance(child, (nn.Linear, nn.Embedding)) or not all(s in blocks for s in sources):
                continue
            if isinstance(child, nn.Embedding):
                qtype, data = blocks[sources[0]]
                setattr(parent, name, GGUFEmbedding(qtype, data, child.weight.dtype, kernels))
            else:
                bias = None if child.bias is None else torch.empty_like(child.bias, dtype=torch.float32)
                setattr(parent, name, GGUFLinear([blocks[s] for s in sources], bias, kernels))
            used.update(sources)
    return used


def interleave_gguf_rows(model: nn.Module, kernels: Kernels) -> int:
    """Every GGUF matrix of `model` (GGUFLinear, and the embedding where it is the LM head too) in the ROWS4 layout,
    where the kernels are the native ones (nothing else reads it); returns how many were interleaved. An embedding
    beside a separate LM head (`model.lm_head` set) is only looked up, so it keeps the file's layout. The loader's
    last step, after --lm-head-quantization has re-quantized the head from the file's layout."""
    if not isinstance(kernels, NativeKernels):
        return 0
    tied = getattr(model, "lm_head", None) is None
    return sum(
        module.interleave_rows(kernels)
        for module in model.modules()
        if isinstance(module, GGUFLinear) or (isinstance(module, GGUFEmbedding) and tied)
    )
