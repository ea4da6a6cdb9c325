"""The ctypes mirror of decoder_layer.cpp's structs (KvserveLinear, KvserveLayer, KvserveStep): one struct per
layer, built once from the model's modules, and one per step, so that a layer is one call with a handful of
arguments instead of forty. The field order and types must match the C++ declarations exactly (every integer is
int64 there, so no padding rule can differ)."""

from __future__ import annotations

import ctypes

_P, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double

LINEAR_FLOAT32, LINEAR_Q8_0, LINEAR_GGUF = 0, 1, 2
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
    ]


class LayerDesc(ctypes.Structure):
    """KvserveLayer: the weights and shape facts of one decoder layer."""

    _fields_ = [
        ("qkv", LinearDesc),
        ("o", LinearDesc),
        ("gate_up", LinearDesc),
        ("down", LinearDesc),
        ("input_norm", _P),
        ("post_attention_norm", _P),
        ("pre_feedforward_norm", _P),
        ("post_feedforward_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("hidden", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("intermediate", _I64),
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
    ]
