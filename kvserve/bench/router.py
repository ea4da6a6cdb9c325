"""`kvserve bench router`: what KV-aware routing buys when replicas scale out (#17), per `--router` policy.

A multi-tenant shared-prefix workload (each tenant a long system prompt, many short questions, Poisson arrivals)
against one replica and against `--data-parallel-size N` under each `--router` policy, in the same run, with each
replica's KV cache sized to hold only some of the tenants' prefixes: prefix-cache hit rate, TTFT, output
tokens/s and failures per configuration.

Each configuration is a real `kvserve serve` process (kvserve.bench.server_process), started fresh (cold cache),
warmed by one request per tenant in turn, then loaded; the replicated ones share one Ray instance that the
bench starts once, so that Ray's own start-up is paid once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.bench.options import add_output_args, new_command
from kvserve.bench.workload import TokenRange

if TYPE_CHECKING:
    from kvserve.bench.report import Table
    from kvserve.bench.serve_client import LoadRun
    from kvserve.bench.server_process import MetricKey

log = logging.getLogger(__name__)
POLICIES = ("prefix_aware", "least_loaded", "round_robin")
REPORT_LAG_S = 0.5  # the ingress polls replica reports every 50 ms: wait this long before reading /metrics
HIT_RATE_TARGET = 1.8  # prefix_aware / round_robin hit rate, at least (issue #17)
TTFT_P90_TARGET = 0.5  # prefix_aware / round_robin TTFT p90, at most
# prefix_aware / the best other policy's output tokens/s, at least: "no worse". Under open-loop arrivals every
# configuration that keeps up serves the offered load, so equal throughput measures within about a percent;
# 0.95 tells "no worse" from that noise.
THROUGHPUT_TARGET = 0.95

SCHEMA = """\
results: {
  "workload": {"num_tenants", "prefix_tokens", "question_tokens": "LOW-HIGH", "num_requests", "request_rate",
               "max_tokens", "warmup_per_tenant", "seed"},
  "kv_budget": {"block_size", "num_blocks" (per replica, --num-gpu-blocks-override), "prefix_blocks" (full blocks of
                one tenant's prefix), "tenants_held" (prefixes the budget holds), "request_blocks" (blocks of one
                request beyond its prefix's full blocks), "slack_requests", "describe": str},
  "configs": [{"name", "replicas", "router": str | null, "command": str (`kvserve serve ...`, port and Ray address
               left out), "startup_s", "completed", "failed", "errors": [str] (distinct, at most 5),
               "duration_s", "output_tokens_per_s", "requests_per_s",
               "prompt_tokens", "cached_tokens", "hit_rate" (cached / prompt tokens of the completed measured
               requests, from usage.prompt_tokens_details.cached_tokens; null when the server sent no usage),
               "server_hit_rate" (kvserve:prefix_cache_hits_total / queries_total over the measured phase),
               "preemptions", "router_decisions": {reason: count} (kvserve:router_decisions_total over the phase),
               "ttft_ms", "itl_ms", "e2e_ms": {"count", "mean", "p50", "p90", "p99", "min", "max"} | null}],
  "targets": [{"name", "value": float | null, "target": str, "met": bool | null}]}
ratios: {"hit_rate:prefix_aware/round_robin", "ttft_p90:prefix_aware/round_robin",
         "output_tokens_per_s:prefix_aware/best_other" (best other replicated policy),
         "output_tokens_per_s:prefix_aware/single"}
Only the measured requests count: the warm-up (one request per tenant, in turn) is left out of every figure."""


def policy_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected policies among {', '.join(POLICIES)} separated by commas, got {text!r}"
        )
    return list(dict.fromkeys(names))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "router",
        "replicas behind one endpoint: prefix-cache hits and TTFT per --router policy",
        __doc__.splitlines()[0],
        SCHEMA,
    )
    s = p.add_argument_group("servers (each configuration is a `kvserve serve` process)")
    s.add_argument("--model", default=None, help="as `kvserve serve --model` (default: Gemma 3 270M)")
    s.add_argument("--data-parallel-size", type=int, default=2, help="replicas of the replicated configurations")
    s.add_argument(
        "--policies",
        type=policy_list,
        default=list(POLICIES),
        help=f"--router policies to measure, in this order (default {','.join(POLICIES)})",
    )
    s.add_argument(
        "--single-replica",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure one replica (`--data-parallel-size 1`, no Ray) with the same KV budget",
    )
    s.add_argument("--cpu-threads", type=int, default=1, help="threads per replica")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the budget is counted in them)")
    s.add_argument(
        "--kv-tenants",
        type=float,
        default=None,
        help="how many tenants' prefixes one replica's KV budget holds (default: half the tenants)",
    )
    s.add_argument(
        "--kv-slack-requests",
        type=int,
        default=4,
        help="the budget also holds this many requests' own blocks (question and output)",
    )
    s.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster for the replicas (default: a local instance the bench starts)",
    )
    s.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="more `kvserve serve` flags for every configuration, e.g. --serve-arg='--max-num-seqs 32'",
    )
    s.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to become healthy")
    w = p.add_argument_group("workload")
    w.add_argument("--num-tenants", type=int, default=8)
    w.add_argument("--prefix-tokens", type=int, default=1000, help="tokens of each tenant's system prompt")
    w.add_argument(
        "--question-tokens",
        type=TokenRange.parse,
        default=TokenRange(16, 32),
        metavar="LOW-HIGH",
        help="tokens of each request's own question",
    )
    w.add_argument("--num-requests", type=int, default=144, help="measured requests per configuration")
    w.add_argument("--request-rate", type=float, default=0.8, help="Poisson arrivals per second")
    w.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (ignore_eos)")
    w.add_argument(
        "--warmup-per-tenant",
        type=int,
        default=1,
        help="unmeasured requests per tenant, sent one by one in turn before the measurement",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    add_output_args(p, "hit rate, TTFT p50/p90 and output tokens/s per configuration")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class KVBudget:
    """Each replica's KV cache, sized from the workload so that it holds only `tenants_held` prefixes."""

    block_size: int
    prefix_blocks: int
    tenants_held: float
    request_blocks: int
    slack_requests: int

    @classmethod
    def plan(cls, args: argparse.Namespace) -> KVBudget:
        bs = args.block_size
        prefix_blocks = args.prefix_tokens // bs  # the full blocks: what the prefix cache can share
        longest = args.prefix_tokens + args.question_tokens.high + args.max_tokens
        held = args.num_tenants / 2 if args.kv_tenants is None else args.kv_tenants
        return cls(bs, prefix_blocks, held, math.ceil(longest / bs) - prefix_blocks, args.kv_slack_requests)

    @property
    def num_blocks(self) -> int:
        """Prefixes held, the slack requests' own blocks, at least one whole request, and the null block."""
        usable = math.ceil(self.tenants_held * self.prefix_blocks) + self.slack_requests * self.request_blocks
        return 1 + max(usable, self.prefix_blocks + self.request_blocks)

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks of {self.block_size} tokens per replica = {self.tenants_held:g} tenants' "
            f"prefixes ({self.prefix_blocks} full blocks each) + {self.slack_requests} requests' own blocks "
            f"({self.request_blocks} each) + 1 reserved"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "prefix_blocks": self.prefix_blocks,
            "tenants_held": self.tenants_held,
            "request_blocks": self.request_blocks,
            "slack_requests": self.slack_requests,
            "describe": self.describe(),
        }


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One measured configuration: one replica, or N replicas under a routing policy."""

    replicas: int
    router: str | None

    @property
    def name(self) -> str:
        return "1 replica" if self.router is None else f"{self.replicas}x {self.router}"

    def serve_args(self, args: argparse.Namespace, budget: KVBudget) -> list[str]:
        """The `kvserve serve` flags of this configuration (without host, port and Ray address)."""
        flags = ["--model", args.model] if args.model else []
        flags += [
            "--cpu-threads",
            str(args.cpu_threads),
            "--block-size",
            str(budget.block_size),
            "--num-gpu-blocks-override",
            str(budget.num_blocks),
            "--uvicorn-log-level",
            "warning",
        ]
        if self.router is not None:
            flags += ["--data-parallel-size", str(self.replicas), "--router", self.router]
        return flags + [flag for extra in args.serve_arg for flag in shlex.split(extra)]


def configurations(args: argparse.Namespace) -> list[ServerConfig]:
    single = [ServerConfig(1, None)] if args.single_replica else []
    return single + [ServerConfig(args.data_parallel_size, policy) for policy in args.policies]


def check_args(args: argparse.Namespace) -> None:
    checks = [
        (args.data_parallel_size >= 2 or not args.policies, "--data-parallel-size must be >= 2 to compare routers"),
        (args.num_tenants >= 1 and args.num_requests >= 1, "--num-tenants and --num-requests must be >= 1"),
        (args.prefix_tokens >= 2 * args.block_size, "--prefix-tokens must cover at least two KV blocks"),
        (args.request_rate > 0, "--request-rate must be > 0"),
        (args.max_tokens >= 1 and args.warmup_per_tenant >= 0, "--max-tokens >= 1 and --warmup-per-tenant >= 0"),
        (args.cpu_threads >= 1 and args.block_size >= 1, "--cpu-threads and --block-size must be >= 1"),
        (args.kv_tenants is None or args.kv_tenants > 0, "--kv-tenants must be > 0"),
        (args.kv_slack_requests >= 0, "--kv-slack-requests must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


@contextlib.contextmanager
def shared_ray(address: str | None, num_cpus: int) -> Iterator[str]:
    """The Ray cluster every replicated configuration joins: `address`, or a local instance started here once
    (so its start-up is not paid per configuration) and stopped at the end."""
    if address:
        yield address
        return
    if importlib.util.find_spec("ray") is None:
        raise ValueError("the replicated configurations run on Ray, which is not installed: pip install -e .[cluster]")
    from kvserve.cluster.private_ray import connect_ray

    connect_ray(None, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    import ray

    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, config_of, emit
    from kvserve.bench.workload import tenant_requests
    from kvserve.model.source import resolve_model
    from kvserve.model.tokenizer import load_tokenizer

    check_args(args)
    logging.getLogger("httpx").setLevel(max(logging.getLogger("httpx").getEffectiveLevel(), logging.WARNING))
    budget = KVBudget.plan(args)
    tokenizer = load_tokenizer(resolve_model(args.model))
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None else []
    requests = tenant_requests(
        args.num_tenants,
        args.prefix_tokens,
        args.num_requests,
        args.question_tokens,
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        bos,
        args.seed,
        requests_per_tenant=args.warmup_per_tenant,
    )
    prompts = [r.prompt_token_ids for r in requests]
    num_warm = args.num_tenants * args.warmup_per_tenant
    print(f"kvserve bench router: KV budget {budget.describe()}", file=sys.stderr, flush=True)
    rows = []
    configs = configurations(args)
    num_cpus = max(os.cpu_count() or 1, args.data_parallel_size * args.cpu_threads)
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-router-") as logs, contextlib.ExitStack() as stack:
        ray_address: str | None = None
        for config in configs:
            if config.router is not None and ray_address is None:
                ray_address = stack.enter_context(shared_ray(args.ray_address, num_cpus))
            rows.append(measure(config, args, budget, prompts[:num_warm], prompts[num_warm:], Path(logs), ray_address))
    report = Report("router", machine_info(), config_of(args))
    targets = evaluate(rows)
    report.results = {
        "workload": {
            "num_tenants": args.num_tenants,
            "prefix_tokens": args.prefix_tokens,
            "question_tokens": str(args.question_tokens),
            "num_requests": args.num_requests,
            "request_rate": args.request_rate,
            "max_tokens": args.max_tokens,
            "warmup_per_tenant": args.warmup_per_tenant,
            "seed": args.seed,
        },
        "kv_budget": budget.to_json(),
        "configs": rows,
        "targets": targets,
    }
    report.ratios = ratios(rows)
    report.tables += [table(rows, args), targets_table(targets)]
    base = shlex.join(ServerConfig(1, None).serve_args(args, budget))
    report.notes.append(
        f"KV budget: {budget.describe()}; every server: `kvserve serve {base}` and, replicated, "
        f"`--data-parallel-size {args.data_parallel_size} --router POLICY`"
    )
    if args.plot:
        plot(args.plot, rows)
    emit(report, args.json)
    return 0


def measure(
    config: ServerConfig,
    args: argparse.Namespace,
    budget: KVBudget,
    warm: Sequence[list[int]],
    measured: Sequence[list[int]],
    log_dir: Path,
    ray_address: str | None,
) -> dict[str, Any]:
    """Start the configuration's server, warm it (one request at a time), load it, read its metrics, stop it."""
    import asyncio

    from tqdm.auto import tqdm

    from kvserve.bench.report import format_cell
    from kvserve.bench.serve_client import Endpoint, run_load
    from kvserve.bench.server_process import ServerProcess

    serve_args = config.serve_args(args, budget)
    joined = ["--ray-address", ray_address] if config.router is not None and ray_address else []
    log_path = log_dir / f"{config.name.replace(' ', '_')}.log"
    env = {"OMP_NUM_THREADS": str(args.cpu_threads)}
    log.info("%s: starting `kvserve serve %s`", config.name, shlex.join(serve_args))
    with ServerProcess.start(serve_args + joined, log_path, args.start_timeout, env) as server:
        log.info(
            "%s: healthy after %.1f s; %d warm-up requests, then %d measured",
            config.name,
            server.startup_s,
            len(warm),
            len(measured),
        )
        endpoint = Endpoint(server.base_url)
        if warm:
            asyncio.run(run_load(endpoint, warm, 2, True, 1, float("inf"), args.seed, args.timeout))
        time.sleep(REPORT_LAG_S)
        before = server.metrics()
        with tqdm(total=len(measured), desc=config.name, unit="req", disable=None) as bar:
            load = asyncio.run(
                run_load(
                    endpoint,
                    measured,
                    args.max_tokens,
                    True,
                    None,
                    args.request_rate,
                    args.seed,
                    args.timeout,
                    on_result=lambda _: bar.update(),
                )
            )
        time.sleep(REPORT_LAG_S)
        after = server.metrics()
        startup_s = server.startup_s
    row = config_row(config, "kvserve serve " + shlex.join(serve_args), startup_s, load, before, after)
    log.info(
        "%s: %d ok, %d failed, hit rate %s, TTFT p90 %s ms, %.1f output tokens/s",
        config.name,
        row["completed"],
        row["failed"],
        format_cell(row["hit_rate"]),
        format_cell(_p90(row)),
        row["output_tokens_per_s"],
    )
    return row


def config_row(
    config: ServerConfig,
    command: str,
    startup_s: float,
    load: LoadRun,
    before: dict[MetricKey, float],
    after: dict[MetricKey, float],
) -> dict[str, Any]:
    from kvserve.bench.stats import summarize

    done = load.completed
    failures = [r for r in load.results if not r.ok]

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    def dist(values: list[float]) -> dict | None:
        s = summarize([1e3 * v for v in values])
        return s.to_json() if s else None

    with_usage = [r for r in done if r.prompt_tokens is not None and r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in with_usage)
    cached_tokens = sum(r.cached_tokens or 0 for r in with_usage)
    queries = delta("kvserve:prefix_cache_queries_total")
    decisions = {
        dict(labels)["reason"]: int(value - before.get((name, labels), 0.0))
        for (name, labels), value in sorted(after.items())
        if name == "kvserve:router_decisions_total" and value - before.get((name, labels), 0.0) > 0
    }
    return {
        "name": config.name,
        "replicas": config.replicas,
        "router": config.router,
        "command": command,
        "startup_s": startup_s,
        "completed": len(done),
        "failed": len(failures),
        "errors": list(dict.fromkeys(str(r.error) for r in failures))[:5],
        "duration_s": load.duration_s,
        "output_tokens_per_s": load.output_tokens / load.duration_s,
        "requests_per_s": len(done) / load.duration_s,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens if with_usage and len(with_usage) == len(done) else None,
        "server_hit_rate": delta("kvserve:prefix_cache_hits_total") / queries if queries > 0 else None,
        "preemptions": int(delta("kvserve:num_preemptions_total")),
        "router_decisions": decisions,
        "ttft_ms": dist([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_ms": dist([gap for r in done for gap in r.itl_s]),
        "e2e_ms": dist([r.e2e_s for r in done]),
    }


def _p90(row: dict[str, Any] | None) -> float | None:
    return row["ttft_ms"]["p90"] if row and row["ttft_ms"] else None


def ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    from kvserve.bench.stats import ratio

    by = {row["router"]: row for row in rows}
    aware, rr = by.get("prefix_aware"), by.get("round_robin")
    if aware is None:
        return {}
    others = [r["output_tokens_per_s"] for r in rows if r["router"] not in (None, "prefix_aware")]
    out = {
        "output_tokens_per_s:prefix_aware/best_other": ratio(aware["output_tokens_per_s"], max(others))
        if others
        else None,
        "output_tokens_per_s:prefix_aware/single": ratio(aware["output_tokens_per_s"], by[None]["output_tokens_per_s"])
        if None in by
        else None,
    }
    if rr is not None:
        out["hit_rate:prefix_aware/round_robin"] = ratio(aware["hit_rate"], rr["hit_rate"])
        out["ttft_p90:prefix_aware/round_robin"] = ratio(_p90(aware), _p90(rr))
    return out


def evaluate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue #17's targets, each with the measured value and whether it is met (null: not measured)."""
    r = ratios(rows)

    def target(name: str, value: float | None, text: str, ok: bool | None) -> dict[str, Any]:
        return {"name": name, "value": value, "target": text, "met": None if value is None else ok}

    hit = r.get("hit_rate:prefix_aware/round_robin")
    ttft = r.get("ttft_p90:prefix_aware/round_robin")
    tput = r.get("output_tokens_per_s:prefix_aware/best_other")
    return [
        target(
            "hit rate, prefix_aware / round_robin",
            hit,
            f">= {HIT_RATE_TARGET}",
            hit is not None and hit >= HIT_RATE_TARGET,
        ),
        target(
            "TTFT p90, prefix_aware / round_robin",
            ttft,
            f"<= {TTFT_P90_TARGET}",
            ttft is not None and ttft <= TTFT_P90_TARGET,
        ),
        target(
            "output tokens/s, prefix_aware / best other policy",
            tput,
            f">= {THROUGHPUT_TARGET} (no worse)",
            tput is not None and tput >= THROUGHPUT_TARGET,
        ),
    ]


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    from kvserve.bench.report import Table

    def p(dist: dict | None, key: str) -> float | None:
        return dist[key] if dist else None

    t = Table(
        f"{args.num_tenants} tenants x {args.prefix_tokens}-token system prompt, {args.num_requests} requests "
        f"({args.question_tokens}-token questions, {args.max_tokens} new tokens), Poisson "
        f"{args.request_rate:g}/s, {args.cpu_threads} thread(s) per replica",
        [
            "config",
            "ok",
            "failed",
            "hit rate",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "E2E p90 ms",
            "out tok/s",
            "preempt",
            "routing",
        ],
    )
    for r in rows:
        routing = ", ".join(f"{k} {v}" for k, v in r["router_decisions"].items()) or "-"
        t.add(
            r["name"],
            r["completed"],
            r["failed"],
            r["hit_rate"],
            p(r["ttft_ms"], "p50"),
            p(r["ttft_ms"], "p90"),
            p(r["e2e_ms"], "p90"),
            r["output_tokens_per_s"],
            r["preemptions"],
            routing,
        )
    return t


def targets_table(targets: list[dict[str, Any]]) -> Table:
    from kvserve.bench.report import Table

    t = Table("Issue #17 targets (2 replicas, 1 thread each)", ["target", "measured", "wanted", "met"])
    for target in targets:
        met = "-" if target["met"] is None else "yes" if target["met"] else "NO"
        t.add(target["name"], target["value"], target["target"], met)
    return t


def plot(path: str, rows: list[dict[str, Any]]) -> None:
    from kvserve.bench.plot import BarPanel, Series, bar_panels

    groups = [r["name"] for r in rows]
    xs = list(range(len(rows)))

    def ttft(key: str) -> list[float | None]:
        return [r["ttft_ms"][key] / 1e3 if r["ttft_ms"] else None for r in rows]

    bar_panels(
        path,
        groups,
        [
            BarPanel(
                "Prefix-cache hit rate",
                "cached / prompt tokens",
                [Series("hit rate", xs, [r["hit_rate"] for r in rows])],
                fmt="%.2f",
            ),
            BarPanel(
                "Time to first token",
                "seconds",
                [Series("p50", xs, ttft("p50")), Series("p90", xs, ttft("p90"))],
                fmt="%.2f",
            ),
            BarPanel(
                "Output throughput",
                "tokens/s",
                [Series("output tokens/s", xs, [r["output_tokens_per_s"] for r in rows])],
            ),
        ],
        title="kvserve bench router: shared-prefix tenants, one replica vs replicas per routing policy",
    )
