"""The machine a figure was measured on, and its two ceilings (memory bandwidth, matmul rate), measured in
the same process as the figures so that floors and figures share the same noise."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.units import GiB, KiB, MiB

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class MachineInfo:
    cpu_model: str
    logical_cpus: int
    torch_threads: int
    memory_gib: float
    python: str
    torch: str
    transformers: str | None
    platform: str

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{self.cpu_model}, {self.logical_cpus} logical CPUs ({self.torch_threads} torch threads), "
            f"{self.memory_gib:.1f} GiB RAM, torch {self.torch}, Python {self.python}"
        )


def _read_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def machine_info() -> MachineInfo:
    import torch

    try:
        import transformers

        hf_version: str | None = transformers.__version__
    except ImportError:
        hf_version = None
    mem_kib = _read_field("/proc/meminfo", "MemTotal")
    return MachineInfo(
        cpu_model=_read_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        logical_cpus=os.cpu_count() or 1,
        torch_threads=torch.get_num_threads(),
        memory_gib=int(mem_kib.split()[0]) * KiB / GiB if mem_kib else 0.0,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=hf_version,
        platform=platform.platform(),
    )


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Best-of-N rates: a floor must be what the machine can do at its best, not on average."""

    copy_bandwidth_gbps: float  # STREAM convention: (bytes read + bytes written) / time
    read_bandwidth_gbps: float  # a sum over a large tensor: bytes read / time
    matmul_gflops: float  # square matmul, in measure_ceilings' matmul_dtype (float32 by default)
    # int8 x int8 -> int32 square matmul (torch._int_mm: oneDNN's VNNI kernels where the CPU has them), 2 ops a
    # multiply-add; measured only for figures of --activation-quantization int8 (None: not measured)
    int8_matmul_gops: float | None = None

    @property
    def bandwidth_gbps(self) -> float:
        """The bandwidth the floors use: the better of the two ways of measuring it."""
        return max(self.copy_bandwidth_gbps, self.read_bandwidth_gbps)

    def to_json(self) -> dict:
        return {**asdict(self), "bandwidth_gbps_used": self.bandwidth_gbps}

    def best_of(self, other: Ceilings) -> Ceilings:
        """Each rate at its best over two measurements (e.g. before and after a benchmark on a shared machine)."""
        int8 = [r for r in (self.int8_matmul_gops, other.int8_matmul_gops) if r is not None]
        return Ceilings(
            max(self.copy_bandwidth_gbps, other.copy_bandwidth_gbps),
            max(self.read_bandwidth_gbps, other.read_bandwidth_gbps),
            max(self.matmul_gflops, other.matmul_gflops),
            max(int8) if int8 else None,
        )


def _best_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: page faults and thread-pool start belong to no measurement
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _bandwidths(buffer_mib: int, repeats: int, device: torch.device) -> tuple[float, float]:
    """(copy, read) bandwidth in GB/s over a buffer far larger than any cache."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    src = torch.ones(buffer_mib * MiB // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()

    def copy() -> None:
        dst.copy_(src)
        sync()

    def read() -> None:
        src.sum()
        sync()

    return 2 * nbytes / _best_seconds(copy, repeats) / 1e9, nbytes / _best_seconds(read, repeats) / 1e9


def _int8_matmul_gops(n: int, repeats: int) -> float:
    """The machine's int8 matmul rate, from a library kernel rather than kvserve's own (a floor measured with the
    code it floors would say nothing)."""
    import torch

    a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8)

    def matmul() -> None:
        torch._int_mm(a, b)

    return 2 * n**3 / _best_seconds(matmul, repeats) / 1e9


def _matmul_gflops(n: int, repeats: int, device: torch.device, dtype: torch.dtype | None = None) -> float:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def matmul() -> None:
        torch.mm(a, b)
        sync()

    return 2 * n**3 / _best_seconds(matmul, repeats) / 1e9


def measure_ceilings(
    buffer_mib: int = 256,
    matmul_n: int = 2048,
    repeats: int = 5,
    device: str = "cpu",
    matmul_dtype: str = "float32",
    int8: bool = False,
) -> Ceilings:
    """`matmul_dtype`: the compute dtype of the figures these ceilings floor (a GPU's bfloat16 matmul rate is
    an order of magnitude above its float32 one). `int8`: measure the int8 matmul rate too (CPU)."""
    import torch

    from kvserve.dtypes import torch_dtype

    dev = torch.device(device)
    copy_gbps, read_gbps = _bandwidths(buffer_mib, repeats, dev)
    return Ceilings(
        copy_bandwidth_gbps=copy_gbps,
        read_bandwidth_gbps=read_gbps,
        matmul_gflops=_matmul_gflops(matmul_n, repeats, dev, torch_dtype(matmul_dtype)),
        int8_matmul_gops=_int8_matmul_gops(matmul_n, repeats) if int8 and dev.type == "cpu" else None,
    )
