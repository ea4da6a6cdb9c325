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
import re
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
# The VNNI sets add integer dot products (`vpdpbusd`) for --activation-quantization int8
# (gguf_int8_matmul.cpp); without them its dot products use AVX2's vpmaddubsw. AVX512_BF16 adds bfloat16 dot products
# (`vdpbf16ps`) for prefill attention on a bfloat16 KV cache (prefill_attention.cpp).
_AVX512 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"})
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
ISA_REQUIREMENTS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512bf16": (_AVX512 | {"avx512_vnni", "avx512_bf16"}, (*_AVX512_FLAGS, "-mavx512vnni", "-mavx512bf16")),
    "avx512vnni": (_AVX512 | {"avx512_vnni"}, (*_AVX512_FLAGS, "-mavx512vnni")),
    "avx512": (_AVX512, _AVX512_FLAGS),
    "avxvnni": (frozenset({"avx2", "fma", "f16c", "avx_vnni"}), ("-mavxvnni",)),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ()),
}
HEADER = Path(__file__).parent / "kernels.h"  # the one declaration of the library's entry points
_C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float, "double": ctypes.c_double}
_DECLARATION = re.compile(r"^void (kvserve_\w+)\(([^)]*)\);", re.MULTILINE)


def declared_signatures(header: str) -> dict[str, list[type]]:
    """Each entry point kernels.h declares (all return void) -> its ctypes argument types: a pointer of any type
    is a void pointer (the caller passes addresses), a scalar its own width. Raises ValueError for a parameter
    type this mapping does not know, so that a new kind of argument cannot be passed with the wrong width."""
    signatures: dict[str, list[type]] = {}
    for name, params in _DECLARATION.findall(header):
        argtypes: list[type] = []
        for param in " ".join(params.split()).split(","):
            if "*" in param:
                argtypes.append(ctypes.c_void_p)
                continue
            ctype = param.replace("const ", "").split()[0]
            if ctype not in _C_TYPES:
                raise ValueError(f"kernels.h: {name} takes a {ctype!r}, which native.py cannot pass")
            argtypes.append(_C_TYPES[ctype])
        signatures[name] = argtypes
    return signatures


SIGNATURES = declared_signatures(HEADER.read_text())


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
