"""Building and loading the compiled CPU kernels: every kvserve/kernels/*.cpp, compiled with the system C++
compiler into one shared library on first use (about 2 s), cached by a hash of the sources, compiler and flags,
and called through ctypes (which releases the GIL). No torch headers are involved, so the build is fast and
cannot break with a torch upgrade; OpenMP binds to the runtime torch has already loaded (one thread pool)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources: part of the build's hash
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# The instruction sets the library can be built for, best first, with the CPU flags each needs and the compiler
# flags it adds. The library is built on the machine that runs it, for the best set its CPU has: AVX-512 doubles
# the float32 FLOPs per instruction of the blocked matmul (widened_matmul.h), which bounds a step at batch >= 8.
ISA_REQUIREMENTS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512": (
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}),
        ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
    ),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ()),
}
_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Every exported function and its C signature; all return void.
SIGNATURES: dict[str, list] = {
    "kvserve_q8_matmul": [_P, _I64, _I64, _P, _P, _I64, _P],
    "kvserve_gguf_matmul": [_P, _I64, _I64, _P, ctypes.c_int32, _I64, _P, _I64],
    "kvserve_gguf_dequantize": [_P, ctypes.c_int32, _I64, _I64, _P],
    "kvserve_rms_norm": [_P, _I64, _I64, _I64, _I64, _P, _F32, _P, _I64],
    "kvserve_gated_act": [_P, _I64, _I64, ctypes.c_int32, _P],
    "kvserve_paged_decode_attention": [_P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P],
    "kvserve_paged_decode_attention_i8": [
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _I64,
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _F32,
        _P,
    ],
    "kvserve_paged_prefill_attention": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P],
    "kvserve_qk_norm_rope": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _F32, _P, _P, _P],
    # (layer, step) are the addresses of kernels/layer_abi.py's LayerDesc and StepDesc
    "kvserve_decoder_layer": [_P, _P, _P, _P, _P, _P, _P, _P, _P],
    "kvserve_decoder_layer_scratch": [_P, _I64, _I64, _P],
    "kvserve_decoder_layer_abi": [_P],
    "kvserve_quantize_int8_rows": [_P, _I64, _I64, _P, _P],
}


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_supports_native() -> tuple[bool, str]:
    """AVX2, FMA and F16C on x86-64 Linux: what the library needs at least. (ok, why not)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not Path("/proc/cpuinfo").is_file():
        return False, f"the native kernels are for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    missing = ISA_REQUIREMENTS["avx2"][0] - _cpu_flags()
    if missing:
        return False, f"the CPU lacks {', '.join(sorted(missing))}"
    return True, ""


def supported_isas() -> list[str]:
    """The instruction sets of ISA_REQUIREMENTS this CPU has, best first (empty where it has none)."""
    if not cpu_supports_native()[0]:
        return []
    flags = _cpu_flags()
    return [isa for isa, (needs, _) in ISA_REQUIREMENTS.items() if needs <= flags]


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build_native_library(cache_dir: Path, isa: str | None = None) -> Path:
    """Compile the sources once per (sources, compiler, flags) into cache_dir; returns the .so path.

    isa: a key of ISA_REQUIREMENTS (the caller checks that the CPU has it); None: the best this CPU has.
    Raises RuntimeError with the compiler's message when the build fails."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    isa = isa or (supported_isas() or ["avx2"])[0]
    flags = (*COMPILE_FLAGS, *ISA_REQUIREMENTS[isa][1])
    digest = hashlib.sha256(compiler.encode() + " ".join(flags).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.name.encode() + source.read_bytes())
    target = cache_dir / f"kvserve_kernels_{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("compiling kvserve's CPU kernels with %s for %s into %s (once; about 10 s)", compiler, isa, cache_dir)
    # Build beside the target, then rename: concurrent first starts never load a half-written file.
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        partial = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(partial)],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build the kernels: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    return target


def load_native_library(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = None
    return library
