"""Lower layers never import upper ones (review of 2026-11-30):
- kv/ serves the engine and must not know it (the KV manager imported engine.request);
- bench, and the modules it shares the engine flags with, never import the `kvserve` CLI (lazy imports hid a
  bench -> cli -> bench cycle).
The check reads the source with ast, so an import hidden under TYPE_CHECKING, inside a function, written
relative, or behind importlib.import_module("...") counts as much as one at the top of a module."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

import kvserve

PACKAGE_ROOT = Path(kvserve.__file__).parent
KV_MUST_NOT_IMPORT = ("kvserve.engine", "kvserve.server", "kvserve.bench", "kvserve.cli")
BENCH_MUST_NOT_IMPORT = ("kvserve.cli",)
BENCH_FILES = sorted((PACKAGE_ROOT / "bench").rglob("*.py"))
# The modules bench and serve take the engine flags from: they must stay below the CLI too.
SHARED_FILES = [PACKAGE_ROOT / name for name in ("engine_args.py", "config.py", "units.py", "vocab.py")]


# -- the import walker --------------------------------------------------------------------------------------


def module_name(path: Path) -> str:
    """kvserve/kv/pool.py -> kvserve.kv.pool; a package's __init__.py -> the package."""
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute name behind `from <dots><module> import ...` written in module `importer`."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([module] if module else []))


def imported_names(source: str, importer: str, is_package: bool = False) -> set[str]:
    """Every module name an import anywhere in `source` may load: `import a.b`, `from a import b` (a and a.b,
    since b may be a submodule), relative imports resolved, and importlib.import_module / __import__ calls
    with a literal name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, importer, is_package)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def is_forbidden(name: str, forbidden: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


def forbidden_imports(paths: Iterable[Path], forbidden: tuple[str, ...]) -> list[str]:
    """'module imports name' for each import of a forbidden package (or one of its modules) in `paths`."""
    found = []
    for path in paths:
        importer = module_name(path)
        for name in sorted(imported_names(path.read_text(encoding="utf-8"), importer, path.name == "__init__.py")):
            if is_forbidden(name, forbidden):
                found.append(f"{importer} imports {name}")
    return found


# -- the rules ----------------------------------------------------------------------------------------------


def test_kv_imports_nothing_above_it() -> None:
    assert forbidden_imports(sorted((PACKAGE_ROOT / "kv").rglob("*.py")), KV_MUST_NOT_IMPORT) == []


@pytest.mark.parametrize("path", BENCH_FILES + SHARED_FILES, ids=lambda p: str(p.relative_to(PACKAGE_ROOT)))
def test_module_does_not_import_the_cli(path: Path) -> None:
    assert forbidden_imports([path], BENCH_MUST_NOT_IMPORT) == []


def test_the_bench_package_is_all_checked() -> None:
    names = {p.relative_to(PACKAGE_ROOT).as_posix() for p in BENCH_FILES}
    assert {"bench/cli.py", "bench/suite.py", "bench/options.py", "bench/peers/hf.py"} <= names


# -- the walker itself: not vacuous -------------------------------------------------------------------------


def test_the_check_sees_hidden_imports() -> None:
    """Imports under TYPE_CHECKING, inside functions, relative or through importlib are found."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from kvserve.engine.request import Request\n"
        "def f():\n"
        "    from ..server import app\n"
        "    import kvserve.cli\n"
        "    importlib.import_module('kvserve.bench.suite')\n"
        "from . import pool\n"
    )
    names = imported_names(source, "kvserve.kv.manager")
    assert {
        "kvserve.engine.request",
        "kvserve.server.app",
        "kvserve.cli",
        "kvserve.bench.suite",
        "kvserve.kv.pool",
    } <= names
    assert sum(is_forbidden(n, KV_MUST_NOT_IMPORT) for n in names) >= 4
    assert not is_forbidden("kvserve.engineering", KV_MUST_NOT_IMPORT)
    assert not is_forbidden("kvserve.kv.pool", KV_MUST_NOT_IMPORT)


@pytest.mark.parametrize(
    "source",
    [
        "from kvserve.cli import build_parser",
        "def f():\n    from kvserve.cli import engine_config_from_args\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvserve.cli\n",
        "from kvserve import cli",
        "from ... import cli",
        "import importlib\nimportlib.import_module('kvserve.cli')",
    ],
    ids=["top-level", "function-local", "type-checking", "from-package", "relative", "import-module"],
)
def test_the_check_sees_every_kind_of_cli_import(source: str) -> None:
    """Each way a module of kvserve.bench.peers could reach the CLI is caught."""
    names = imported_names(source, "kvserve.bench.peers.hf")
    assert any(is_forbidden(n, BENCH_MUST_NOT_IMPORT) for n in names), names


def test_the_check_passes_the_engine_flags_module() -> None:
    names = imported_names("from kvserve.engine_args import add_engine_args", "kvserve.bench.latency")
    assert not any(is_forbidden(n, BENCH_MUST_NOT_IMPORT) for n in names)


def test_relative_imports_resolve_in_a_package_init() -> None:
    """In a package's __init__.py, one dot is the package itself."""
    assert "kvserve.bench.peers.hf" in imported_names("from . import hf", "kvserve.bench.peers", is_package=True)
    assert "kvserve.bench.peers.hf" in imported_names("from .hf import HFPeer", "kvserve.bench.peers.hf")
