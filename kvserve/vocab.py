"""The names users and flags speak in, declared once: dtypes, weight quantization, block hash algorithms,
attention backends. Pure Python (no torch): `kvserve estimate` and `advise` read it without importing torch.

Each name maps to the facts that do not need torch (bytes per element); the torch dtype behind each name
lives in kvserve/dtypes.py, which is checked against this registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# 8-bit KV stores one float32 scale per token, per KV head, per layer, for K and for V (kv/quant.py).
SCALE_BYTES = 4


@dataclass(frozen=True, slots=True)
class KVDtype:
    """How one cached element is stored: its bytes, plus a scale's bytes per head vector for 8-bit formats."""

    name: str
    element_bytes: int
    scale_bytes: int = 0

    @property
    def is_8bit(self) -> bool:
        return self.element_bytes == 1


# `--dtype`: weights and compute.
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# `--kv-cache-dtype` (besides auto): a compute dtype, or 8-bit with a per-token-head scale.
KV_DTYPES: dict[str, KVDtype] = {
    d.name: d
    for d in (
        KVDtype("float32", 4),
        KVDtype("bfloat16", 2),
        KVDtype("float16", 2),
        KVDtype("fp8", 1, SCALE_BYTES),
        KVDtype("fp8_e4m3", 1, SCALE_BYTES),
        KVDtype("fp8_e5m2", 1, SCALE_BYTES),
        KVDtype("int8", 1, SCALE_BYTES),
    )
}
# Names that stand for another (vLLM's meaning of plain "fp8").
KV_DTYPE_ALIASES: dict[str, str] = {"fp8": "fp8_e4m3"}
# `--quantization` (weights): "none" keeps the checkpoint's weights in the compute dtype; "q8_0" is an int8 plus
# a float32 scale shared by 32 weights (kvserve/model/quantization.py); "gguf" runs a GGUF file's quantized
# blocks as stored (kvserve/model/gguf_layers.py).
QUANTIZATION_METHODS: tuple[str, ...] = ("none", "q8_0", "gguf")
# --lm-head-quantization: the LM head re-quantized to these GGUF block types (kvserve/model/lm_head.py)
LM_HEAD_QUANTIZATIONS: tuple[str, ...] = ("q4_0",)
# `--activation-quantization`: none (float32 activations, the exact path) or int8 (8 bits per run of 32 before each
# GGUF matmul: integer dot products, kernels/gguf_int8_matmul.cpp; opt-in, lossy).
ACTIVATION_QUANTIZATIONS: tuple[str, ...] = ("none", "int8")
# `--kernel-isa`: the instruction set the CPU kernels are built for (kernels/native.py); auto: the best the CPU has.
KERNEL_ISAS: tuple[str, ...] = ("auto", "avx512bf16", "avx512vnni", "avx512", "avxvnni", "avx2")
# `--prefix-caching-hash-algo`: sha256 is collision-resistant; xxhash (xxh3-128) is faster (kv/hashing.py).
HASH_ALGOS: tuple[str, ...] = ("sha256", "xxhash")
# `--attention-backend`: "cpu" is the fast CPU path, "reference" the plain torch truth, "triton" the paged
# Triton kernels for CUDA (kvserve/attention/).
ATTENTION_BACKENDS: tuple[str, ...] = ("cpu", "reference", "triton")
# `--structured-outputs-backend` (vLLM's names): auto = xgrammar, falling back to llguidance per request
# (kvserve/structured/backend.py; why xgrammar first: docs/STRUCTURED_OUTPUT.md).
STRUCTURED_OUTPUTS_BACKENDS: tuple[str, ...] = ("auto", "xgrammar", "guidance")


def canonical_kv_dtype(name: str) -> str:
    """The storage format a --kv-cache-dtype name stands for (fp8 -> fp8_e4m3); other names are their own."""
    return KV_DTYPE_ALIASES.get(name, name)


def is_8bit_kv_dtype(name: str) -> bool:
    """An 8-bit KV cache dtype, also under names other servers report (vLLM's fp8_inc, ...): fp8* or int8."""
    kv_dtype = KV_DTYPES.get(name)
    return kv_dtype.is_8bit if kv_dtype is not None else name.startswith(("fp8", "int8"))


def check_choice(flag: str, value: str, choices: Iterable[str]) -> str:
    """`value` if it is one of `choices`, else a ValueError naming the flag and the choices (a 400 in the server)."""
    options = tuple(choices)
    if value not in options:
        raise ValueError(f"unsupported {flag} {value!r}; choose from {', '.join(options)}")
    return value
