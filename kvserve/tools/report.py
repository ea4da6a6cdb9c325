"""Output helpers shared by the capacity commands (and `kvserve generate`): the `--json [PATH]` convention, sizes,
plain tables."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvserve.units import parse_size


def add_json_arg(parser: argparse.ArgumentParser, schema: str) -> None:
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help=f"JSON output: on stdout instead of the table (no PATH or -), or into PATH with the "
        f"table on stdout. Schema: {schema}",
    )


def emit(doc: dict[str, Any] | list[Any], text: str, json_target: str | None) -> None:
    """Print the table, the JSON, or the table with the JSON written to a file."""
    if json_target in ("-", ""):
        print(json.dumps(doc, indent=2))
        return
    print(text)
    if json_target is not None:
        with open(json_target, "w") as f:
            f.write(json.dumps(doc, indent=2) + "\n")


def int_list(value: str) -> list[int]:
    """'1024,4k,32768' -> [1024, 4096, 32768] (k = 1024 tokens, as context lengths are usually quoted)."""
    out = []
    for part in value.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        number = int(part.removesuffix("k")) * scale
        if number < 1:
            raise argparse.ArgumentTypeError(f"{value!r}: every entry must be >= 1")
        out.append(number)
    return out


def size_arg(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A right-aligned plain-text table (first column left-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
