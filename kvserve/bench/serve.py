"""`kvserve bench serve`: load an OpenAI-compatible server with streaming completions and report TTFT,
inter-token and end-to-end latency percentiles, output tokens/s and failures; `--peer-url` measures a
second server in the same invocation, alternating rounds with the first, and prints the ratio."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.bench.options import (
    add_output_args,
    add_repeats_arg,
    int_list,
    new_command,
)
from kvserve.bench.workload import TokenRange

if TYPE_CHECKING:
    from kvserve.bench.plot import Series
    from kvserve.bench.report import Table
    from kvserve.bench.serve_client import Endpoint, LoadRun

SCHEMA = """\
results: {
  "workload": {"num_prompts", "prompt_words": "LOW-HIGH", "max_tokens", "ignore_eos", "request_rate",
               "seed"},
  "levels": [{"server": "target" | "peer", "url", "model", "max_concurrency", "request_rate",
              "rounds": [{"duration_s", "output_tokens_per_s", "completed", "failed"}],
              "completed", "failed", "errors": [str] (distinct, at most 5),
              "output_tokens_per_s", "requests_per_s" (medians over rounds),
              "ttft_ms", "itl_ms", "e2e_ms": {"count", "mean", "p50", "p90", "p99", "min", "max"} | null
              (over every completed request of every round)}]}
ratios: {"output_tokens_per_s@c<C>:target/peer"} (> 1: the --url server is faster)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "serve",
        "streaming load against an OpenAI-compatible server (and a peer server)",
        __doc__.splitlines()[0],
        SCHEMA,
    )
    p.add_argument("--url", required=True, help="base URL of the server under test, e.g. http://127.0.0.1:8000")
    p.add_argument("--peer-url", default=None, help="a second server measured in the same run, in alternate rounds")
    p.add_argument("--model-name", default=None, help="`model` field for --url (default: first of /v1/models)")
    p.add_argument("--peer-model-name", default=None, help="`model` field for --peer-url")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLM_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY or $VLLM_API_KEY)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=32)
    w.add_argument("--prompt-words", type=TokenRange.parse, default=TokenRange(48, 200), metavar="LOW-HIGH")
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    w.add_argument(
        "--max-concurrency",
        type=int_list,
        default=[1, 8, 32],
        help="concurrency levels, one measurement each (default 1,8,32)",
    )
    w.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default inf: all at once, capped by the concurrency)",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    w.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each measurement")
    add_repeats_arg(p, default=1)
    add_output_args(p, "output tokens/s and TTFT p50 against concurrency, per server")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, config_of, emit
    from kvserve.bench.serve_client import Endpoint, run_load
    from kvserve.bench.workload import random_word_prompts

    servers = [("target", Endpoint(args.url, args.model_name, args.api_key))]
    if args.peer_url:
        servers.append(("peer", Endpoint(args.peer_url, args.peer_model_name, args.api_key)))
    prompts = random_word_prompts(args.num_prompts + args.warmup, args.prompt_words, args.seed)
    warm, measured = prompts[: args.warmup], prompts[args.warmup :]
    runs: dict[tuple[str, int], list[LoadRun]] = {}
    for round_index in range(args.repeats):
        for concurrency in args.max_concurrency:
            for name, endpoint in servers:
                run_ = asyncio.run(
                    run_load(
                        endpoint,
                        warm + measured,
                        args.max_tokens,
                        args.ignore_eos,
                        concurrency,
                        args.request_rate,
                        args.seed + round_index,
                        args.timeout,
                        warmup=args.warmup,
                    )
                )
                runs.setdefault((name, concurrency), []).append(run_)
    levels = [level_row(name, dict(servers)[name], c, args.request_rate, rs) for (name, c), rs in runs.items()]
    report = Report(
        "serve",
        machine_info(),
        config_of(args, skip=("func", "json", "plot", "log_level", "command", "bench_command", "api_key")),
    )
    report.results = {
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_words": str(args.prompt_words),
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "request_rate": None if args.request_rate == float("inf") else args.request_rate,
            "seed": args.seed,
        },
        "levels": levels,
    }
    report.ratios = ratios(levels)
    report.tables.append(table(levels, args))
    if args.plot:
        plot(args.plot, levels)
    emit(report, args.json)
    return 0


def level_row(server: str, endpoint: Endpoint, concurrency: int, rate: float, runs: list[LoadRun]) -> dict:
    from kvserve.bench.stats import median, summarize

    done = [r for run_ in runs for r in run_.completed]
    failures = [r for run_ in runs for r in run_.results if not r.ok]

    def dist(values: list[float]) -> dict | None:
        s = summarize([1e3 * v for v in values])
        return s.to_json() if s else None

    return {
        "server": server,
        "url": endpoint.base_url,
        "model": runs[0].model,
        "max_concurrency": concurrency,
        "request_rate": None if rate == float("inf") else rate,
        "rounds": [
            {
                "duration_s": r.duration_s,
                "output_tokens_per_s": r.output_tokens / r.duration_s,
                "completed": len(r.completed),
                "failed": len(r.results) - len(r.completed),
            }
            for r in runs
        ],
        "completed": len(done),
        "failed": len(failures),
        "errors": list(dict.fromkeys(str(r.error) for r in failures))[:5],
        "output_tokens_per_s": median([r.output_tokens / r.duration_s for r in runs]),
        "requests_per_s": median([len(r.completed) / r.duration_s for r in runs]),
        "ttft_ms": dist([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_ms": dist([gap for r in done for gap in r.itl_s]),
        "e2e_ms": dist([r.e2e_s for r in done]),
    }


def ratios(levels: list[dict]) -> dict[str, float | None]:
    from kvserve.bench.stats import ratio

    by = {(r["server"], r["max_concurrency"]): r for r in levels}
    return {
        f"output_tokens_per_s@c{c}:target/peer": ratio(r["output_tokens_per_s"], by[("peer", c)]["output_tokens_per_s"])
        for (server, c), r in by.items()
        if server == "target" and ("peer", c) in by
    }


def table(levels: list[dict], args: argparse.Namespace) -> Table:
    from kvserve.bench.report import Table

    def p(dist: dict | None, key: str) -> float | None:
        return dist[key] if dist else None

    t = Table(
        f"Streaming load: {args.num_prompts} prompts of {args.prompt_words} words, {args.max_tokens} new tokens"
        f"{' (ignore_eos)' if args.ignore_eos else ''}, medians of {args.repeats} round(s)",
        [
            "server",
            "conc",
            "ok",
            "failed",
            "out tok/s",
            "TTFT p50",
            "TTFT p90",
            "TTFT p99",
            "ITL p50",
            "ITL p90",
            "ITL p99",
            "E2E p50",
            "E2E p90",
            "E2E p99",
        ],
    )
    for r in sorted(levels, key=lambda r: (r["max_concurrency"], r["server"] != "target")):
        t.add(
            r["server"],
            r["max_concurrency"],
            r["completed"],
            r["failed"],
            r["output_tokens_per_s"],
            *(p(r[k], q) for k in ("ttft_ms", "itl_ms", "e2e_ms") for q in ("p50", "p90", "p99")),
        )
    return t


def plot(path: str, levels: list[dict]) -> None:
    from kvserve.bench.plot import Panel, Series, line_plot

    def series(key: str, pick: Callable[[Any], float | None]) -> list[Series]:
        out = []
        for server in dict.fromkeys(r["server"] for r in levels):
            rows = sorted((r for r in levels if r["server"] == server), key=lambda r: r["max_concurrency"])
            label = f"{server} ({rows[0]['url']})"
            out.append(Series(label, [r["max_concurrency"] for r in rows], [pick(r[key]) for r in rows]))
        return out

    line_plot(
        path,
        [
            Panel(
                "Output throughput",
                "max concurrency",
                "output tokens/s",
                series("output_tokens_per_s", lambda v: v),
                log_x=True,
            ),
            Panel(
                "Time to first token (p50)",
                "max concurrency",
                "ms",
                series("ttft_ms", lambda d: d["p50"] if d else None),
                log_x=True,
            ),
        ],
    )
