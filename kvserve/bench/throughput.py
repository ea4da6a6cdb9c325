"""`kvserve bench throughput`: offline throughput on random-token requests submitted all at once (the
method of vLLM's and nano-vllm's throughput benchmarks, scaled to a CPU), against HF transformers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvserve.bench.options import (
    add_engine_args,
    add_output_args,
    add_repeats_arg,
    new_command,
)
from kvserve.bench.workload import TokenRange, TokenRequest

if TYPE_CHECKING:
    from kvserve.bench.systems import System

SCHEMA = """\
results: {
  "workload": {"num_requests", "input_len": "LOW-HIGH", "output_len": "LOW-HIGH", "seed"},
  "systems": [{"system": "kvserve" | "hf" | "kvserve-int8", "runs": [{"elapsed_s", "prompt_tokens", "output_tokens",
               "generated_tokens"}], "elapsed_s", "output_tokens_per_s", "total_tokens_per_s",
               "requests_per_s" (medians over runs), "batch_size": int | null (hf's static batch)}],
  "hf_batch_probes": [{"batch_size", "projected_tokens_per_s"}]}
ratios: {"output_tokens_per_s:kvserve/<peer>", "total_tokens_per_s:kvserve/<peer>"} (> 1: kvserve is faster); with
         --peer kvserve-int8 the same with kvserve-int8 in kvserve's place, against every other system
Output tokens count what the requests asked for; hf's padding waste is in generated_tokens only."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "throughput",
        "offline throughput: N random requests at once, vs HF transformers",
        __doc__.splitlines()[0],
        SCHEMA,
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument(
        "--input-len",
        type=TokenRange.parse,
        default=TokenRange(32, 512),
        metavar="LOW-HIGH",
        help="prompt lengths in tokens, drawn uniformly (default 32-512)",
    )
    w.add_argument(
        "--output-len",
        type=TokenRange.parse,
        default=TokenRange(32, 256),
        metavar="LOW-HIGH",
        help="output lengths in tokens, drawn uniformly, EOS ignored (default 32-256)",
    )
    w.add_argument(
        "--peer",
        action="append",
        choices=["hf", "kvserve-int8"],
        default=[],
        help="run the same requests through HF transformers generate (hf) or kvserve on the same flags with "
        "--activation-quantization int8 (kvserve-int8) in the same run (repeatable)",
    )
    w.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="HF's static batch size (default: probe powers of two and take the fastest)",
    )
    w.add_argument("--hf-max-batch-size", type=int, default=64, help="largest batch size the probe tries")
    add_repeats_arg(p, default=1)
    add_output_args(p, "bar chart of output and total tokens/s per system")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.common import INT8_PEER, alternate, load_hf_peer, load_int8_activation_peer, load_kvserve
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.stats import median, ratio
    from kvserve.bench.systems import ThroughputRun, special_token_ids
    from kvserve.bench.workload import random_token_requests

    kvserve = load_kvserve(args)
    engine = kvserve.engine
    exclude = special_token_ids(engine)

    def workload(round_index: int) -> list[TokenRequest]:
        # A fresh draw each round: repeating prompts would turn later rounds into prefix-cache hits.
        return random_token_requests(
            args.num_requests,
            args.input_len,
            args.output_len,
            engine.core.model_config.vocab_size,
            args.seed + round_index,
            exclude,
        )

    systems: list[System] = [kvserve]
    probes = []
    if "hf" in args.peer:
        peer = load_hf_peer(args, kvserve)
        if args.hf_batch_size is not None:
            peer.batch_size = args.hf_batch_size
        else:
            limit = min(args.num_requests, args.hf_max_batch_size)
            candidates = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
            probes = peer.choose_batch_size(workload(0), candidates)
        systems.append(peer)
    if INT8_PEER in args.peer:
        systems.append(load_int8_activation_peer(args))
    runs: dict[str, list[ThroughputRun]] = alternate(systems, args.repeats, lambda s, r: s.run_requests(workload(r)))

    report = Report("throughput", machine_info(), config_of(args))
    rows: list[dict[str, Any]] = []
    table = Table(
        f"Offline throughput: {args.num_requests} requests, input {args.input_len}, output "
        f"{args.output_len} tokens (medians of {args.repeats} run(s))",
        ["system", "batch", "elapsed s", "output tok/s", "total tok/s", "req/s"],
    )
    for system in systems:
        rs = runs[system.name]
        row = {
            "system": system.name,
            "runs": [r.to_json() for r in rs],
            "elapsed_s": median([r.elapsed_s for r in rs]),
            "output_tokens_per_s": median([r.output_tokens / r.elapsed_s for r in rs]),
            "total_tokens_per_s": median([(r.output_tokens + r.prompt_tokens) / r.elapsed_s for r in rs]),
            "requests_per_s": median([args.num_requests / r.elapsed_s for r in rs]),
            "batch_size": getattr(system, "batch_size", None),
        }
        rows.append(row)
        table.add(
            system.name,
            row["batch_size"] or "continuous",
            row["elapsed_s"],
            row["output_tokens_per_s"],
            row["total_tokens_per_s"],
            row["requests_per_s"],
        )
    report.results = {
        "workload": {
            "num_requests": args.num_requests,
            "input_len": str(args.input_len),
            "output_len": str(args.output_len),
            "seed": args.seed,
        },
        "systems": rows,
        "hf_batch_probes": [
            {"batch_size": p.batch_size, "projected_tokens_per_s": p.projected_tokens_per_s} for p in probes
        ],
    }
    report.tables.append(table)
    by_name = {r["system"]: r for r in rows}
    pairs = [("kvserve", r["system"]) for r in rows[1:]]
    if INT8_PEER in by_name:  # int8 activations against every other system, kvserve's exact path included
        pairs += [(INT8_PEER, r["system"]) for r in rows if r["system"] != INT8_PEER]
    for mine, other in pairs:
        for key in ("output_tokens_per_s", "total_tokens_per_s"):
            report.ratios[f"{key}:{mine}/{other}"] = ratio(by_name[mine][key], by_name[other][key])
    if probes:
        report.notes.append(
            "HF batch size chosen by probing: "
            + ", ".join(f"{p.batch_size}: {p.projected_tokens_per_s:.1f} tok/s" for p in probes)
        )
    if args.plot:
        from kvserve.bench.plot import Series, bar_plot

        names = [r["system"] for r in rows]
        title = f"Offline throughput, {args.num_requests} requests (in {args.input_len}, out {args.output_len})"
        bar_plot(
            args.plot,
            title,
            "tokens/s",
            names,
            [
                Series("output tokens/s", range(len(rows)), [r["output_tokens_per_s"] for r in rows]),
                Series("total tokens/s", range(len(rows)), [r["total_tokens_per_s"] for r in rows]),
            ],
        )
    emit(report, args.json)
    return 0
