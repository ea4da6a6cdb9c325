"""`kvserve bench`: registers one subcommand per module in BENCH_COMMANDS; a new benchmark (prefix,
kv-dtype, ...) is a module with `add_parser(bench_subparsers)` plus one line here."""

from __future__ import annotations

import argparse
import importlib

BENCH_COMMANDS: tuple[str, ...] = (
    "kvserve.bench.throughput",
    "kvserve.bench.latency",
    "kvserve.bench.serve",
    "kvserve.bench.kv_cache",
    "kvserve.bench.kv_dtype",
    "kvserve.bench.prefix",
    "kvserve.bench.offload",
    "kvserve.bench.long_context",
    "kvserve.bench.quantization",
    "kvserve.bench.memory",
    "kvserve.bench.structured",
    "kvserve.bench.spec",
    "kvserve.bench.router",
    "kvserve.bench.prompt_cache",
    "kvserve.bench.hybrid_chat",
    "kvserve.bench.agents",
    "kvserve.bench.suite",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks against peers (HF transformers, llama.cpp, any OpenAI server)",
        description="Benchmarks whose figures are ratios against a peer measured in the same run. "
        "Each command prints a table, takes --json [PATH] and --plot FILE.png.",
    )
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    for module in BENCH_COMMANDS:
        importlib.import_module(module).add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    """A parser of `kvserve bench ...` alone: `bench all` parses each quick command's flags with it, in process,
    without importing kvserve.cli (which imports this module: the dependency runs cli -> bench only)."""
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser
