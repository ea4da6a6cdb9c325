"""The ctypes mirror of kernels.h's structs, in its order: the decoder layer's (KvserveLinear, KvserveLayer,
KvserveStep: one struct per layer, built once from the model's modules, and one per step, so that a layer is one
call with a handful of arguments instead of forty) and the argument structs of the attention and rope entry points.
The field order and types must match the C++ declarations exactly (every integer is int64 and every real a double
there, so no padding rule can differ); tests/unit/test_kernel_contract.py compares the fields with kernels.h's and
kvserve_abi_sizes gives the library's sizes at load (ops.NativeKernels.abi_matches)."""

from __future__ import annotations

import ctypes

from kvserve.dtypes import NATIVE_KV_DTYPE_CODES

_P, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double

LINEAR_FLOAT32, LINEAR_Q8_0, LINEAR_GGUF = 0, 1, 2
# kernels.h's KvserveKvDtype codes, by the --kv-cache-dtype name of the storage: declared with the other dtype names
# in kvserve/dtypes.py (the registry), named here for the ctypes side.
KV_DTYPE_CODES = NATIVE_KV_DTYPE_CODES
MAX_PARTS = 3  # a fused QKV stored as three GGUF tensors of different types


class LinearDesc(ctypes.Structure):
    """KvserveLinear: y = x W^T (+ bias), W as float32, q8_0 or up to three runs of GGUF blocks."""

    _fields_ = [
        ("weight", _P * MAX_PARTS),
        ("scales", _P),
        ("bias", _P),
        ("rows", _I64 * MAX_PARTS),
        ("qtype", _I64 * MAX_PARTS),
        ("in_features", _I64),
        ("out_features", _I64),
        ("kind", _I64),
        ("parts", _I64),
        ("int8_activations", _I64),
    ]


class LayerDesc(ctypes.Structure):
    """KvserveLayer: the weights and shape facts of one decoder layer."""

    _fields_ = [
        ("qkv", LinearDesc),
        ("o", LinearDesc),
        ("gate_up", LinearDesc),
        ("down", LinearDesc),
        ("ba", LinearDesc),
        ("input_norm", _P),
        ("post_attention_norm", _P),
        ("pre_feedforward_norm", _P),
        ("post_feedforward_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("conv_weight", _P),
        ("conv_bias", _P),
        ("dt_bias", _P),
        ("a_log", _P),
        ("state_norm", _P),
        ("hidden", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("intermediate", _I64),
        ("conv_kernel", _I64),
        ("linear_key_heads", _I64),
        ("linear_value_heads", _I64),
        ("linear_key_dim", _I64),
        ("linear_value_dim", _I64),
        ("output_gate", _I64),
        ("rotary_dim", _I64),
        ("window", _I64),
        ("act", _I64),
        ("sandwich", _I64),
        ("eps", _F64),
        ("scale", _F64),
    ]


class StepDesc(ctypes.Structure):
    """KvserveStep: one step's flat batch and paged-cache addressing, plus the scratch memory."""

    _fields_ = [
        ("scratch", _P),
        ("slot_mapping", _P),
        ("block_tables", _P),
        ("seq_lens", _P),
        ("query_start_loc", _P),
        ("decode_rows", _P),
        ("decode_tables", _P),
        ("decode_lens", _P),
        ("tokens", _I64),
        ("seqs", _I64),
        ("table_width", _I64),
        ("block_size", _I64),
        ("all_decode", _I64),
        ("decode_count", _I64),
        ("state_slots", _P),
        ("state_continues", _P),
    ]


class DecodeAttentionArgs(ctypes.Structure):
    """KvserveDecodeAttention: paged decode attention on a cache of kv_dtype (8-bit ones with their scales)."""

    _fields_ = [
        ("q", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("k_scales", _P),
        ("v_scales", _P),
        ("block_tables", _P),
        ("seq_lens", _P),
        ("out", _P),
        ("table_width", _I64),
        ("batch", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("dim", _I64),
        ("block_size", _I64),
        ("window", _I64),
        ("kv_dtype", _I64),
        ("scale", _F64),
    ]


class PrefillAttentionArgs(ctypes.Structure):
    """KvservePrefillAttention: one sequence's chunk, causal over its paged context (any kv_dtype)."""

    _fields_ = [
        ("q", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("k_scales", _P),
        ("v_scales", _P),
        ("block_table", _P),
        ("out", _P),
        ("q_len", _I64),
        ("seq_len", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("dim", _I64),
        ("block_size", _I64),
        ("window", _I64),
        ("kv_dtype", _I64),
        ("scale", _F64),
    ]


class QkNormRopeArgs(ctypes.Structure):
    """KvserveQkNormRope: per-head RMSNorm of the Q and K heads, then NEOX rope."""

    _fields_ = [
        ("qkv", _P),
        ("q_weight", _P),
        ("k_weight", _P),
        ("cos", _P),
        ("signed_sin", _P),
        ("out", _P),
        ("tokens", _I64),
        ("row_stride", _I64),
        ("heads", _I64),
        ("q_heads", _I64),
        ("dim", _I64),
        ("rotary_dim", _I64),
        ("eps", _F64),
    ]


# kernels.h's structs in its order: what kvserve_abi_sizes reports the sizes of.
STRUCTS: tuple[type[ctypes.Structure], ...] = (
    LinearDesc,
    LayerDesc,
    StepDesc,
    DecodeAttentionArgs,
    PrefillAttentionArgs,
    QkNormRopeArgs,
)
