"""Flags every bench command shares, defined once."""

from __future__ import annotations

import argparse

from kvserve import engine_args


def int_list(text: str) -> list[int]:
    """Parse "1,8,32" into [1, 8, 32]."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def add_output_args(parser: argparse.ArgumentParser, plot_help: str) -> None:
    g = parser.add_argument_group("output")
    g.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="JSON output (schema below): on stdout instead of the table (no PATH or -), "
        "or into PATH with the table still on stdout",
    )
    g.add_argument("--plot", default=None, metavar="FILE.png", help=plot_help)


def add_repeats_arg(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument(
        "--repeats",
        type=int,
        default=default,
        help="measured runs per figure, alternating between systems; figures are medians",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """kvserve's engine flags, the same as `kvserve generate` (the --seed there also seeds the workload)."""
    engine_args.add_engine_args(parser)


def new_command(
    sub: argparse._SubParsersAction, name: str, summary: str, description: str, schema: str
) -> argparse.ArgumentParser:
    """A bench subcommand whose --help ends with its JSON schema."""
    return sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog="JSON schema (--json), inside the common envelope {schema, command, created_utc, "
        "machine, config, results, ratios, notes, tables}:\n" + schema,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
