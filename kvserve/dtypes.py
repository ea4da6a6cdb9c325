"""The torch dtype behind each dtype name of kvserve/vocab.py, in one map both ways.

Kept apart from vocab.py because it imports torch, which the capacity tools must not.
"""

from __future__ import annotations

import torch

from kvserve.vocab import KV_DTYPES, canonical_kv_dtype

# Every canonical dtype name (compute and KV storage) -> its torch dtype; aliases resolve through vocab.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
# The KV storage dtypes the native kernels read in place and the native decoder layer writes, by kernels.h's
# KvserveKvDtype code (kernels/abi.py passes them; tests/unit/test_kernel_contract.py checks the header agrees).
NATIVE_KV_DTYPE_CODES: dict[str, int] = {
    "float32": 0,
    "bfloat16": 1,
    "float16": 2,
    "int8": 3,
    "fp8_e4m3": 4,
    "fp8_e5m2": 5,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a compute or KV dtype name (fp8 = fp8_e4m3); ValueError for an unknown name."""
    canonical = canonical_kv_dtype(name)
    if canonical not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(KV_DTYPES)})")
    return TORCH_DTYPES[canonical]


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a torch dtype (torch.float8_e4m3fn -> fp8_e4m3), for flags, logs and metrics."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))
