"""Lower layers never import upper ones: kv/ serves the engine and must not know it (review of 2026-11-30: the
KV manager imported engine.request). The check reads the source with ast, so an import hidden under
TYPE_CHECKING, inside a function or behind importlib still counts."""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve

PACKAGE_ROOT = Path(kvserve.__file__).parent
KV_MUST_NOT_IMPORT = ("kvserve.engine", "kvserve.server", "kvserve.bench", "kvserve.cli")


def module_name(path: Path) -> str:
    """kvserve/kv/pool.py -> kvserve.kv.pool; a package's __init__.py -> the package."""
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute name behind `from <dots><module> import ...` written in module `importer`."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base[:len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([module] if module else []))


def imported_names(source: str, importer: str, is_package: bool = False) -> set[str]:
    """Every module name an import anywhere in `source` may load: `import a.b`, `from a import b` (a and a.b),
    relative imports resolved, and importlib.import_module / __import__ calls with a literal name."""
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


def forbidden_imports(package: str, forbidden: tuple[str, ...]) -> list[str]:
    """'module imports name' for each import of a forbidden package (or one of its modules) in `package`."""
    found = []
    for path in sorted((PACKAGE_ROOT.parent / package.replace(".", "/")).rglob("*.py")):
        importer = module_name(path)
        for name in sorted(imported_names(path.read_text(), importer, path.name == "__init__.py")):
            if is_forbidden(name, forbidden):
                found.append(f"{importer} imports {name}")
    return found


def test_kv_imports_nothing_above_it() -> None:
    assert forbidden_imports("kvserve.kv", KV_MUST_NOT_IMPORT) == []


def test_the_check_sees_hidden_imports() -> None:
    """Not vacuous: imports under TYPE_CHECKING, inside functions, relative or through importlib are found."""
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
    assert {"kvserve.engine.request", "kvserve.server.app", "kvserve.cli", "kvserve.bench.suite",
            "kvserve.kv.pool"} <= names
    assert sum(is_forbidden(n, KV_MUST_NOT_IMPORT) for n in names) >= 4
    assert not is_forbidden("kvserve.engineering", KV_MUST_NOT_IMPORT) and not is_forbidden("kvserve.kv.pool",
                                                                                             KV_MUST_NOT_IMPORT)
