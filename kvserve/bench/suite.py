"""`kvserve bench all`: the quick version of every bench command in one process (each one's own `run`, fed
its own flags), each writing its --json and --plot under --out-dir, then docs/BENCHMARKS.md's generated
tables rewritten from those JSON files (only between the `<!-- bench:NAME:start/end -->` markers)."""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench import cli as bench_cli

log = logging.getLogger(__name__)


ENGINE_FLAGS = ("--model", "--device", "--dtype", "--cpu-threads")


@dataclass(frozen=True, slots=True)
class QuickCommand:
    """A bench command and the flags of its quick version (smaller counts and lengths, one repeat)."""

    name: str
    args: tuple[str, ...]
    plot: bool = True  # draws a --plot
    engine_flags: tuple[str, ...] = ENGINE_FLAGS  # which of bench all's engine flags the command takes

    @property
    def stem(self) -> str:
        return self.name.replace("-", "_")


# Sized for the default model on 2 CPU cores, by estimate (not yet timed as a whole): under 20 minutes with the
# HF peer (loaded twice, about 2 minutes each), about 12 without (--no-peers). all.json records the seconds.
QUICK: tuple[QuickCommand, ...] = (
    QuickCommand(
        "throughput",
        (
            "--num-requests",
            "8",
            "--input-len",
            "32-128",
            "--output-len",
            "16-32",
            "--hf-max-batch-size",
            "8",
            "--kv-cache-memory-bytes",
            "1GiB",
        ),
    ),
    QuickCommand(
        "latency",
        (
            "--prompt-lens",
            "32,512",
            "--output-len",
            "8",
            "--batch-sizes",
            "1,8",
            "--batch-output-len",
            "8",
            "--repeats",
            "1",
            "--kv-cache-memory-bytes",
            "1GiB",
        ),
    ),
    QuickCommand(
        "kv-cache",
        ("--context-lens", "64,256,1024", "--decode-tokens", "4", "--repeats", "1", "--kv-cache-memory-bytes", "1GiB"),
    ),
    QuickCommand(
        "kv-dtype",
        (
            "--kv-dtypes",
            "float32,bfloat16,int8,fp8_e4m3",
            "--ppl-tokens",
            "500",
            "--greedy-prompts",
            "2",
            "--greedy-tokens",
            "16",
            "--decode-batch",
            "8",
            "--decode-context",
            "64",
            "--decode-tokens",
            "4",
        ),
        plot=False,
    ),
    QuickCommand(
        "prefix",
        (
            "--requests",
            "6",
            "--system-tokens",
            "256",
            "--turns",
            "4",
            "--output-len",
            "4",
            "--kv-cache-memory-bytes",
            "1GiB",
        ),
    ),
    QuickCommand(
        "offload",
        (
            "--users",
            "4",
            "--rounds",
            "3",
            "--system-tokens",
            "512",
            "--output-len",
            "8",
            "--pool-bytes",
            "32MiB",
            "--tier-bytes",
            "512MiB",
            "--restart-tokens",
            "2048",
            "--no-reuse-requests",
            "8",
            "--no-reuse-tokens",
            "256",
            "--accuracy-prompts",
            "2",
            "--accuracy-tokens",
            "256",
            "--accuracy-output",
            "16",
            "--repeats",
            "1",
        ),
    ),
    QuickCommand(
        "long-context",
        (
            "--throughput-requests",
            "6",
            "--throughput-prompt-len",
            "1024-2048",
            "--throughput-output-len",
            "8",
            "--throughput-pool",
            "160MiB",
            "--decode-context",
            "2048",
            "--decode-batches",
            "1,4",
            "--decode-steps",
            "8",
            "--chat-users",
            "3",
            "--chat-rounds",
            "3",
            "--chat-system-tokens",
            "768",
            "--chat-output-len",
            "8",
            "--chat-pool",
            "48MiB",
            "--chat-tier",
            "256MiB",
            "--repeats",
            "1",
        ),
    ),
    QuickCommand("memory", ()),  # its defaults are its quick version (a couple of minutes)
    QuickCommand(
        "quantization",
        (
            "--ppl-tokens",
            "500",
            "--greedy-prompts",
            "2",
            "--greedy-tokens",
            "16",
            "--prefill-len",
            "256",
            "--decode-batches",
            "1,8",
            "--decode-tokens",
            "8",
            "--repeats",
            "1",
            "--kv-cache-memory-bytes",
            "1GiB",
        ),
        plot=False,
    ),
    QuickCommand(
        "structured",
        (
            "--batch-sizes",
            "1,8",
            "--prompt-len",
            "32",
            "--output-len",
            "16",
            "--repeats",
            "1",
            "--compile-schemas",
            "3",
            "--ttft-repeats",
            "3",
            "--kv-cache-memory-bytes",
            "1GiB",
        ),
    ),
    QuickCommand(
        "spec",
        (
            "--workloads",
            "code-edit,story",
            "--batch-sizes",
            "1,8",
            "--output-len",
            "16",
            "--repeats",
            "1",
            "--kv-cache-memory-bytes",
            "1GiB",
        ),
    ),
    QuickCommand("serve", ("--num-prompts", "8", "--max-tokens", "16", "--max-concurrency", "1,8"), engine_flags=()),
    # Starts Ray and four `kvserve serve` processes (about 3 minutes); its full version is documented in
    # BENCHMARKS.md. The replicas run on the model and threads given, not on a device or dtype of bench all's.
    QuickCommand(
        "router",
        (
            "--num-tenants",
            "4",
            "--prefix-tokens",
            "256",
            "--num-requests",
            "24",
            "--request-rate",
            "1.5",
            "--max-tokens",
            "8",
        ),
        engine_flags=("--model", "--cpu-threads"),
    ),
)
NAMES = tuple(q.name for q in QUICK)
MANIFEST = "all.json"

DESCRIPTION = """\
Runs the quick version of every bench command (fewer requests, shorter lengths, mostly one repeat; --dry-run
prints them) in this process, each writing its --json and --plot under --out-dir, then rewrites the tables
of --docs between its <!-- bench:NAME:start --> and <!-- bench:NAME:end --> markers from those JSON files.
Prose outside the markers is never touched. A failing command is recorded and the others still run."""
SCHEMA = """\
JSON schema of the manifest --out-dir/all.json (bench all's own record; each command's --json and --plot
files keep their own schemas). Merged with the previous manifest, so --only keeps the other commands':
{"schema": "kvserve.bench.all/1", "created_utc", "total_s", "commands": {NAME: {"command", "json",
 "plot" (null for kv-dtype), "ok", "skipped" (why, or null), "error" (or null), "elapsed_s"}}}"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "all",
        help="quick versions of every bench command, then regenerate docs/BENCHMARKS.md's tables",
        description=DESCRIPTION,
        epilog=SCHEMA,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"), help="where each command's JSON and PNG go")
    p.add_argument(
        "--docs", type=Path, default=Path("docs/BENCHMARKS.md"), help="the page whose marked tables are regenerated"
    )
    p.add_argument(
        "--only",
        type=names_list,
        default=list(NAMES),
        metavar="NAME,...",
        help=f"run only these commands (of {','.join(NAMES)})",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands and the docs sections, run nothing")
    p.add_argument(
        "--docs-only",
        action="store_true",
        help="run nothing; regenerate the docs from the JSON files already in --out-dir",
    )
    p.add_argument("--no-docs", action="store_true", help="leave the docs alone")
    p.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="extra flags for one command, after its quick ones so they win, e.g. "
        "--args 'memory=--num-requests 64'; NAME `engine`: every engine-backed command, e.g. "
        "--args 'engine=--kv-cache-dtype int8' (repeatable)",
    )
    p.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure HF transformers in throughput and latency (about 2 minutes of loading each)",
    )
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench, for latency")
    p.add_argument("--url", default=None, help="a running server for `bench serve` (skipped without one)")
    p.add_argument("--peer-url", default=None, help="a second server for `bench serve`")
    e = p.add_argument_group("engine flags passed to every engine-backed command")
    e.add_argument("--model", default=None)
    e.add_argument("--device", default=None)
    e.add_argument("--dtype", default=None)
    e.add_argument("--cpu-threads", default=None)
    p.set_defaults(func=run)


def names_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(NAMES))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown bench command(s) {', '.join(unknown) or text!r}; choose from {', '.join(NAMES)}"
        )
    return names


@dataclass(slots=True)
class Step:
    """One command to run: its argv after `kvserve bench`, its output files, or why it is skipped."""

    quick: QuickCommand
    argv: list[str]
    json_path: Path
    plot_path: Path | None
    skipped: str | None = None

    @property
    def command(self) -> str:
        return "kvserve bench " + shlex.join(self.argv)


@dataclass(slots=True)
class Outcome:
    command: str
    json: str
    plot: str | None
    ok: bool = False
    skipped: str | None = None
    error: str | None = None
    elapsed_s: float = 0.0

    def to_json(self) -> dict:
        return {
            "command": self.command,
            "json": self.json,
            "plot": self.plot,
            "ok": self.ok,
            "skipped": self.skipped,
            "error": self.error,
            "elapsed_s": self.elapsed_s,
        }


def extra_flags(specs: list[str]) -> dict[str, list[str]]:
    """--args NAME=FLAGS, accumulated per command."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or name not in (*NAMES, "engine"):
            raise ValueError(f"--args {spec!r}: expected NAME=FLAGS with NAME one of {', '.join(NAMES)} or engine")
        out.setdefault(name, []).extend(shlex.split(flags))
    return out


def plan(args: argparse.Namespace) -> list[Step]:
    """The steps of this invocation, in the suite's order, each argv checked by the command's own parser."""
    extra = extra_flags(args.args)
    chosen = dict(zip(ENGINE_FLAGS, (args.model, args.device, args.dtype, args.cpu_threads), strict=True))
    steps = []
    for quick in QUICK:
        if quick.name not in args.only:
            continue
        json_path = args.out_dir / f"{quick.stem}.json"
        plot_path = args.out_dir / f"{quick.stem}.png" if quick.plot else None
        engine = [f for flag in quick.engine_flags if chosen[flag] is not None for f in (flag, str(chosen[flag]))]
        if quick.engine_flags == ENGINE_FLAGS:  # --args engine=... goes to the in-process engine commands only
            engine += extra.get("engine", [])
        argv = [
            quick.name,
            *quick.args,
            *peer_flags(quick.name, args),
            *engine,
            *extra.get(quick.name, []),
            "--json",
            str(json_path),
        ]
        if plot_path is not None:
            argv += ["--plot", str(plot_path)]
        skipped = None
        if quick.name == "serve":
            if args.url is None:
                skipped = "no --url given (start `kvserve serve` and pass --url to measure serving)"
            else:
                argv[1:1] = ["--url", args.url] + (["--peer-url", args.peer_url] if args.peer_url else [])
        elif quick.name == "router" and importlib.util.find_spec("ray") is None:
            skipped = "Ray is not installed (pip install -e '.[cluster]')"
        steps.append(Step(quick, argv, json_path, plot_path, skipped))
        if skipped is None:
            parse(argv)  # a typo in --args fails now, not twenty minutes in
    return steps


def peer_flags(name: str, args: argparse.Namespace) -> list[str]:
    flags = ["--peer", "hf"] if args.peers and name in ("throughput", "latency") else []
    if name == "latency" and args.llama_bench:
        flags += ["--peer", "llama-cpp", "--llama-bench", args.llama_bench]
    return flags


def parse(argv: list[str]) -> argparse.Namespace:
    try:
        return bench_cli.build_parser().parse_args(["bench", *argv])
    except SystemExit as e:  # argparse has printed why
        raise ValueError(f"invalid flags for `kvserve bench {shlex.join(argv)}`") from e


def execute(step: Step) -> Outcome:
    """Run one command in this process; a failure is recorded, never raised, so that the rest still run."""
    outcome = Outcome(
        step.command, str(step.json_path), str(step.plot_path) if step.plot_path else None, skipped=step.skipped
    )
    if step.skipped:
        print(f"bench all: {step.quick.name} skipped: {step.skipped}", file=sys.stderr)
        return outcome
    print(f"bench all: {step.command}", file=sys.stderr)
    start = time.perf_counter()
    try:
        args = parse(step.argv)
        code = args.func(args)
        outcome.ok = code == 0
        outcome.error = None if code == 0 else f"exit status {code}"
    except Exception as e:  # one broken benchmark must not cost the others their figures
        log.exception("bench %s failed", step.quick.name)
        outcome.error = f"{type(e).__name__}: {e}"
    finally:
        gc.collect()  # the engines (and an HF peer) of this command go before the next loads its own
    outcome.elapsed_s = time.perf_counter() - start
    print(
        f"bench all: {step.quick.name} {'done' if outcome.ok else 'FAILED'} in {outcome.elapsed_s:.0f} s",
        file=sys.stderr,
    )
    return outcome


def run(args: argparse.Namespace) -> int:
    steps = plan(args)
    if not (args.no_docs or args.docs.exists()):
        raise FileNotFoundError(f"--docs {args.docs} does not exist (or pass --no-docs)")
    if args.dry_run:
        dry_run(steps, args)
        return 0
    manifest = read_manifest(args.out_dir)
    fresh = steps  # --docs-only: whatever JSON --out-dir holds
    if not args.docs_only:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        for step in steps:
            manifest["commands"][step.quick.name] = execute(step).to_json()
        manifest.update(created_utc=_now(), total_s=time.perf_counter() - start)
        (args.out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        print(summary(steps, manifest))
        fresh = [s for s in steps if manifest["commands"][s.quick.name]["ok"]]  # never a failed run's stale JSON
    if not args.no_docs:
        regenerate_docs(args.docs, fresh, manifest)
    failed = [s for s in steps if not args.docs_only and not s.skipped and s not in fresh]
    return 1 if failed else 0


def dry_run(steps: list[Step], args: argparse.Namespace) -> None:
    from kvserve.bench.docs import marked_names

    marked = set(marked_names(args.docs.read_text(encoding="utf-8"))) if not args.no_docs else set()
    for step in steps:
        print(f"# skipped: {step.skipped}" if step.skipped else step.command)
    if not args.no_docs:
        names = [s.quick.name for s in steps if not s.skipped]
        unmarked = [n for n in names if n not in marked]
        print(
            f"# would rewrite in {args.docs}: {', '.join(n for n in names if n in marked) or 'nothing'}"
            + (f"; no markers for {', '.join(unmarked)}" if unmarked else "")
        )


def read_manifest(out_dir: Path) -> dict:
    path = out_dir / MANIFEST
    if path.exists():
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("schema") == "kvserve.bench.all/1":
            return doc
    return {"schema": "kvserve.bench.all/1", "created_utc": _now(), "total_s": 0.0, "commands": {}}


def regenerate_docs(docs: Path, steps: list[Step], manifest: dict) -> list[str]:
    """Rewrite the marked section of every step whose JSON exists; returns the names rewritten."""
    from kvserve.bench.docs import render_section, update_sections

    sections = {}
    for step in steps:
        if step.json_path.exists():
            doc = json.loads(step.json_path.read_text(encoding="utf-8"))
            rel = os.path.relpath(step.json_path, docs.parent)
            command = manifest["commands"].get(step.quick.name, {}).get("command")
            sections[step.quick.name] = render_section(doc, rel, command)
    text, missing = update_sections(docs.read_text(encoding="utf-8"), sections)
    docs.write_text(text, encoding="utf-8")
    done = [n for n in sections if n not in missing]
    print(
        f"bench all: rewrote {', '.join(done) or 'no'} section(s) of {docs}"
        + (
            f"; no markers for {', '.join(missing)} (add <!-- bench:NAME:start/end --> to place them)"
            if missing
            else ""
        ),
        file=sys.stderr,
    )
    return done


def summary(steps: list[Step], manifest: dict) -> str:
    from kvserve.bench.report import Table

    t = Table(f"kvserve bench all: {manifest['total_s']:.0f} s in all", ["command", "status", "seconds", "json"])
    for step in steps:
        o = manifest["commands"][step.quick.name]
        status = "skipped" if o["skipped"] else "ok" if o["ok"] else f"failed: {o['error']}"
        t.add(step.quick.name, status, o["elapsed_s"], o["json"])
    return t.render()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
