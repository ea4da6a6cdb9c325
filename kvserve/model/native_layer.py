"""The native layer path: each decoder layer of a step as one call into kernels/decoder_layer.cpp (norms, QKV,
q/k norm + rope, KV write, paged attention, output projection, residuals, MLP), instead of ~17 torch ops and
module calls a layer, whose dispatch cost (~10-20 us each) is most of what a decode step spends outside the
weight reads.

`NativeLayerStack.build` describes every layer's weights once (ctypes structs pointing into the parameters and
buffers, which the loader fills in place) and raises `NativeLayerUnsupported` with the reason when a model is
outside what the C++ covers; DecoderModel then keeps the torch path, which stays the reference. Per step the
stack checks only what can change between steps: the KV cache (a cache of an element type the kernels do not read,
or with a checkpoint's static fp8 scales, goes to the torch path) and the batch's shape (one step struct and one
scratch buffer per step)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.abi import (
    LINEAR_FLOAT32,
    LINEAR_GGUF,
    LINEAR_Q8_0,
    MAX_PARTS,
    LayerDesc,
    LinearDesc,
    StepDesc,
)
from kvserve.kernels.gguf_blocks import NATIVE_GGUF_TYPES, ggml_type
from kvserve.kernels.ops import NATIVE_ACTIVATIONS, Kernels, NativeKernels, kv_dtype_code
from kvserve.kv.cache import LayerKVCache
from kvserve.model.gguf_layers import GGUFLinear
from kvserve.model.quantization import Q8Linear

if TYPE_CHECKING:
    from kvserve.kv.state_cache import StepState
    from kvserve.model.decoder import DecoderLayer

log = logging.getLogger(__name__)

# float32 weights (nn.Linear) go through the C++ blocked matmul, which beats torch's MKL path only on small
# steps (1 thread, Gemma 3 270M, a whole forward: 16 rows 152 against 194 ms, 32 rows 195 against 219, 64 rows
# 412 against 358, 512 rows 2194 against 1380): larger steps of such a model run the torch modules.
FLOAT32_MAX_ROWS = 32
# Scratch up to this size (decode steps, short chunks) is kept between steps; a long prefill chunk's (tens of
# MB) is allocated for its step only, so the model does not hold its peak for the rest of its life.
KEEP_SCRATCH_BYTES = 16 << 20


class NativeLayerUnsupported(Exception):
    """The model (or this step's KV cache) is outside what decoder_layer.cpp computes; the message says why."""


def _cpu_f32(t: torch.Tensor, what: str) -> int:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise NativeLayerUnsupported(f"{what} is {t.dtype} on {t.device.type}, not contiguous float32 on the CPU")
    return t.data_ptr()


def _describe_linear(module: nn.Module, what: str) -> LinearDesc:
    d = LinearDesc()
    if isinstance(module, Q8Linear):
        if module.qweight.device.type != "cpu" or not module.qweight.is_contiguous():
            raise NativeLayerUnsupported(f"{what}: q8_0 weights not contiguous on the CPU")
        d.kind, d.parts = LINEAR_Q8_0, 1
        d.weight[0], d.scales, d.rows[0] = module.qweight.data_ptr(), _cpu_f32(module.scales, what), module.out_features
    elif isinstance(module, GGUFLinear):
        if len(module.qtypes) > MAX_PARTS:
            raise NativeLayerUnsupported(f"{what} has {len(module.qtypes)} GGUF parts (at most {MAX_PARTS})")
        d.kind, d.parts = LINEAR_GGUF, len(module.qtypes)
        for i, (qtype, rows) in enumerate(zip(module.kernel_qtypes, module.part_rows)):
            blocks = getattr(module, f"blocks{i}")
            if blocks.device.type != "cpu" or not blocks.is_contiguous():
                raise NativeLayerUnsupported(f"{what}: GGUF blocks not contiguous on the CPU")
            if ggml_type(qtype) not in NATIVE_GGUF_TYPES:  # the library would abort on it
                raise NativeLayerUnsupported(f"{what}: no native kernel for ggml type {qtype}")
            d.weight[i], d.qtype[i], d.rows[i] = blocks.data_ptr(), qtype, rows
        d.int8_activations = int(module.kernels.activation_quantization == "int8")
    elif isinstance(module, nn.Linear):
        if module.in_features % 8:
            raise NativeLayerUnsupported(f"{what}: float32 input size {module.in_features} is not a multiple of 8")
        d.kind, d.parts = LINEAR_FLOAT32, 1
        d.weight[0], d.rows[0] = _cpu_f32(module.weight, what), module.out_features
    else:
        raise NativeLayerUnsupported(f"{what} is a {type(module).__name__}")
    d.in_features, d.out_features = module.in_features, module.out_features
    bias = getattr(module, "bias", None)
    d.bias = _cpu_f32(bias, f"{what}'s bias") if bias is not None else None
    return d


def _describe_layer(layer: DecoderLayer, index: int) -> LayerDesc:
    if layer.has_state:
        return _describe_state_layer(layer, index)
    attn, mlp = layer.self_attn, layer.mlp
    if attn.rotary_dim % 2:
        raise NativeLayerUnsupported(f"layer {index}'s rope turns an odd number of dims ({attn.rotary_dim})")
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if attn.q_norm is not None and attn.k_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    eps = layer.input_layernorm.eps
    if any(n.eps != eps for n in norms):
        raise NativeLayerUnsupported(f"layer {index}'s norms differ in eps")
    if mlp.act not in NATIVE_ACTIVATIONS:
        raise NativeLayerUnsupported(f"activation {mlp.act!r} has no native kernel")
    if attn.head_dim % 16:
        raise NativeLayerUnsupported(f"head_dim {attn.head_dim} is not a multiple of 16 (the rope kernel's step)")
    d = LayerDesc()
    d.qkv = _describe_linear(attn.qkv_proj, f"layer {index} qkv_proj")
    d.o = _describe_linear(attn.o_proj, f"layer {index} o_proj")
    d.gate_up = _describe_linear(mlp.gate_up_proj, f"layer {index} gate_up_proj")
    d.down = _describe_linear(mlp.down_proj, f"layer {index} down_proj")
    d.input_norm = _cpu_f32(layer.input_layernorm.weight, "a norm weight")
    d.post_attention_norm = _cpu_f32(layer.post_attention_layernorm.weight, "a norm weight")
    if layer.sandwich:
        d.pre_feedforward_norm = _cpu_f32(layer.pre_feedforward_layernorm.weight, "a norm weight")
        d.post_feedforward_norm = _cpu_f32(layer.post_feedforward_layernorm.weight, "a norm weight")
    if attn.q_norm is not None and attn.k_norm is not None:
        d.q_norm, d.k_norm = _cpu_f32(attn.q_norm.weight, "q_norm"), _cpu_f32(attn.k_norm.weight, "k_norm")
    d.hidden, d.heads, d.kv_heads, d.head_dim = d.o.out_features, attn.num_heads, attn.num_kv_heads, attn.head_dim
    d.intermediate = mlp.intermediate
    d.window = attn.spec.sliding_window or 0
    d.act, d.sandwich = NATIVE_ACTIVATIONS[mlp.act], int(layer.sandwich)
    d.eps, d.scale = eps, attn.spec.scale
    d.output_gate, d.rotary_dim = int(attn.output_gate), attn.rotary_dim
    return d


def _describe_state_layer(layer: DecoderLayer, index: int) -> LayerDesc:
    """A state layer: LFM2's short convolution (kvserve_short_conv_layer: in_proj in `qkv`, out_proj in `o`) or
    Qwen3.5's Gated DeltaNet (kvserve_gated_deltanet_layer: in_proj_qkvz in `qkv`, in_proj_ba in `ba`, out_proj in
    `o`), with the MLP both share."""
    mlp = layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.state_mixer == "linear_attn":
        norms.append(layer.linear_attn.norm)
    if layer.sandwich or any(n.eps != norms[0].eps for n in norms):
        raise NativeLayerUnsupported(f"layer {index}'s norms differ in eps")
    if mlp.act not in NATIVE_ACTIVATIONS:
        raise NativeLayerUnsupported(f"activation {mlp.act!r} has no native kernel")
    d = LayerDesc()
    d.gate_up = _describe_linear(mlp.gate_up_proj, f"layer {index} gate_up_proj")
    d.down = _describe_linear(mlp.down_proj, f"layer {index} down_proj")
    d.input_norm = _cpu_f32(layer.input_layernorm.weight, "a norm weight")
    d.post_attention_norm = _cpu_f32(layer.post_attention_layernorm.weight, "a norm weight")
    d.hidden, d.intermediate = d.down.out_features, mlp.intermediate
    d.act, d.eps = NATIVE_ACTIVATIONS[mlp.act], layer.input_layernorm.eps
    if layer.state_mixer == "conv":
        conv = layer.conv
        d.qkv = _describe_linear(conv.in_proj, f"layer {index} in_proj")
        d.o = _describe_linear(conv.out_proj, f"layer {index} out_proj")
        d.conv_weight = _cpu_f32(conv.conv_weight, "the conv taps")
        d.conv_bias = None if conv.conv_bias is None else _cpu_f32(conv.conv_bias, "the conv bias")
        d.conv_kernel = conv.conv_weight.shape[1]
        return d
    gdn = layer.linear_attn
    d.qkv = _describe_linear(gdn.in_proj_qkvz, f"layer {index} in_proj_qkvz")
    d.ba = _describe_linear(gdn.in_proj_ba, f"layer {index} in_proj_ba")
    d.o = _describe_linear(gdn.out_proj, f"layer {index} out_proj")
    d.conv_weight = _cpu_f32(gdn.conv_weight, "the conv taps")
    d.dt_bias, d.a_log = _cpu_f32(gdn.dt_bias, "dt_bias"), _cpu_f32(gdn.A_log, "A_log")
    d.state_norm = _cpu_f32(gdn.norm.weight, "the gated norm's weight")
    d.conv_kernel = gdn.conv_weight.shape[1]
    d.linear_key_heads, d.linear_value_heads = gdn.key_heads, gdn.value_heads
    d.linear_key_dim, d.linear_value_dim = gdn.key_dim, gdn.value_dim
    return d


@dataclass(slots=True)
class NativeLayerStack:
    """Every layer's description, the kernels that run them, and the scratch memory kept between steps."""

    kernels: NativeKernels
    layers: list[LayerDesc]
    max_rows: int | None = None  # steps of more rows run the torch modules (FLOAT32_MAX_ROWS); None: any
    # The first layer of each kind (attention, a state layer): a step's scratch is the larger of theirs.
    scratch_layers: list[LayerDesc] = field(default_factory=list)
    scratch: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float32))
    warned_cache: bool = False

    @classmethod
    def build(
        cls, layers: nn.ModuleList, kernels: Kernels, dtype: torch.dtype, attention_backend: str
    ) -> NativeLayerStack:
        """Raises NativeLayerUnsupported (saying why) for what decoder_layer.cpp does not compute."""
        if not isinstance(kernels, NativeKernels):
            raise NativeLayerUnsupported(f"the {kernels.name} kernels are in use")
        if dtype != torch.float32:
            raise NativeLayerUnsupported(f"the compute dtype is {dtype}, the native layer is float32")
        if attention_backend != "cpu":
            raise NativeLayerUnsupported(f"the attention backend is {attention_backend!r}")
        descs = [_describe_layer(layer, i) for i, layer in enumerate(layers)]  # type: ignore[arg-type]
        shapes = {(d.conv_kernel, d.hidden, d.heads, d.kv_heads, d.head_dim, d.intermediate) for d in descs}
        if len(shapes) > len({d.conv_kernel for d in descs}):  # the first layer of a kind sizes its scratch
            raise NativeLayerUnsupported("the layers differ in shape")
        linears = [lin for d in descs for lin in (d.qkv, d.o, d.gate_up, d.down)]
        linears += [d.ba for d in descs if d.linear_value_heads]  # a Gated DeltaNet layer's fifth projection
        float32 = any(lin.kind == LINEAR_FLOAT32 for lin in linears)
        kinds = {bool(d.conv_kernel): d for d in reversed(descs)}  # the first of each kind
        return cls(kernels, descs, FLOAT32_MAX_ROWS if float32 else None, list(kinds.values()))

    def takes(self, kv_caches: list[LayerKVCache], rows: int) -> bool:
        """Whether this step runs here: `rows` within max_rows, and caches the C++ reads and writes (contiguous, on
        the CPU, of an element type of kernels/abi.py's KV_DTYPE_CODES; an 8-bit one with scales it computes per
        token, not a checkpoint's static ones; says once if not)."""
        if self.max_rows is not None and rows > self.max_rows:
            return False
        c = kv_caches[0] if kv_caches else None
        ok = (
            c is not None
            and c.key.device.type == "cpu"
            and c.key.is_contiguous()
            and c.value.is_contiguous()
            and c.key.dtype == c.value.dtype
            and kv_dtype_code(c.key.dtype) is not None
            and c.static_key_scale is None
            and c.static_value_scale is None
        )
        if not ok and not self.warned_cache:
            log.info(
                "decoder layers: this KV cache (%s) runs on the torch path", c.key.dtype if c is not None else "none"
            )
            self.warned_cache = True
        return ok

    def run(
        self,
        h: torch.Tensor,
        tables: list[tuple[torch.Tensor, torch.Tensor]],
        rope_index: list[int],
        kv_caches: list[LayerKVCache],
        metas: Sequence[AttentionMetadata],
        state: StepState | None = None,
    ) -> torch.Tensor:
        """h [T, hidden] float32 (a fresh tensor: it is updated in place) through every layer, each with its own
        metadata (its KV cache group's tables; one step struct per distinct metadata); returns h. `kv_caches` and
        `metas`: one per attention layer; `state`: the state layers' caches and the step's state metadata (a hybrid
        model's short convolutions or Gated DeltaNet layers)."""
        h = h.contiguous()
        tokens = h.shape[0]
        keep: list[torch.Tensor] = []  # tensors the step structs point into, alive until the layers ran
        meta = metas[0]
        decode_idx = [] if meta.is_decode_only else [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        floats = max(self.kernels.decoder_layer_scratch(d, tokens, len(decode_idx)) for d in self.scratch_layers)
        scratch = self._scratch(floats)
        state_args = None if state is None else _state_args(state, keep)
        steps: dict[int, StepDesc] = {}
        attention = iter(zip(kv_caches, metas, strict=True))
        kv_code = kv_dtype_code(kv_caches[0].key.dtype) if kv_caches else 0
        if kv_code is None:  # takes() said no to such a cache
            raise ValueError(f"the native layers have no kernels for a {kv_caches[0].key.dtype} KV cache")
        states = iter(() if state is None else state.caches)
        for desc, rope_i in zip(self.layers, rope_index, strict=True):
            if desc.conv_kernel:
                step = steps.get(id(meta))
                if step is None:
                    step = steps[id(meta)] = _step_desc(meta, tokens, decode_idx, scratch, keep, state_args)
                cache_state = next(states)
                if desc.linear_value_heads:
                    assert cache_state.recurrent is not None  # a Gated DeltaNet layer's cache has its matrix state
                    self.kernels.gated_deltanet_layer(desc, step, h, cache_state.conv, cache_state.recurrent)
                else:
                    self.kernels.short_conv_layer(desc, step, h, cache_state.conv)
                continue
            cache, layer_meta = next(attention)
            step = steps.get(id(layer_meta))
            if step is None:
                step = steps[id(layer_meta)] = _step_desc(layer_meta, tokens, decode_idx, scratch, keep, state_args)
            cos, sin = tables[rope_i]
            self.kernels.decoder_layer(
                desc, step, h, cos, sin, cache.key, cache.value, cache.key_scale, cache.value_scale, kv_code
            )
        return h

    def _scratch(self, floats: int) -> torch.Tensor:
        if self.scratch.numel() >= floats:
            return self.scratch
        buffer = torch.empty(floats, dtype=torch.float32)
        if floats * 4 <= KEEP_SCRATCH_BYTES:
            self.scratch = buffer
        return buffer


def _state_args(state: StepState, keep: list[torch.Tensor]) -> tuple[int, int]:
    """The step's state slots and continue flags as the C++ reads them (int64 arrays), kept alive in `keep`."""
    slots = state.meta.slots.contiguous()
    continues = torch.tensor(state.meta.continues_cpu, dtype=torch.int64)
    keep += [slots, continues]
    return slots.data_ptr(), continues.data_ptr()


def _step_desc(
    meta: AttentionMetadata,
    tokens: int,
    decode_idx: list[int],
    scratch: torch.Tensor,
    keep: list[torch.Tensor],
    state_args: tuple[int, int] | None = None,
) -> StepDesc:
    """The step struct of one KV cache group's metadata: its slot mapping and block tables (and those of the step's
    decode rows, in a mixed step), the batch's shape and the shared scratch. `keep` holds the tensors it points into."""
    step = StepDesc()
    if decode_idx:
        sel = torch.tensor(decode_idx, dtype=torch.int64)
        keep += [meta.query_start_loc[sel], meta.block_tables[sel].contiguous(), meta.seq_lens[sel]]
        step.decode_rows, step.decode_tables, step.decode_lens = (t.data_ptr() for t in keep[-3:])
    ints = [
        meta.slot_mapping.contiguous(),
        meta.block_tables.contiguous(),
        meta.seq_lens.contiguous(),
        meta.query_start_loc.contiguous(),
    ]
    keep += ints
    step.slot_mapping, step.block_tables, step.seq_lens, step.query_start_loc = (t.data_ptr() for t in ints)
    step.scratch = scratch.data_ptr()
    step.tokens, step.seqs = tokens, len(meta.seq_lens_cpu)
    step.table_width, step.block_size = ints[1].shape[1], meta.block_size
    step.all_decode, step.decode_count = int(meta.is_decode_only), len(decode_idx)
    if state_args is not None:
        step.state_slots, step.state_continues = state_args
    return step
