"""EngineConfig: every engine setting in one validated place, under vLLM's flag names."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.capacity import KV_DTYPES, QUANTIZATION_METHODS

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
    "ti": 1 << 40, "tib": 1 << 40,
}


def parse_size(value: str | int) -> int:
    """Parse a byte size such as 4GiB, 512MiB, 2G or 1048576."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"invalid size {value!r}: expected a number with an optional unit such as 4GiB or 512MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the default model (Gemma 3 270M GGUF)
    dtype: str = "auto"
    # Weights: "none" (the checkpoint's, in --dtype), "q8_0" (8-bit, a scale per 32), or "auto": q8_0 for a GGUF
    # checkpoint on CPU, else none (capacity.resolve_quantization).
    quantization: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context length, capped by what the cache holds
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # None: 4 GiB on CPU; on CUDA a share of free memory
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # or "xxhash" (faster; hits still compare block contents)
    enable_chunked_prefill: bool = True
    # Emulate a contiguous cache: each request reserves blocks for max-model-len at admission (bench memory).
    reserve_max_model_len: bool = False
    seed: int = 0
    cpu_threads: int | None = None  # None: all cores
    attention_backend: str = "cpu"  # "cpu" (fast) or "reference"
    max_logprobs: int = 20
    served_model_name: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory_bytes, str):
            self.kv_cache_memory_bytes = parse_size(self.kv_cache_memory_bytes)
        checks = [
            (self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size", "a power of two from 1 to 256"),
            (self.max_num_seqs >= 1, "max_num_seqs", ">= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]"),
            (self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1, "num_gpu_blocks_override", ">= 1"),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "> 0"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", "one of auto, float32, bfloat16, float16"),
            (self.quantization in ("auto", *QUANTIZATION_METHODS), "quantization",
             f"one of auto, {', '.join(QUANTIZATION_METHODS)}"),
            (self.kv_cache_dtype in ("auto", *KV_DTYPES), "kv_cache_dtype", f"one of auto, {', '.join(KV_DTYPES)}"),
            (self.attention_backend in ("cpu", "reference"), "attention_backend", "cpu or reference"),
            (self.prefix_caching_hash_algo in ("sha256", "xxhash"), "prefix_caching_hash_algo", "sha256 or xxhash"),
            (self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads", ">= 1"),
            (self.max_logprobs >= 0, "max_logprobs", ">= 0"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {expected}, got {getattr(self, name)!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than --max-model-len "
                    f"({self.max_model_len}) with chunked prefill off: long prompts could never be scheduled"
                )
