"""`kvserve bench long-context`: what KV cache groups (the hybrid KV cache manager, kv/groups.py) buy on a model with
sliding windows, against the uniform layout in which every layer keeps every token (--disable-hybrid-kv-cache-manager)
in the same run, on one loaded model, and against llama-server's iSWA cache (its default). Four sections:
(1) capacity: max concurrency at max-model-len in a KV budget (the start-up line's, checked against `kvserve
estimate`'s blocks), and the KV bytes N requests of that length hold at 16-bit KV (a dry run of the scheduler and KV
manager: the engine's own allocation, no model) against what llama-server allocates for N slots of it;
(2) throughput of a batch of long prompts on a small pool: the uniform layout preempts and recomputes where the hybrid
one fits (preemptions and peak KV bytes in the table), and llama-server with -np slots filling the same memory;
(3) a decode step at a long context, the layouts alternated; (4) the multi-round chat of `bench offload` with
histories past the window: hit rate and TTFT, without and with a host-memory offload tier."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.bench.options import add_engine_args, add_output_args, add_repeats_arg, int_list, new_command
from kvserve.bench.workload import TokenRange
from kvserve.units import GiB, MiB, parse_size

if TYPE_CHECKING:
    from kvserve.bench.report import Table
    from kvserve.engine.engine import LLMEngine
    from kvserve.model.config import ModelConfig

SECTIONS = ("capacity", "throughput", "decode", "chat")
LAYOUTS = ("hybrid", "uniform")

SCHEMA = """\
results: {"capacity": {"budget_bytes", "max_model_len", "requests", "kv_cache_dtype",
            "layouts": {LAYOUT: {"num_blocks", "bytes_per_block", "blocks_per_request", "prefill_reserve_blocks",
                                 "max_concurrency", "estimate_num_blocks", "estimate_blocks_per_request",
                                 "peak_blocks", "kv_bytes"}},
            "llama_server": null | {"args", "kv_bytes", "swa_full_kv_bytes"}},
          "throughput": {"requests", "prompt_tokens", "output_len", "pool_bytes",
            "systems": {LAYOUT | "llama-server": {"wall_s", "output_tok_s", "total_tok_s", "preemptions",
                                                  "peak_kv_bytes", "args"}}},
          "decode": {"context", "steps", "rows": [{"batch", LAYOUT: step ms (median)}]},
          "chat": {"users", "rounds", "system_tokens", "working_set_tokens", "pool_bytes", "tier_bytes",
            "systems": {LAYOUT | LAYOUT + " + tier": {"ttft_ms_p50", "ttft_ms_p90", "throughput_tok_s",
                                                       "pool_hit_rate", "tier_hit_rate", "ttft_ms": [...]}}}}
LAYOUT: "hybrid" (KV cache groups; sliding windows give blocks back) or "uniform" (every layer keeps every token).
ratios: {"max_concurrency_hybrid_over_uniform", "kv_bytes_hybrid_over_llama_server", "throughput_hybrid_over_uniform",
         "throughput_hybrid_over_llama_server", "decode_step_hybrid_over_uniform@<batch>",
         "chat_ttft_p50_hybrid_over_uniform", "chat_hit_rate_hybrid_minus_uniform",
         "chat_tier_ttft_p50_hybrid_over_uniform"}
kv_bytes: the peak of the blocks requests hold, in the section's 16-bit KV dtype (llama-server: its f16 caches' sizes
from its log). Throughput: output tokens (and all tokens) over the wall time of the batch, every prompt added at once.
Decode step: milliseconds of a step of `batch` sequences whose contexts are `context` tokens (one prompt, shared as a
prefix hit: each sequence still reads its whole context). TTFT: from add_request to the first token, in process."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "long-context",
        "KV cache groups against the uniform layout and llama-server: capacity, throughput, decode, chat",
        __doc__,
        SCHEMA,
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"which to run, of {', '.join(SECTIONS)}")
    p.add_argument("--capacity-budget", type=parse_size, default=4 * GiB, help="capacity: the KV budget")
    p.add_argument("--capacity-max-model-len", type=int, default=32768, help="capacity: max-model-len")
    p.add_argument("--capacity-requests", type=int, default=4, help="capacity: requests of max-model-len held at once")
    p.add_argument("--capacity-kv-dtype", default="bfloat16", help="capacity: the 16-bit KV dtype of the bytes row")
    p.add_argument("--throughput-requests", type=int, default=24)
    p.add_argument("--throughput-prompt-len", type=TokenRange.parse, default=TokenRange(6144, 12288))
    p.add_argument("--throughput-output-len", type=int, default=64)
    p.add_argument("--throughput-pool", type=parse_size, default=GiB, help="throughput: every system's KV memory")
    p.add_argument("--decode-context", type=int, default=8192)
    p.add_argument("--decode-batches", type=int_list, default=[1, 8])
    p.add_argument("--decode-steps", type=int, default=16, help="decode: steps timed per repeat")
    p.add_argument("--chat-users", type=int, default=8)
    p.add_argument("--chat-rounds", type=int, default=4)
    p.add_argument("--chat-system-tokens", type=int, default=2048, help="chat: every history starts past 2k tokens")
    p.add_argument("--chat-question-tokens", type=int, default=50)
    p.add_argument("--chat-output-len", type=int, default=32)
    p.add_argument(
        "--chat-pool",
        type=parse_size,
        default=384 * MiB,
        help="chat: the KV pool; the default holds the users' histories in the hybrid layout (full-attention blocks "
        "and last windows, plus a prefill's peak) but not in the uniform one, so the layouts' hit rates differ",
    )
    p.add_argument("--chat-tier", type=parse_size, default=GiB, help="chat: the host offload tier's size")
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="llama-server (scripts/build_llama_cpp.sh) for the capacity and throughput peers; without it, kvserve's "
        "layouts only",
    )
    add_repeats_arg(p, 3)
    add_output_args(p, "bars: max concurrency, throughput, decode step, chat TTFT per system")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, config_of, emit
    from kvserve.bench.systems import build_engine

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--sections: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SECTIONS)})")
    if args.plot:
        from kvserve.bench.plot import check_plot_target

        check_plot_target(args.plot)
    args.enable_prefix_caching = True
    args.disable_hybrid_kv_cache_manager = False
    report = Report("long-context", machine_info(), config_of(args))
    base = None if sections == ["capacity"] else build_engine(replace_args(args, kv_cache_memory_bytes=GiB))
    steps: dict[str, Callable[[], tuple[dict[str, Any], list[Table], dict[str, float | None]]]] = {
        "capacity": lambda: _capacity(args),
        "throughput": lambda: _throughput(_engine_pair(base, args.throughput_pool), args),
        "decode": lambda: _decode(base, args),
        "chat": lambda: _chat(base, args),
    }
    for name in sections:
        results, tables, ratios = steps[name]()
        report.results[name] = results
        report.tables += tables
        report.ratios.update(ratios)
    if args.plot:
        _plot(report.results, args.plot)
    emit(report, args.json)
    return 0


def replace_args(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def _engine_pair(base: LLMEngine | None, pool: int) -> dict[str, LLMEngine]:
    """The two layouts on the loaded model, each with a KV pool of `pool` bytes whose pages are mapped now: a fresh
    page's first touch costs more than the write into it, and the layouts would otherwise pay it at different steps
    (a uniform block is 6x the bytes of a hybrid one for Gemma 3)."""
    from kvserve.kv.cache import touch_pages, unique_tensors

    assert base is not None
    engines = {
        "hybrid": base.sibling(kv_cache_memory_bytes=pool),
        "uniform": base.sibling(kv_cache_memory_bytes=pool, disable_hybrid_kv_cache_manager=True),
    }
    for engine in engines.values():
        touch_pages([t for c in unique_tensors(engine.core.runner.kv_caches) for t in (c.key, c.value)])
    return engines


# ---- (1) capacity ------------------------------------------------------------------------------------------------


def _capacity(args: argparse.Namespace) -> tuple[dict[str, Any], list[Table], dict[str, float | None]]:
    """Each layout's plan in the budget (and `kvserve estimate`'s, which must agree to the block), and the peak bytes
    of `requests` requests of max-model-len in the 16-bit dtype, counted by running the scheduler and KV manager."""
    import torch

    from kvserve.bench.report import Table
    from kvserve.bench.stats import ratio
    from kvserve.capacity import Budget, plan_kv_cache
    from kvserve.kv.cache import KVCacheConfig, resolve_kv_cache_dtype
    from kvserve.kv.groups import make_kv_cache_layout
    from kvserve.model.loader import load_model_config
    from kvserve.model.source import resolve_model
    from kvserve.tools.estimate import build_estimate
    from kvserve.tools.model_facts import resolve_model_facts
    from kvserve.tools.setup import Setup
    from kvserve.vocab import KV_DTYPES

    source = resolve_model(args.model)
    model = load_model_config(source)
    facts = resolve_model_facts(args.model)
    length, bs, chunk = args.capacity_max_model_len, args.block_size, args.max_num_batched_tokens
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, torch.float32)
    bytes_dtype = resolve_kv_cache_dtype(args.capacity_kv_dtype, torch.float32)
    layouts: dict[str, dict[str, Any]] = {}
    for name in LAYOUTS:
        layout = make_kv_cache_layout(model.sliding_windows, hybrid=name == "hybrid")
        spec = KVCacheConfig(model.num_layers, model.num_kv_heads, model.head_dim, bs, kv_dtype, layout)
        plan = plan_kv_cache(
            spec.bytes_per_block,
            bs,
            model.max_position_embeddings,
            budget_bytes=args.capacity_budget,
            max_model_len=length,
            layout=layout,
            max_num_batched_tokens=chunk,
        )
        setup = Setup(
            "cpu",
            "float32",
            "none",
            bs,
            None,
            "",
            Budget(args.capacity_budget, "kv-cache-memory-bytes", ""),
            hybrid=name == "hybrid",
            max_num_batched_tokens=chunk,
        )
        estimate = build_estimate(facts, setup, [KV_DTYPES[spec.dtype_name]], [length], [1], length)["kv"][0]
        sixteen = replace(spec, dtype=bytes_dtype)
        peak = peak_blocks(layout, bs, chunk, args.capacity_requests, length)
        layouts[name] = {
            "num_blocks": plan.num_blocks,
            "bytes_per_block": plan.bytes_per_block,
            "blocks_per_request": plan.blocks_per_request(length),
            "prefill_reserve_blocks": plan.prefill_reserve,
            "max_concurrency": plan.max_concurrency,
            "estimate_num_blocks": estimate["plan"]["num_blocks"],
            "estimate_blocks_per_request": estimate["plan"]["blocks_per_request"],
            "peak_blocks": peak,
            "kv_bytes": peak * sixteen.bytes_per_block,
        }
    llama: dict[str, Any] | None = None
    if args.llama_server:
        n = args.capacity_requests
        llama_args = ["-np", str(n), "-c", str(n * length), "-t", str(args.cpu_threads or os.cpu_count() or 1)]
        llama = {
            "args": llama_args,
            "kv_bytes": llama_server_kv_bytes(args.llama_server, source.path, llama_args),
            "swa_full_kv_bytes": llama_server_kv_bytes(args.llama_server, source.path, [*llama_args, "--swa-full"]),
        }
    h, u = layouts["hybrid"], layouts["uniform"]
    t1 = Table(
        f"Capacity of {args.capacity_budget / GiB:.2f} GiB of {spec.dtype_name} KV at max-model-len {length} "
        "(the start-up line; estimate's blocks beside the engine's)",
        ["layout", "blocks", "bytes a block", "blocks a request", "prefill reserve", "max concurrency", "estimate"],
    )
    for name, row in layouts.items():
        same = row["estimate_num_blocks"] == row["num_blocks"] and (
            row["estimate_blocks_per_request"] == row["blocks_per_request"]
        )
        t1.add(
            name,
            row["num_blocks"],
            row["bytes_per_block"],
            row["blocks_per_request"],
            row["prefill_reserve_blocks"],
            row["max_concurrency"],
            "same blocks" if same else f"{row['estimate_num_blocks']} blocks (differs)",
        )
    t2 = Table(
        f"KV bytes of {args.capacity_requests} requests of {length} tokens at {sixteen.dtype_name} KV (peak of a dry "
        "run of the scheduler and KV manager; llama-server: its caches' sizes in its log)",
        ["system", "MiB", "vs llama-server"],
    )
    peer = llama["kv_bytes"] if llama else None
    for name, row in layouts.items():
        t2.add(f"kvserve {name}", row["kv_bytes"] / MiB, ratio(row["kv_bytes"], peer))
    if llama:
        t2.add(f"llama-server {' '.join(llama['args'])}", llama["kv_bytes"] / MiB, 1.0)
        t2.add("llama-server ... --swa-full", llama["swa_full_kv_bytes"] / MiB, ratio(llama["swa_full_kv_bytes"], peer))
    results = {
        "budget_bytes": args.capacity_budget,
        "max_model_len": length,
        "requests": args.capacity_requests,
        "kv_cache_dtype": spec.dtype_name,
        "layouts": layouts,
        "llama_server": llama,
    }
    ratios = {
        "max_concurrency_hybrid_over_uniform": ratio(h["max_concurrency"], u["max_concurrency"]),
        "kv_bytes_hybrid_over_llama_server": ratio(h["kv_bytes"], peer),
    }
    return results, [t1, t2], ratios


def peak_blocks(layout: Any, block_size: int, chunk: int, requests: int, length: int) -> int:
    """The most blocks `requests` requests of `length` tokens hold at once while the engine's scheduler and KV manager
    serve them with `chunk`-token prefill chunks: their own allocation logic on a pool large enough for all of them,
    a fake model emitting one token a step. Each prompt is shorter than `length` by as many tokens as the others'
    prefills take steps, so the first is still decoding toward `length` when the last has prefilled: all are held at
    once at (nearly) full length, as N concurrent long requests are."""
    from kvserve.engine.request import Request
    from kvserve.engine.sampler import SampledToken
    from kvserve.engine.scheduler import Scheduler
    from kvserve.kv.manager import KVCacheManager
    from kvserve.kv.pool import BlockPool
    from kvserve.sampling_params import SamplingParams

    per_request = layout.blocks_per_request(length, block_size) + layout.prefill_extra_blocks(length, chunk, block_size)
    blocks = 2 + requests * per_request
    pool = BlockPool(blocks, enable_caching=False, num_groups=layout.num_groups)
    kv = KVCacheManager(pool, block_size, layout=layout)
    scheduler = Scheduler(kv, max_num_seqs=requests, max_num_batched_tokens=chunk, max_model_len=length)
    margin = requests * -(-length // chunk) + 1
    params = SamplingParams(max_tokens=margin, ignore_eos=True)
    for i in range(requests):
        scheduler.add(Request(str(i), [i] * (length - margin), params))
    peak = 0
    token = SampledToken(0, None, None, None)
    while scheduler.waiting or scheduler.running:
        out = scheduler.schedule()
        peak = max(peak, pool.num_usable_blocks - pool.num_free_blocks)
        scheduler.update_from_output(
            out, {s.request.request_id: [token] for s in out.scheduled if s.completes_sequence}
        )
    return peak


_KV_SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB")


def llama_server_kv_bytes(binary: str, model_path: Path, llama_args: list[str]) -> int:
    """What llama-server allocates for its KV caches with these flags: the sizes it logs (one line per cache: the
    full-attention layers' and, with a sliding window, the SWA layers'), read from a start at verbosity 4."""
    from kvserve.bench.offload_peer import LlamaServer

    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-long-context-"))
    server = LlamaServer(binary, ["-m", str(model_path), *llama_args, "-lv", "4"], log_dir / "llama-server.log")
    try:
        sizes = _KV_SIZE.findall((log_dir / "llama-server.log").read_text(errors="replace"))
    finally:
        server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    if not sizes:
        raise ValueError("llama-server logged no KV cache size (its log format changed?)")
    return round(sum(float(s) for s in sizes) * MiB)


# ---- (2) throughput ----------------------------------------------------------------------------------------------


def _throughput(
    engines: dict[str, LLMEngine], args: argparse.Namespace
) -> tuple[dict[str, Any], list[Table], dict[str, float | None]]:
    from kvserve.bench.report import Table
    from kvserve.bench.stats import ratio
    from kvserve.bench.systems import special_token_ids
    from kvserve.bench.workload import random_token_ids

    base = engines["hybrid"]
    model = base.core.model_config
    rng = random.Random(args.seed)
    bos = [model.bos_token_id] if model.bos_token_id is not None else []
    exclude = special_token_ids(base)
    span = args.throughput_prompt_len
    lengths = [rng.randint(span.low, span.high) for _ in range(args.throughput_requests)]
    prompts = [bos + random_token_ids(rng, n - len(bos), model.vocab_size, exclude) for n in lengths]
    systems: dict[str, dict[str, Any]] = {}
    for name, engine in engines.items():
        systems[name] = batch_run(engine, prompts, args.throughput_output_len, name)
        engine.core.close()
    if args.llama_server:
        systems["llama-server"] = _llama_server_batch(args, model, prompts)
    t = Table(
        f"Throughput: {len(prompts)} prompts of {args.throughput_prompt_len} tokens ({sum(lengths):,} in all) and "
        f"{args.throughput_output_len} new tokens each, added at once; {args.throughput_pool / GiB:.2f} GiB of KV",
        ["system", "wall s", "output tok/s", "all tok/s", "preemptions", "peak KV MiB"],
    )
    for name, row in systems.items():
        peak = row["peak_kv_bytes"]
        t.add(name, row["wall_s"], row["output_tok_s"], row["total_tok_s"], row["preemptions"], peak and peak / MiB)
    results = {
        "requests": len(prompts),
        "prompt_tokens": sum(lengths),
        "output_len": args.throughput_output_len,
        "pool_bytes": args.throughput_pool,
        "systems": systems,
    }
    peer = systems.get("llama-server", {}).get("output_tok_s")
    ratios = {
        "throughput_hybrid_over_uniform": ratio(systems["hybrid"]["output_tok_s"], systems["uniform"]["output_tok_s"]),
        "throughput_hybrid_over_llama_server": ratio(systems["hybrid"]["output_tok_s"], peer),
    }
    return results, [t], ratios


def batch_run(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, Any]:
    """Every prompt added at once and run to the end (a progress bar of finished requests): wall time, tokens a
    second, preemptions, and the peak bytes of the blocks held."""
    from tqdm import tqdm

    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    pool = engine.core.pool
    before = engine.core.scheduler.num_preemptions
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    peak = 0
    with tqdm(total=len(prompts), desc=f"throughput ({tag})", unit="request", leave=False) as bar:
        while engine.has_unfinished_requests():
            finished = sum(1 for out in engine.step() if out.finished)
            peak = max(peak, pool.num_usable_blocks - pool.num_free_blocks)
            bar.update(finished)
    wall = time.perf_counter() - start
    generated = len(prompts) * output_len
    return {
        "wall_s": wall,
        "output_tok_s": generated / wall,
        "total_tok_s": (generated + sum(len(p) for p in prompts)) / wall,
        "preemptions": engine.core.scheduler.num_preemptions - before,
        "peak_kv_bytes": peak * engine.core.cache_plan.bytes_per_block,
        "args": ["--kv-cache-memory-bytes", str(engine.config.kv_cache_memory_bytes)]
        + (["--disable-hybrid-kv-cache-manager"] if engine.config.disable_hybrid_kv_cache_manager else []),
    }


def llama_slots(model: ModelConfig, ctx: int, memory: int, bytes_per_element: int = 2) -> int:
    """How many llama-server slots of `ctx` tokens fit `memory` bytes of f16 KV with its iSWA cache: each slot keeps
    every token of the global layers and window + 512 (one ubatch) tokens of each sliding one (PERF_FACTS.md)."""
    cell = 2 * model.num_kv_heads * model.head_dim * bytes_per_element  # K and V of one token in one layer
    per_slot = sum(cell * (ctx if w is None else min(ctx, w + 512)) for w in model.sliding_windows)
    return max(1, memory // per_slot)


def _llama_server_batch(args: argparse.Namespace, model: ModelConfig, prompts: list[list[int]]) -> dict[str, Any]:
    """The same prompts at once over HTTP to llama-server whose slots (-np) fill the same KV memory (its default
    iSWA cache at f16), each slot's context the longest request's."""
    from kvserve.bench.offload_peer import LlamaServer
    from kvserve.bench.serve_client import Endpoint, run_load
    from kvserve.model.source import resolve_model

    ctx = max(len(p) for p in prompts) + args.throughput_output_len + 16
    slots = llama_slots(model, ctx, args.throughput_pool)
    threads = str(args.cpu_threads or os.cpu_count() or 1)
    llama_args = ["-np", str(slots), "-c", str(slots * ctx), "-t", threads, "--cache-ram", "0"]
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-long-context-"))
    server = LlamaServer(args.llama_server, ["-m", str(resolve_model(args.model).path), *llama_args], log_dir / "l.log")
    try:
        run = asyncio.run(
            run_load(Endpoint(server.base_url), prompts, args.throughput_output_len, True, None, float("inf"), 0, 3600)
        )
    finally:
        server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    if len(run.completed) != len(prompts):
        failed = next(r.error for r in run.results if not r.ok)
        raise RuntimeError(f"llama-server failed {len(prompts) - len(run.completed)} requests: {failed}")
    generated = run.output_tokens
    return {
        "wall_s": run.duration_s,
        "output_tok_s": generated / run.duration_s,
        "total_tok_s": (generated + sum(len(p) for p in prompts)) / run.duration_s,
        "preemptions": None,
        "peak_kv_bytes": None,
        "args": llama_args,
    }


# ---- (3) decode ----------------------------------------------------------------------------------------------------


def _decode(
    base: LLMEngine | None, args: argparse.Namespace
) -> tuple[dict[str, Any], list[Table], dict[str, float | None]]:
    from kvserve.bench.report import Table
    from kvserve.bench.stats import ratio
    from kvserve.bench.systems import special_token_ids
    from kvserve.bench.workload import random_token_ids

    assert base is not None
    model = base.core.model_config
    rng = random.Random(args.seed + 1)
    bos = [model.bos_token_id] if model.bos_token_id is not None else []
    prompt = bos + random_token_ids(rng, args.decode_context - len(bos), model.vocab_size, special_token_ids(base))
    pool = int(1.2 * max(args.decode_batches) * (args.decode_context + 64) * base.core.kv_config.bytes_per_token)
    engines = _engine_pair(base, pool)
    rows = []
    for batch in args.decode_batches:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for rep in range(args.repeats):
            names = list(engines)
            for name in names[rep % 2 :] + names[: rep % 2]:
                times[name].append(decode_step_ms(engines[name], prompt, batch, args.decode_steps, f"d{batch}-{rep}"))
        rows.append({"batch": batch, **{name: statistics.median(t) for name, t in times.items()}})
    for engine in engines.values():
        engine.core.close()
    t = Table(
        f"Decode step at a {args.decode_context}-token context (median ms of {args.decode_steps} steps x "
        f"{args.repeats} repeats, layouts alternated)",
        ["batch", "hybrid ms", "uniform ms", "hybrid / uniform"],
    )
    ratios: dict[str, float | None] = {}
    for row in rows:
        r = ratio(row["hybrid"], row["uniform"])
        t.add(row["batch"], row["hybrid"], row["uniform"], r)
        ratios[f"decode_step_hybrid_over_uniform@{row['batch']}"] = r
    return {"context": args.decode_context, "steps": args.decode_steps, "rows": rows}, [t], ratios


def decode_step_ms(engine: LLMEngine, prompt: list[int], batch: int, steps: int, tag: str) -> float:
    """Median milliseconds of `steps` decode steps of `batch` copies of `prompt` (prefilled first, its blocks shared
    as a prefix hit; each copy reads its whole context in every step)."""
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prompt, params)
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    engine.step()  # the first all-decode step's one-time costs, outside the measurement
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[:steps])


# ---- (4) chat ------------------------------------------------------------------------------------------------------


def _chat(
    base: LLMEngine | None, args: argparse.Namespace
) -> tuple[dict[str, Any], list[Table], dict[str, float | None]]:
    from kvserve.bench.chat import ChatWorkload, multi_round_chat
    from kvserve.bench.report import Table
    from kvserve.bench.stats import ratio
    from kvserve.bench.systems import special_token_ids

    assert base is not None
    tier = f"{args.chat_tier}B"
    engines = _engine_pair(base, args.chat_pool)
    engines["hybrid + tier"] = base.sibling(kv_cache_memory_bytes=args.chat_pool, kv_offloading_size=tier)
    engines["uniform + tier"] = base.sibling(
        kv_cache_memory_bytes=args.chat_pool, kv_offloading_size=tier, disable_hybrid_kv_cache_manager=True
    )
    model = base.core.model_config
    workload = ChatWorkload(
        args.chat_users, args.chat_rounds, args.chat_system_tokens, args.chat_question_tokens, args.chat_output_len
    )
    bos = [model.bos_token_id] if model.bos_token_id is not None else []
    rows, working_set = multi_round_chat(
        engines, workload, random.Random(args.seed + 2), model.vocab_size, special_token_ids(base), bos
    )
    for engine in engines.values():
        engine.core.close()
    t = Table(
        f"Multi-round chat: {args.chat_users} users x {args.chat_rounds} rounds, {args.chat_system_tokens}-token "
        f"system prompts (working set {working_set:,} tokens); {args.chat_pool / MiB:.0f} MiB pool, "
        f"{args.chat_tier / MiB:.0f} MiB host tier",
        ["system", "TTFT p50 ms", "TTFT p90 ms", "throughput tok/s", "pool hit rate", "tier hit rate"],
    )
    for name, row in rows.items():
        t.add(
            name,
            row["ttft_ms_p50"],
            row["ttft_ms_p90"],
            row["throughput_tok_s"],
            row["pool_hit_rate"],
            row["tier_hit_rate"],
        )
    h, u = rows["hybrid"], rows["uniform"]
    ratios = {
        "chat_ttft_p50_hybrid_over_uniform": ratio(h["ttft_ms_p50"], u["ttft_ms_p50"]),
        "chat_hit_rate_hybrid_minus_uniform": (h["pool_hit_rate"] + h["tier_hit_rate"])
        - (u["pool_hit_rate"] + u["tier_hit_rate"]),
        "chat_tier_ttft_p50_hybrid_over_uniform": ratio(
            rows["hybrid + tier"]["ttft_ms_p50"], rows["uniform + tier"]["ttft_ms_p50"]
        ),
    }
    results = {
        "users": args.chat_users,
        "rounds": args.chat_rounds,
        "system_tokens": args.chat_system_tokens,
        "working_set_tokens": working_set,
        "pool_bytes": args.chat_pool,
        "tier_bytes": args.chat_tier,
        "systems": rows,
    }
    return results, [t], ratios


def _plot(results: dict[str, Any], path: str) -> None:
    """One bar panel per section that ran: hybrid against uniform (and llama-server where it ran)."""
    from kvserve.bench.plot import BarPanel, Series, bar_panels

    groups = ["hybrid", "uniform", "llama-server"]
    panels = []
    if "capacity" in results:
        c = results["capacity"]
        values = [c["layouts"][g]["max_concurrency"] for g in LAYOUTS] + [None]
        panels.append(
            BarPanel(f"max concurrency at {c['max_model_len']}", "requests", [Series("in the budget", [], values)])
        )
    if "throughput" in results:
        s = results["throughput"]["systems"]
        values = [s.get(g, {}).get("output_tok_s") for g in groups]
        panels.append(BarPanel("long-prompt batch", "output tok/s", [Series("throughput", [], values)]))
    if "decode" in results:
        d = results["decode"]
        series = [Series(f"batch {r['batch']}", [], [r["hybrid"], r["uniform"], None]) for r in d["rows"]]
        panels.append(BarPanel(f"decode step at {d['context']}", "ms", series))
    if "chat" in results:
        s = results["chat"]["systems"]
        series = [
            Series("no tier", [], [s["hybrid"]["ttft_ms_p50"], s["uniform"]["ttft_ms_p50"], None]),
            Series("host tier", [], [s["hybrid + tier"]["ttft_ms_p50"], s["uniform + tier"]["ttft_ms_p50"], None]),
        ]
        panels.append(BarPanel("multi-round chat", "TTFT p50 ms", series))
    bar_panels(path, groups, panels, "kvserve bench long-context: KV cache groups against the uniform layout")
