"""One kernel contract: kvserve/kernels/kernels.h declares the C ABI once, and everything else is checked against it.

Before, the ABI was kept by hand in three places (kernels.h declared 9 of 13 exports, native.py listed its own
ctypes signatures, the .cpp files defined them) and the Python protocol had drifted from its implementations. Here:
every entry point a source defines is declared in kernels.h and the other way round; each source that defines one
includes the header (so the compiler checks the definition against the declaration); native.py's signatures are
read from the header; the ctypes structs have kernels.h's fields (names and sizes, in order) and the library's sizes;
the GGUF kernel's types are the ones Python routes to it; the Python implementations have the protocol's
signatures."""

from __future__ import annotations

import ctypes
import inspect
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.kernels import abi
from kvserve.kernels.gguf_blocks import NATIVE_GGUF_TYPES
from kvserve.kernels.native import HEADER, SIGNATURES, cpu_supports_native, declared_signatures
from kvserve.kernels.ops import Kernels, NativeKernels, TorchKernels, load_kernels
from kvserve.model.tokenizer import default_cache_dir

KERNELS = HEADER.parent
SOURCES = sorted(KERNELS.glob("*.cpp"))
DEFINITION = re.compile(r'^(?:extern "C" )?void (kvserve_\w+)\([^;{]*\{', re.MULTILINE)
STRUCT = re.compile(r"^struct (Kvserve\w+) \{(.*?)^\};", re.MULTILINE | re.DOTALL)
C_SIZES = {"int64_t": 8, "double": 8, "float": 4, "int32_t": 4}
# NativeKernels' members beyond the protocol: the native decoder layer's (model/native_layer.py), the ABI check, and
# the two the engine borrows through Model.native_kernels where the model runs on them (the offload tier's row copy,
# greedy sampling's row max; their callers keep torch paths for the rest), and the LM head's int8 panels packed once
# (model/gguf_layers.py). The two that say which dot products a build uses are for tests and reports.
NATIVE_ONLY = {
    "copy_rows",
    "row_max",
    "pack_int8_panels",
    "interleave_rows",
    "gguf_matmul_packed",
    "decoder_layer",
    "decoder_layer_scratch",
    "short_conv_layer",
    "gated_deltanet_layer",
    "store_kv_rows",
    "quantize_int8_activations",
    "int8_dot_product",
    "bf16_dot_products",
    "abi_matches",
    "library",
    "fallback",
}


def _definitions() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for source in SOURCES:
        for name in DEFINITION.findall(source.read_text()):
            assert name not in found, f"{name} is defined in {found[name].name} and {source.name}"
            found[name] = source
    return found


def test_every_definition_is_declared_once_and_every_declaration_defined() -> None:
    defined = _definitions()
    assert set(defined) == set(SIGNATURES), (
        sorted(set(defined) - set(SIGNATURES)),
        sorted(set(SIGNATURES) - set(defined)),
    )
    for source in set(defined.values()):  # the compiler then checks each definition against its declaration
        assert '#include "kernels.h"' in source.read_text(), source.name


def test_native_py_reads_its_signatures_from_the_header() -> None:
    assert declared_signatures(HEADER.read_text()) == SIGNATURES
    assert (
        SIGNATURES["kvserve_gguf_matmul"][4] is ctypes.c_int32 and SIGNATURES["kvserve_rms_norm"][6] is ctypes.c_float
    )
    with pytest.raises(ValueError, match="cannot pass"):
        declared_signatures("void kvserve_x(const float* x, size_t n);")


def _c_fields(body: str, sizes: dict[str, int]) -> list[tuple[str, int]]:
    """(name, bytes) of each field of a struct body in kernels.h, in order."""
    fields = []
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        decl = " ".join(decl.split()).replace("const ", "")
        if not decl:
            continue
        ctype, names = decl.split(" ", 1)
        size = 8 if ctype.endswith("*") or names.startswith("*") else sizes[ctype]
        for name in names.replace("*", "").split(","):
            name = name.strip()
            count = 1
            if "[" in name:
                name, n = name.rstrip("]").split("[")
                count = int(n)
            fields.append((name, size * count))
    return fields


def test_ctypes_structs_have_the_headers_fields_in_order() -> None:
    structs = STRUCT.findall(HEADER.read_text())
    assert [name for name, _ in structs] == [
        "KvserveLinear",
        "KvserveLayer",
        "KvserveStep",
        "KvserveDecodeAttention",
        "KvservePrefillAttention",
        "KvserveQkNormRope",
    ]
    sizes = dict(C_SIZES)
    for (name, body), mirror in zip(structs, abi.STRUCTS, strict=True):
        c_fields = _c_fields(body, sizes)
        py_fields = [(field, ctypes.sizeof(ctype)) for field, ctype in mirror._fields_]
        assert py_fields == c_fields, name
        sizes[name] = ctypes.sizeof(mirror)  # a later struct may hold this one (KvserveLayer's KvserveLinear)


NATIVE = pytest.mark.skipif(not cpu_supports_native()[0], reason="the native kernels need x86-64 with AVX2")


@NATIVE
def test_the_built_library_exports_the_header_and_agrees_on_struct_sizes() -> None:
    kernels = load_kernels(default_cache_dir() / "kernels")
    assert isinstance(kernels, NativeKernels) and kernels.abi_matches()
    for name in SIGNATURES:
        assert getattr(kernels.library, name).argtypes == SIGNATURES[name]


def test_the_gguf_kernel_takes_exactly_the_types_python_routes_to_it() -> None:
    enum = re.search(r"enum : int32_t \{([^}]*)\}", (KERNELS / "gguf_formats.h").read_text())
    assert enum is not None
    assert {int(v) for v in re.findall(r"= (\d+)", enum.group(1))} == set(NATIVE_GGUF_TYPES)


def test_the_kv_dtype_codes_are_the_headers() -> None:
    """kernels.h's KvserveKvDtype codes and abi.KV_DTYPE_CODES (which ops.py maps torch dtypes through) agree, and
    kv_dtypes.h dispatches on every one of them."""
    enum = re.search(r"enum : int64_t \{([^}]*)\}", HEADER.read_text())
    assert enum is not None
    declared = {name: int(v) for name, v in re.findall(r"(kKv\w+) = (\d+)", enum.group(1))}
    assert sorted(declared.values()) == sorted(abi.KV_DTYPE_CODES.values())
    dispatch = (KERNELS / "kv_dtypes.h").read_text()
    assert all(f"case {name}:" in dispatch for name in declared)


@NATIVE
def test_an_unknown_gguf_type_aborts_loudly_instead_of_leaving_the_output_unwritten() -> None:
    """Python never passes one (it routes other types to torch); if a bug did, the process must stop with a message,
    not go on with an output the kernel never wrote."""
    script = (
        "import ctypes, sys\n"
        "from kvserve.kernels.ops import load_kernels\n"
        "from kvserve.model.tokenizer import default_cache_dir\n"
        "k = load_kernels(default_cache_dir() / 'kernels')\n"
        "out = (ctypes.c_float * 32)()\n"
        "blocks = (ctypes.c_uint8 * 64)()\n"
        "k.library.kvserve_gguf_dequantize(ctypes.addressof(blocks), 99, 1, 32, ctypes.addressof(out))\n"
        "print('returned')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGABRT, (result.returncode, result.stdout, result.stderr)
    assert "no GGUF kernel for ggml type 99" in result.stderr and "returned" not in result.stdout


def _members(cls: type) -> dict[str, inspect.Signature | None]:
    out: dict[str, inspect.Signature | None] = {}
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        out[name] = inspect.signature(value) if inspect.isfunction(value) else None
    return out


def test_both_implementations_have_the_protocols_signatures() -> None:
    protocol = _members(Kernels)
    for implementation in (TorchKernels, NativeKernels):
        members = _members(implementation)
        for name, signature in protocol.items():
            assert name in members, f"{implementation.__name__} lacks {name}"
            if signature is not None:
                assert members[name] == signature, f"{implementation.__name__}.{name}"
    extra = set(_members(NativeKernels)) - set(protocol) - {"isa"}
    assert extra == NATIVE_ONLY
    assert set(_members(TorchKernels)) - set(protocol) <= {"slab_rows"}
