"""One registry per vocabulary: dtype names (kvserve/vocab.py) and their torch dtypes (kvserve/dtypes.py), hash
algorithms, attention backends, size units (kvserve/units.py). The registries agree with each other and with
what uses them, and no other module declares a vocabulary's names again (checked in the source with ast)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.attention.registry import BACKENDS, get_attention_backend
from kvserve.dtypes import TORCH_DTYPES, dtype_name, torch_dtype
from kvserve.kv.hashing import BlockHasher
from kvserve.kv.quant import KV_QUANT_FORMATS
from kvserve.units import GiB, MiB, cdiv, format_bytes, format_gib, parse_size
from kvserve.vocab import (
    ATTENTION_BACKENDS,
    COMPUTE_DTYPES,
    HASH_ALGOS,
    KV_DTYPE_ALIASES,
    KV_DTYPES,
    QUANTIZATION_METHODS,
    STRUCTURED_OUTPUTS_BACKENDS,
    canonical_kv_dtype,
    check_choice,
    is_8bit_kv_dtype,
)

PACKAGE = Path(__file__).resolve().parents[2] / "kvserve"


@pytest.mark.parametrize("name", sorted(KV_DTYPES))
def test_every_kv_dtype_name_has_its_torch_dtype_and_size(name: str) -> None:
    dtype = torch_dtype(name)
    assert torch.empty((), dtype=dtype).element_size() == KV_DTYPES[name].element_bytes
    assert dtype_name(dtype) == canonical_kv_dtype(name)


def test_the_torch_map_covers_the_names_and_nothing_else() -> None:
    assert set(TORCH_DTYPES) == {canonical_kv_dtype(n) for n in KV_DTYPES}
    assert set(COMPUTE_DTYPES) <= set(KV_DTYPES) and all(torch_dtype(n).is_floating_point for n in COMPUTE_DTYPES)
    assert set(KV_DTYPE_ALIASES.values()) <= set(TORCH_DTYPES)


def test_the_8bit_formats_are_the_registry_8bit_names() -> None:
    eight_bit = {canonical_kv_dtype(n) for n, d in KV_DTYPES.items() if d.is_8bit}
    assert set(KV_QUANT_FORMATS) == eight_bit
    assert all(fmt.storage == torch_dtype(name) for name, fmt in KV_QUANT_FORMATS.items())
    assert KV_QUANT_FORMATS["int8"].max_value == 127.0  # a symmetric grid, not -128


def test_unknown_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="float64"):
        torch_dtype("float64")
    with pytest.raises(ValueError, match="--attention-backend 'flash'; choose from cpu, reference"):
        get_attention_backend("flash")
    assert check_choice("--x", "b", ("a", "b")) == "b"


def test_8bit_kv_dtypes_by_name() -> None:
    assert [is_8bit_kv_dtype(n) for n in ("fp8", "int8", "fp8_inc", "bfloat16", "float32")] == [True] * 3 + [False] * 2


def test_every_backend_name_has_an_implementation() -> None:
    assert set(BACKENDS) == set(ATTENTION_BACKENDS)
    assert all(callable(get_attention_backend(name)) for name in ATTENTION_BACKENDS)


def test_every_kernel_isa_name_is_a_build() -> None:
    from kvserve.kernels.native import ISA_REQUIREMENTS
    from kvserve.vocab import KERNEL_ISAS

    assert KERNEL_ISAS == ("auto", *ISA_REQUIREMENTS)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_every_hash_name_hashes(algo: str) -> None:
    hasher = BlockHasher(algo)
    assert hasher.hash_block(None, [1, 2, 3]) != hasher.hash_block(None, [1, 2, 4])


def test_sizes() -> None:
    assert parse_size("4GiB") == 4 * GiB and parse_size("512MiB") == 512 * MiB and parse_size("2G") == 2 * 10**9
    assert parse_size(" 1.5 kib ") == 1536 and parse_size(1048576) == 1048576
    with pytest.raises(ValueError, match="4GiB"):
        parse_size("4 parsecs")
    assert format_bytes(1.5 * GiB) == "1.50 GiB" and format_bytes(64 * MiB, ".4g") == "64 MiB"
    assert format_bytes(900) == "900 B" and format_gib(1024 * GiB) == "1,024.00 GiB"
    assert [cdiv(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_the_engine_flags_take_their_choices_from_the_registries() -> None:
    import argparse

    from kvserve.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    choices = {a.dest: a.choices for a in parser._actions if a.choices is not None}
    assert tuple(choices["attention_backend"]) == ATTENTION_BACKENDS
    assert tuple(choices["prefix_caching_hash_algo"]) == HASH_ALGOS
    assert tuple(choices["dtype"]) == ("auto", *COMPUTE_DTYPES)
    assert tuple(choices["quantization"]) == ("auto", *QUANTIZATION_METHODS)


def test_the_structured_outputs_backend_flag_reaches_the_engine_config() -> None:
    """`--structured-outputs-backend` offers exactly the backends the registry builds, and the choice lands in the
    EngineConfig (not silently replaced by the default)."""
    import argparse

    from kvserve.engine_args import add_engine_args, engine_config_from_args
    from kvserve.structured.backend import BACKEND_NAMES

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    (action,) = [a for a in parser._actions if a.dest == "structured_outputs_backend"]
    assert tuple(action.choices) == BACKEND_NAMES == STRUCTURED_OUTPUTS_BACKENDS
    assert action.default == "auto"
    for name in BACKEND_NAMES:
        config = engine_config_from_args(parser.parse_args(["--structured-outputs-backend", name]))
        assert config.structured_outputs_backend == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--structured-outputs-backend", "outlines"])


def test_the_name_registries_do_not_import_torch() -> None:
    """vocab, units, config and the engine flags are read by `kvserve estimate`, which must not import torch."""
    code = (
        "import sys, kvserve.vocab, kvserve.units, kvserve.config, kvserve.engine_args, kvserve.capacity; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


VOCABULARIES = {
    "dtype": set(KV_DTYPES),
    "quantization method": set(QUANTIZATION_METHODS),
    "hash algorithm": set(HASH_ALGOS),
    "attention backend": set(ATTENTION_BACKENDS),
}
# The registries themselves, and the backends' implementations by name (checked against the names above).
REGISTRIES = {"vocab.py", "dtypes.py", "attention/registry.py"}  # units.py: checked for dtype names only


def redeclared_vocabularies(source: str) -> list[str]:
    """Literal collections (tuple, list, set, dict keys) holding two or more names of one vocabulary: a second
    declaration of it. A single name (a default, a comparison) is a use, not a declaration."""
    found = []
    for node in ast.walk(ast.parse(source)):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or items is None:
            continue
        names = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        found += [
            f"line {node.lineno}: {kind} names {sorted(names & vocab)}"
            for kind, vocab in VOCABULARIES.items()
            if len(names & vocab) >= 2
        ]
    return found


def redeclared_units(source: str) -> list[str]:
    """Binary size units spelled as literals (1 << 10/20/30, 2 ** 30): KiB, MiB and GiB live in kvserve/units.py."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, (ast.LShift, ast.Pow))
            and isinstance(node.left, ast.Constant)
            and isinstance(node.right, ast.Constant)
            and (node.left.value, node.right.value) in {(1, 10), (1, 20), (1, 30), (2, 10), (2, 20), (2, 30)}
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_sees_a_redeclared_vocabulary() -> None:
    assert redeclared_vocabularies('choices = ["auto", "float32", "bfloat16"]')
    assert redeclared_vocabularies('M = {"sha256": 1, "xxhash": 2}')
    assert not redeclared_vocabularies('x = ("auto", "float32"); y = dtype == "bfloat16"')
    assert redeclared_units("n / (1 << 30)") and redeclared_units("4 * 2**20") and not redeclared_units("1 << 40")


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).as_posix() not in REGISTRIES),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_module_redeclares_a_vocabulary(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert not redeclared_vocabularies(source), path
    assert path.name == "units.py" or not redeclared_units(source), path
