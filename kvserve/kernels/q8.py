"""The 8-bit weight matmul (q8_0 layout: int8 weights, one float32 scale per 32 values along the input axis).

Two implementations of one operation, y = x @ dequant(q, scales)^T:
- `NativeQ8Kernel`: q8_matmul.cpp (AVX2 + FMA, OpenMP), compiled with the system C++ compiler on first use
  into the cache directory (about 1 s) and called through ctypes, which releases the GIL. No torch headers,
  so the build is fast and cannot break with a torch upgrade.
- `TorchQ8Kernel`: plain torch, widening a slab of rows at a time. The fallback where no compiler or no
  AVX2 is available (or the tensors are not on the CPU), and the reference the native kernel is tested against.
`load_q8_kernel` picks the native one when it can and says why when it cannot.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

GROUP_SIZE = 32
SOURCE = Path(__file__).with_name("q8_matmul.cpp")
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


class Q8Kernel(Protocol):
    name: str

    def matmul(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 @ dequant(q [N, K] int8, scales [N, K/32] float32)^T -> [M, N] float32."""
        ...


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], float32 scales [N, K/32]); symmetric, round to nearest.

    A block that came from a GGUF Q8_0 tensor round-trips exactly (same blocks, same amax / 127 scale)."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"q8_0 needs the input size to be a multiple of {GROUP_SIZE}, got {k}")
    groups = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = groups.abs().amax(dim=-1) / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(groups * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scales.contiguous()


def dequantize_q8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight that (q, scales) stands for; rows may be any subset (an embedding lookup)."""
    *lead, k = q.shape
    return (q.float().reshape(*lead, k // GROUP_SIZE, GROUP_SIZE) * scales[..., None]).reshape(*lead, k)


@dataclass(frozen=True, slots=True)
class TorchQ8Kernel:
    """Widens `slab_rows` weight rows at a time, so the float32 copy never exceeds slab_rows x K."""

    slab_rows: int = 16384
    name: str = "torch"

    def matmul(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if q.shape[0] <= self.slab_rows:
            return x @ dequantize_q8(q, scales).T
        out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, q.shape[0], self.slab_rows):
            end = min(start + self.slab_rows, q.shape[0])
            out[:, start:end] = x @ dequantize_q8(q[start:end], scales[start:end]).T
        return out


@dataclass(frozen=True, slots=True)
class NativeQ8Kernel:
    """The compiled kernel; falls back to `fallback` for tensors it cannot take (not on the CPU)."""

    library: ctypes.CDLL
    fallback: TorchQ8Kernel = TorchQ8Kernel()
    name: str = "native"

    def matmul(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or q.device.type != "cpu":
            return self.fallback.matmul(x, q, scales)
        x = x.float().contiguous()
        m, k = x.shape
        n = q.shape[0]
        if q.shape[1] != k or scales.shape != (n, k // GROUP_SIZE) or k % GROUP_SIZE:
            raise ValueError(f"q8 matmul shapes do not fit: x {tuple(x.shape)}, q {tuple(q.shape)}, "
                             f"scales {tuple(scales.shape)}")
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            self.library.kvserve_q8_matmul(x.data_ptr(), m, k, q.data_ptr(), scales.data_ptr(), n, y.data_ptr())
        return y


def cpu_supports_native() -> tuple[bool, str]:
    """AVX2 and FMA on x86-64 Linux: what the compiled kernel is built for."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not Path("/proc/cpuinfo").is_file():
        return False, f"the native q8 kernel is for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    missing = {"avx2", "fma"} - flags
    if missing:
        return False, f"the CPU lacks {', '.join(sorted(missing))}"
    return True, ""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build_native_library(cache_dir: Path) -> Path:
    """Compile q8_matmul.cpp once per (source, compiler, flags) into cache_dir; returns the .so path.

    Raises RuntimeError with the compiler's message when the build fails."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + compiler.encode() + " ".join(COMPILE_FLAGS).encode()).hexdigest()[:16]
    target = cache_dir / f"kvserve_q8_{key}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent first starts never load a half-written file.
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        partial = Path(tmp) / target.name
        result = subprocess.run([compiler, *COMPILE_FLAGS, str(SOURCE), "-o", str(partial)],
                                check=False, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build {SOURCE.name}: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    return target


def load_native_library(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.kvserve_q8_matmul.argtypes = [p, i64, i64, p, p, i64, p]
    library.kvserve_q8_matmul.restype = None
    return library


def load_q8_kernel(cache_dir: Path, native: bool = True) -> Q8Kernel:
    """The native kernel when this machine can build and run it, else the torch one (with a warning)."""
    if not native:
        return TorchQ8Kernel()
    ok, why = cpu_supports_native()
    if ok:
        try:
            return NativeQ8Kernel(load_native_library(build_native_library(cache_dir)))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            why = str(e)
    log.warning("q8_0 weights use the slower torch kernel: %s", why)
    return TorchQ8Kernel()
