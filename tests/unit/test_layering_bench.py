"""Lower layers do not know upper ones: bench (and the shared engine flags) never import the `kvserve` CLI.

Read from the source with ast, so that an import hidden inside a function, under TYPE_CHECKING or behind
importlib.import_module("...") counts as much as one at the top of a module: lazy imports are exactly how the
old bench -> cli -> bench cycle stayed invisible.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvserve"
FORBIDDEN = "kvserve.cli"


def module_imports(path: Path) -> set[str]:
    """Every module that a file of the package imports anywhere (see `imported_modules`)."""
    package = ".".join(path.relative_to(PACKAGE.parent).parts[:-1])
    return imported_modules(path.read_text(encoding="utf-8"), package)


def imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` (a module of `package`) imports anywhere: import / from-import statements (the
    module and, for `from pkg import name`, pkg.name too, since name may be a submodule) and
    importlib.import_module("literal")."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
    return found


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of a (possibly relative) from-import inside `package`."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")


def _imports_cli(modules: set[str]) -> bool:
    return any(m == FORBIDDEN or m.startswith(FORBIDDEN + ".") for m in modules)


BENCH_FILES = sorted((PACKAGE / "bench").rglob("*.py"))
# The modules bench and serve take the engine flags from: they must stay below the CLI too.
SHARED_FILES = [PACKAGE / "engine_args.py", PACKAGE / "config.py", PACKAGE / "units.py", PACKAGE / "vocab.py"]


@pytest.mark.parametrize("path", BENCH_FILES + SHARED_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_does_not_import_the_cli(path: Path) -> None:
    assert not _imports_cli(module_imports(path)), f"{path.relative_to(PACKAGE.parent)} imports {FORBIDDEN}"


def test_the_bench_package_is_all_checked() -> None:
    names = {p.relative_to(PACKAGE).as_posix() for p in BENCH_FILES}
    assert {"bench/cli.py", "bench/suite.py", "bench/options.py", "bench/peers/hf.py"} <= names


@pytest.mark.parametrize("source", [
    "from kvserve.cli import build_parser",
    "def f():\n    from kvserve.cli import engine_config_from_args\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvserve.cli\n",
    "from kvserve import cli",
    "from ... import cli",
    "import importlib\nimportlib.import_module('kvserve.cli')",
], ids=["top-level", "function-local", "type-checking", "from-package", "relative", "import-module"])
def test_the_check_sees_every_kind_of_import(source: str) -> None:
    """The parser itself: each way a module of kvserve.bench.peers could reach the CLI is caught."""
    assert _imports_cli(imported_modules(source, "kvserve.bench.peers"))


def test_the_check_passes_the_engine_flags_module() -> None:
    assert not _imports_cli(imported_modules("from kvserve.engine_args import add_engine_args", "kvserve.bench"))
