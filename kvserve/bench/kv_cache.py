"""`kvserve bench kv-cache`: why a KV cache exists, measured. At each context length: the cost of one
decoded token reading the cached K/V, against recomputing the whole sequence to get that token (what a
model without a cache must do every step). The gap grows with the length; the plot shows both curves."""

from __future__ import annotations

import argparse
import random

from kvserve.bench.options import (
    add_engine_args,
    add_output_args,
    add_repeats_arg,
    int_list,
    new_command,
)

SCHEMA = """\
results: {"points": [{"context_len", "cached_ms_per_token", "cached_ms_runs", "recompute_ms_per_token",
                      "recompute_ms_runs", "speedup"}],
          "decode_tokens": int (decode steps averaged per cached run)}
ratios: {"speedup@<L>": recompute / cached at context length L}
cached: mean decode step time of one request whose prompt has L tokens; recompute: the time to the first
token of a fresh L-token prompt (one forward over all L tokens, no cache hit). Medians over --repeats."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "kv-cache",
        "decode cost with the KV cache vs recomputing the sequence, by length",
        __doc__.splitlines()[0],
        SCHEMA,
    )
    p.add_argument("--context-lens", type=int_list, default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--decode-tokens", type=int, default=8, help="decode steps timed per cached run")
    add_repeats_arg(p, default=3)
    add_output_args(p, "ms per generated token against context length, with and without the cache")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.common import load_kvserve
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.stats import median, ratio
    from kvserve.bench.systems import special_token_ids
    from kvserve.bench.workload import random_token_ids

    system = load_kvserve(args)
    engine = system.engine
    vocab, exclude = engine.core.model_config.vocab_size, special_token_ids(engine)
    rng = random.Random(args.seed)
    points = []
    table = Table(
        f"Per-token cost with and without the KV cache (medians of {args.repeats})",
        ["context", "cached ms/tok", "recompute ms/tok", "speedup"],
    )
    for length in args.context_lens:
        cached, recompute = [], []
        for _ in range(args.repeats):
            # Fresh prompts every time: a prefix-cache hit would make "recompute" compute nothing.
            cached_run = system.timed_generate([random_token_ids(rng, length, vocab, exclude)], args.decode_tokens + 1)
            cached.append(1e3 * (cached_run.decode_step_s or 0.0))
            recompute.append(1e3 * system.timed_generate([random_token_ids(rng, length, vocab, exclude)], 1).ttft_s)
        point = {
            "context_len": length,
            "cached_ms_per_token": median(cached),
            "cached_ms_runs": cached,
            "recompute_ms_per_token": median(recompute),
            "recompute_ms_runs": recompute,
        }
        point["speedup"] = ratio(point["recompute_ms_per_token"], point["cached_ms_per_token"])
        points.append(point)
        table.add(length, point["cached_ms_per_token"], point["recompute_ms_per_token"], point["speedup"])
    report = Report("kv-cache", machine_info(), config_of(args))
    report.results = {"points": points, "decode_tokens": args.decode_tokens}
    report.ratios = {f"speedup@{p['context_len']}": p["speedup"] for p in points}
    report.tables.append(table)
    if args.plot:
        from kvserve.bench.plot import Panel, Series, line_plot

        xs = [p["context_len"] for p in points]
        line_plot(
            args.plot,
            [
                Panel(
                    "Cost of one generated token",
                    "context length (tokens)",
                    "ms per token",
                    [
                        Series("with KV cache (decode step)", xs, [p["cached_ms_per_token"] for p in points]),
                        Series("without (recompute the sequence)", xs, [p["recompute_ms_per_token"] for p in points]),
                    ],
                    log_x=True,
                    log_y=True,
                )
            ],
        )
    emit(report, args.json)
    return 0
