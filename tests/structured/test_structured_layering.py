"""kvserve.structured imports downward only: the engine and the server plug it in, never the other way round.
Read with ast, so an import under TYPE_CHECKING or inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve.structured

FORBIDDEN = ("kvserve.engine", "kvserve.server", "kvserve.bench", "kvserve.cli", "kvserve.tools")


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: use absolute imports"
            names.add(node.module or "")
    return names


def test_structured_imports_downward_only() -> None:
    root = Path(kvserve.structured.__file__).parent
    found = [
        f"{path.name} imports {name}"
        for path in sorted(root.glob("*.py"))
        for name in imports_of(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert not found
