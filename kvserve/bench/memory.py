"""`kvserve bench memory`: what paging the KV cache buys at a fixed budget. Requests of a long-tailed length
distribution (lognormal, mean 500 tokens, clipped at max-model-len 8192) either take whole blocks as they
grow (the paged cache) or reserve max-model-len each up front (a contiguous cache, as before PagedAttention
and in HF's static cache). First computed from the capacity plan: requests that fit at once and the share of
reserved KV that holds no token. Then measured: the same engine runs the same requests twice at one budget,
paged and with every request reserving max-model-len blocks at admission, reporting how many ran at once and
the output tokens/s of each. The measured run shrinks the budget, max-model-len and lengths by --scale so it
finishes in minutes on a CPU; the shape of the workload, and so the concurrency ratio, stays."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvserve.bench.options import add_engine_args, add_output_args, add_repeats_arg, new_command
from kvserve.bench.workload import TokenRequest
from kvserve.units import GiB, format_bytes

if TYPE_CHECKING:
    from kvserve.bench.report import Table
    from kvserve.bench.workload import LengthDistribution
    from kvserve.capacity import CacheLayoutUse
    from kvserve.engine.engine import LLMEngine

LAYOUTS = ("paged", "reserved")

SCHEMA = """\
results: {
  "analytic": PLAN = {"budget_bytes", "num_blocks", "block_size", "bytes_per_token", "max_model_len",
      "lengths": {"mean_target", "sigma", "output_share", "summary": {count, mean, p50, p90, p99, min, max}},
      "paged": {"kv_tokens_per_request", "requests_that_fit", "waste_perc"}, "reserved": {... same keys ...}},
  "measured": {"scale", "num_requests", "prompt_tokens", "output_tokens",
      "plan": PLAN (the same figures for the measured requests at the scaled budget),
      "layouts": [{"layout": "paged" | "reserved", "runs": [{"elapsed_s", "output_tokens", "steps", "max_running",
                   "mean_running", "peak_kv_usage_perc", "waste_perc", "preemptions"}],
                   "max_running", "preemptions" (max over runs), "mean_running", "waste_perc", "elapsed_s",
                   "output_tokens_per_s" (medians over runs)}]}}
ratios: {"concurrency:paged/reserved" (analytic), "measured_concurrency:paged/reserved",
         "output_tokens_per_s:paged/reserved"} (> 1: paging lets more requests run / run faster)
waste_perc: KV slots reserved but holding no token, as a share of the reserved slots (analytic: over the
sampled requests at their full length; measured: over the running requests after each step, step-weighted).
requests_that_fit: budget / the mean KV one request takes (paged: its length rounded up to whole blocks;
reserved: max-model-len). max_running: requests holding KV at once, as vLLM's num_requests_running."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub, "memory", "requests that fit at one KV budget: paged cache vs reserving max-model-len", __doc__, SCHEMA
    )
    w = p.add_argument_group(
        "workload (here --kv-cache-memory-bytes defaults to 1GiB and --max-model-len to 8192: the budget and the clip)"
    )
    w.add_argument(
        "--mean-len", type=float, default=500.0, help="mean request length, prompt + output, in tokens (default 500)"
    )
    w.add_argument(
        "--len-sigma", type=float, default=1.0, help="sigma of the lognormal lengths: the tail's weight (default 1)"
    )
    w.add_argument(
        "--output-share", type=float, default=0.25, help="share of each request's length that is output (default 0.25)"
    )
    w.add_argument("--samples", type=int, default=10_000, help="lengths drawn for the analytic figures (default 10000)")
    w.add_argument(
        "--scale",
        type=int,
        default=16,
        help="the measured run divides the budget, max-model-len and mean length by this (default 16; 1: full size)",
    )
    w.add_argument(
        "--num-requests", type=int, default=32, help="requests in the measured run, all submitted at once (default 32)"
    )
    add_repeats_arg(p, default=3)
    add_output_args(p, "running requests and KV usage over the (last) measured run, paged vs reserved")
    add_engine_args(p)
    # A 1 GiB budget and an 8K context as the example; no prefix caching, so only allocation differs.
    p.set_defaults(func=run, kv_cache_memory_bytes=GiB, max_model_len=8192, enable_prefix_caching=False)


@dataclass(slots=True)
class MemoryRun:
    """One pass of the measured workload through one engine, with what it held at each step."""

    elapsed_s: float = 0.0
    output_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    times_s: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    kv_usage_perc: list[float] = field(default_factory=list)
    held_slots: int = 0
    used_slots: int = 0

    @property
    def waste_perc(self) -> float:
        return 100.0 * (self.held_slots - self.used_slots) / self.held_slots if self.held_slots else 0.0

    def to_json(self) -> dict:
        return {
            "elapsed_s": self.elapsed_s,
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "max_running": max(self.running, default=0),
            "mean_running": sum(self.running) / len(self.running) if self.running else 0.0,
            "peak_kv_usage_perc": max(self.kv_usage_perc, default=0.0),
            "waste_perc": self.waste_perc,
            "preemptions": self.preemptions,
        }


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, config_of, emit
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine_args import engine_config_from_args

    full, small = workloads(args)
    config = engine_config_from_args(args)
    paged = LLMEngine.from_config(replace(config, kv_cache_memory_bytes=small.budget, max_model_len=small.max_len))
    engines = {"paged": paged, "reserved": paged.sibling(reserve_max_model_len=True)}
    warm = [TokenRequest(r.prompt_token_ids, 2) for r in requests_for(paged, small, args.seed - 1, 8)]
    for name, engine in engines.items():
        run_workload(engine, warm, f"warm-{name}")  # batched prefill and decode once, outside the measurement
    analytic = analyze(paged, full, full.dist.sample(random.Random(args.seed), args.samples))
    requests = requests_for(paged, small, args.seed, args.num_requests)
    runs: dict[str, list[MemoryRun]] = {name: [] for name in LAYOUTS}
    for round_index in range(args.repeats):
        for name in LAYOUTS:  # alternating, so that a slow spell on a shared machine hits both
            runs[name].append(run_workload(engines[name], requests, f"{name}-{round_index}"))
    measured = {
        "scale": args.scale,
        "num_requests": args.num_requests,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "plan": analyze(paged, small, [len(r.prompt_token_ids) + r.output_len for r in requests]),
        "layouts": [layout_row(name, runs[name]) for name in LAYOUTS],
    }
    report = Report("memory", machine_info(), config_of(args))
    report.results = {"analytic": analytic, "measured": measured}
    report.ratios = ratios(analytic, measured)
    report.tables += [analytic_table(analytic), measured_table(measured, args.repeats)]
    report.notes += notes(measured)
    if args.plot:
        plot(args.plot, {name: rs[-1] for name, rs in runs.items()})
    emit(report, args.json)
    return 0


@dataclass(frozen=True, slots=True)
class Workload:
    """A KV budget, a max-model-len and the request lengths drawn under it."""

    budget: int
    max_len: int
    dist: LengthDistribution
    output_share: float


def workloads(args: argparse.Namespace) -> tuple[Workload, Workload]:
    """The full-size workload of the flags, and the measured one: budget, max-model-len and mean length
    divided by --scale, the distribution's shape (sigma) kept."""
    from kvserve.bench.workload import LengthDistribution

    if min(args.scale, args.num_requests, args.samples, args.repeats) < 1:
        raise ValueError("--scale, --num-requests, --samples and --repeats must be >= 1")
    if not 0 < args.output_share < 1:
        raise ValueError(f"--output-share must be between 0 and 1, got {args.output_share}")
    max_len = args.max_model_len // args.scale
    if max_len < 2:
        raise ValueError(f"--max-model-len {args.max_model_len} / --scale {args.scale} leaves under 2 tokens")
    full = Workload(
        args.kv_cache_memory_bytes,
        args.max_model_len,
        LengthDistribution(args.mean_len, args.max_model_len, args.len_sigma),
        args.output_share,
    )
    mean = min(max(args.mean_len / args.scale, 1.0), max_len)
    small = Workload(
        args.kv_cache_memory_bytes // args.scale,
        max_len,
        LengthDistribution(mean, max_len, args.len_sigma),
        args.output_share,
    )
    return full, small


def requests_for(engine: LLMEngine, w: Workload, seed: int, n: int) -> list[TokenRequest]:
    """Random-token requests (no prefix-cache hits) whose prompt + output lengths follow the workload's."""
    from kvserve.bench.systems import special_token_ids
    from kvserve.bench.workload import TokenRequest, random_token_ids, split_length

    rng = random.Random(seed)
    exclude, vocab = special_token_ids(engine), engine.core.model_config.vocab_size
    requests = []
    for length in w.dist.sample(rng, n):
        prompt, output = split_length(length, w.output_share)
        requests.append(TokenRequest(random_token_ids(rng, prompt, vocab, exclude), output))
    return requests


def analyze(engine: LLMEngine, w: Workload, lengths: list[int]) -> dict:
    """Requests that fit and waste of each layout, from the capacity plan at the workload's budget (computed,
    nothing allocated)."""
    from kvserve.bench.stats import summarize
    from kvserve.capacity import compare_layouts, plan_kv_cache

    spec = engine.core.kv_config
    plan = plan_kv_cache(
        spec.bytes_per_block,
        spec.block_size,
        engine.core.model_config.max_position_embeddings,
        budget_bytes=w.budget,
        max_model_len=w.max_len,
    )
    cmp = compare_layouts(lengths, spec.bytes_per_token, spec.block_size, w.max_len, w.budget)
    summary = summarize([float(n) for n in lengths])
    assert summary is not None  # lengths is never empty

    def one(use: CacheLayoutUse) -> dict:
        return {
            "kv_tokens_per_request": use.allocated_bytes / len(lengths) / spec.bytes_per_token,
            "requests_that_fit": use.requests_that_fit,
            "waste_perc": use.waste_perc,
        }

    return {
        "budget_bytes": w.budget,
        "num_blocks": plan.num_blocks,
        "block_size": spec.block_size,
        "bytes_per_token": spec.bytes_per_token,
        "max_model_len": w.max_len,
        "lengths": {
            "mean_target": w.dist.mean,
            "sigma": w.dist.sigma,
            "output_share": w.output_share,
            "summary": summary.to_json(),
        },
        "paged": one(cmp.paged),
        "reserved": one(cmp.contiguous),
    }


def run_workload(engine: LLMEngine, requests: list[TokenRequest], tag: str) -> MemoryRun:
    """Submit every request at once and step the engine until all are done, recording after each step how
    many requests hold KV, the pool's usage, and how many of the slots they hold contain a token. Each
    round repeats the same requests, so the prefix cache is emptied first."""
    from kvserve.sampling_params import SamplingParams

    result = MemoryRun()
    engine.core.pool.reset_prefix_cache()  # every round starts cold, even with --enable-prefix-caching
    preemptions = engine.stats().num_preemptions
    start = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        engine.add_request(f"{tag}-{i}", list(r.prompt_token_ids), params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        finished = sum(o.finished for o in outputs)
        result.steps += 1
        result.output_tokens += sum(len(c.token_ids) for o in outputs if o.finished for c in o.outputs)
        result.times_s.append(time.perf_counter() - start)
        result.running.append(engine.core.num_running + finished)
        result.kv_usage_perc.append(100.0 * engine.core.pool.usage)
        for request in engine.core.scheduler.running:
            result.held_slots += engine.core.kv_manager.num_blocks_held(request) * engine.core.kv_manager.block_size
            result.used_slots += request.num_computed_tokens
    result.elapsed_s = time.perf_counter() - start
    result.preemptions = engine.stats().num_preemptions - preemptions
    return result


def layout_row(name: str, runs: list[MemoryRun]) -> dict:
    from kvserve.bench.stats import median

    rs = [r.to_json() for r in runs]
    return {
        "layout": name,
        "runs": rs,
        "max_running": max(r["max_running"] for r in rs),
        "mean_running": median([r["mean_running"] for r in rs]),
        "waste_perc": median([r["waste_perc"] for r in rs]),
        "preemptions": max(r["preemptions"] for r in rs),
        "elapsed_s": median([r["elapsed_s"] for r in rs]),
        "output_tokens_per_s": median([r["output_tokens"] / r["elapsed_s"] for r in rs]),
    }


def ratios(analytic: dict, measured: dict) -> dict[str, float | None]:
    from kvserve.bench.stats import ratio

    by = {row["layout"]: row for row in measured["layouts"]}
    return {
        "concurrency:paged/reserved": ratio(
            analytic["paged"]["requests_that_fit"], analytic["reserved"]["requests_that_fit"]
        ),
        "measured_concurrency:paged/reserved": ratio(by["paged"]["max_running"], by["reserved"]["max_running"]),
        "output_tokens_per_s:paged/reserved": ratio(
            by["paged"]["output_tokens_per_s"], by["reserved"]["output_tokens_per_s"]
        ),
    }


def _describe(plan: dict) -> str:
    s = plan["lengths"]["summary"]
    return (
        f"{format_bytes(plan['budget_bytes'], '.4g')} = {plan['num_blocks']} blocks x {plan['block_size']} tokens "
        f"({plan['bytes_per_token']:,} bytes/token); lengths lognormal (mean {s['mean']:.0f}, p50 {s['p50']:.0f}, "
        f"p99 {s['p99']:.0f}, max {s['max']:.0f}) clipped at max-model-len {plan['max_model_len']}"
    )


def analytic_table(a: dict) -> Table:
    from kvserve.bench.report import Table

    t = Table(
        f"Analytic, from the capacity plan: {_describe(a)}; {a['lengths']['summary']['count']} requests drawn",
        ["cache layout", "KV tokens per request", "requests that fit", "waste %"],
    )
    for name, label in zip(LAYOUTS, (f"paged ({a['block_size']}-token blocks)", "reserve max-model-len")):
        t.add(label, a[name]["kv_tokens_per_request"], a[name]["requests_that_fit"], a[name]["waste_perc"])
    return t


def measured_table(m: dict, repeats: int) -> Table:
    from kvserve.bench.report import Table

    plan = m["plan"]
    t = Table(
        f"Measured at 1/{m['scale']} scale, {m['num_requests']} requests submitted at once ({m['prompt_tokens']} "
        f"prompt + {m['output_tokens']} output tokens): {_describe(plan)}; medians of {repeats} run(s)",
        [
            "cache layout",
            "predicted fit",
            "max running",
            "mean running",
            "preemptions",
            "waste %",
            "output tok/s",
            "elapsed s",
        ],
    )
    for row in m["layouts"]:
        name = row["layout"]
        t.add(
            name,
            plan[name]["requests_that_fit"],
            row["max_running"],
            row["mean_running"],
            row["preemptions"],
            row["waste_perc"],
            row["output_tokens_per_s"],
            row["elapsed_s"],
        )
    return t


def notes(measured: dict) -> list[str]:
    out = [
        (
            "reserved = the same engine with every request taking max-model-len worth of blocks at admission "
            "(EngineConfig.reserve_max_model_len), emulating a contiguous cache"
        )
    ]
    paged = next(r for r in measured["layouts"] if r["layout"] == "paged")
    if paged["max_running"] >= measured["num_requests"]:
        out.append(
            f"paged: all {measured['num_requests']} requests ran at once, so the workload, not the cache, "
            "bounded its concurrency (raise --num-requests to find the cache's limit)"
        )
    return out


def plot(path: str, runs: dict[str, MemoryRun]) -> None:
    from kvserve.bench.plot import Panel, Series, line_plot

    line_plot(
        path,
        [
            Panel(
                "Requests running at once",
                "time (s)",
                "running requests",
                [Series(name, r.times_s, r.running, style="-") for name, r in runs.items()],
            ),
            Panel(
                "KV cache usage",
                "time (s)",
                "blocks in use (%)",
                [Series(name, r.times_s, r.kv_usage_perc, style="-") for name, r in runs.items()],
            ),
        ],
    )
