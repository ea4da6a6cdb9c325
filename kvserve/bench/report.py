"""One report per bench command: tables for people, one JSON document for tools, same figures in both.

JSON envelope, shared by every subcommand (the command-specific part is `results`):
  {"schema": "kvserve.bench.<command>/1", "command", "created_utc", "machine": {cpu_model, logical_cpus,
   torch_threads, memory_gib, python, torch, transformers, platform}, "config": {flag: value},
   "results": {...}, "ratios": {name: float | null}, "notes": [str],
   "tables": [{"title", "columns": [str], "rows": [[cell]]}] (the printed tables, raw cells; `bench all`
   writes docs/BENCHMARKS.md's tables from them)}
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvserve.bench.machine import MachineInfo

SCHEMA_VERSION = 1


@dataclass(slots=True)
class Table:
    """A titled grid of cells; floats are printed with a precision that suits their size."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: row has {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.rows}

    def render(self) -> str:
        cells = [self.columns] + [[format_cell(c) for c in row] for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [self.title]
        for n, row in enumerate(cells):
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        magnitude = abs(value)
        digits = 1 if magnitude >= 100 else 2 if magnitude >= 1 else 3
        return f"{value:.{digits}f}"
    return str(value)


@dataclass(slots=True)
class Report:
    command: str
    machine: MachineInfo
    config: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": f"kvserve.bench.{self.command}/{SCHEMA_VERSION}",
            "command": self.command,
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": self.machine.to_json(),
            "config": self.config,
            "results": self.results,
            "ratios": self.ratios,
            "notes": self.notes,
            "tables": [t.to_json() for t in self.tables],
        }

    def render(self) -> str:
        parts = [f"kvserve bench {self.command} on {self.machine.describe()}"]
        parts += [t.render() for t in self.tables]
        if self.ratios:
            parts.append("Ratios (same run): " + ", ".join(f"{k} = {format_cell(v)}" for k, v in self.ratios.items()))
        parts += [f"Note: {n}" for n in self.notes]
        return "\n\n".join(parts)


def emit(report: Report, json_target: str | None, stdout: TextIO | None = None) -> None:
    """DESIGN.md's convention: no --json: the tables; `--json` or `--json -`: only JSON on stdout;
    `--json PATH`: the tables on stdout and the JSON in PATH."""
    out = stdout or sys.stdout
    text = json.dumps(report.to_json(), indent=2, allow_nan=False)
    if json_target in ("-", ""):
        out.write(text + "\n")
        return
    out.write(report.render() + "\n")
    if json_target is not None:
        with open(json_target, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def config_of(
    args: Any, skip: Sequence[str] = ("func", "json", "plot", "log_level", "command", "bench_command")
) -> dict:
    """The flags a report was produced with, JSON-safe, so that a figure carries its exact command."""
    out = {}
    for key, value in sorted(vars(args).items()):
        if key in skip:
            continue
        finite = not isinstance(value, float) or math.isfinite(value)  # strict JSON has no inf/nan
        out[key] = value if finite and isinstance(value, (int, float, str, bool, type(None), list)) else str(value)
    return out
