"""Where the Triton kernel tests run: compiled on a CUDA device when there is one, else in Triton's interpreter
on CPU tensors.

The interpreter is chosen when a function is decorated with @triton.jit, by reading TRITON_INTERPRET then, and
Triton's own library (tl.max, tl.sum, tl.cdiv, ...) is decorated when `triton` is first imported: so the
variable must be set before that import, not only before kvserve.attention.triton_kernels is imported
(otherwise the kernels fail with "Cannot call @triton.jit'd outside of the scope of a kernel"). Launches read
it too (Triton 3.9 imports its gluon package lazily at the first launch and asserts the variable then), so it
must stay set. This conftest therefore sets TRITON_INTERPRET=1 for the rest of the process, at collection,
on a machine without CUDA only: there nothing can run compiled Triton anyway (the other users of triton,
xgrammar's bitmask kernels, take CPU tensors through their CPU path). On a CUDA machine it is never touched
and the tests run the compiled kernels on the GPU. If `triton` was imported before this file without the
variable, the tests skip, saying so.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

import pytest
import torch

_MODULE = "kvserve.attention.triton_kernels"

if not torch.cuda.is_available() and "triton" not in sys.modules and importlib.util.find_spec("triton"):
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where the kernel tests put q and the cache: a CUDA device (compiled kernels) or the CPU (interpreter)."""
    module = importlib.import_module(_MODULE)
    if not module.INTERPRETED:
        if torch.cuda.is_available():
            return torch.device("cuda")
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before tests/attention/conftest.py ran")
    return torch.device("cpu")


@pytest.fixture(scope="session")
def triton_kernels(triton_device: torch.device) -> ModuleType:
    """kvserve.attention.triton_kernels, once triton_device has checked how it runs here."""
    return importlib.import_module(_MODULE)


@pytest.fixture(scope="session")
def interpreted_kernels(triton_device: torch.device) -> ModuleType:
    """The kernels module, for tests that run the interpreter on CPU tensors only (the engine test)."""
    if triton_device.type != "cpu":
        pytest.skip("runs in Triton's interpreter on CPU only")
    return importlib.import_module(_MODULE)
