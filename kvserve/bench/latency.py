"""`kvserve bench latency`: one request's TTFT and decode speed at several prompt lengths, decode step time at
several batch sizes, and (--depth) decode over a cached prompt of N tokens at each KV cache dtype asked for, against
HF transformers and llama.cpp (llama-bench, and its -d at depth), with each figure's floor."""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.bench import depth as depth_section
from kvserve.bench.options import (
    add_engine_args,
    add_output_args,
    add_repeats_arg,
    int_list,
    new_command,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvserve.bench.report import Report, Table
    from kvserve.bench.systems import System, Timeline
    from kvserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)

SCHEMA = (
    """\
results: {
  "single": [{"system", "prompt_len", "output_len", "ttft_ms", "ttft_ms_runs", "decode_ms_per_token",
              "decode_ms_per_token_runs", "decode_ms_per_token_mean_runs", "decode_tokens_per_s",
              "prefill_floor_ms", "decode_floor_ms"}],
  "batch": [{"system", "batch_size", "prompt_len", "output_len", "ms_per_step", "ms_per_step_runs",
             "ms_per_token", "tokens_per_s", "floor_ms_per_step"}],
  "ceilings": {"copy_bandwidth_gbps", "read_bandwidth_gbps", "matmul_gflops", "int8_matmul_gops" (null unless
               an int8 system ran), "bandwidth_gbps_used"},
  "model_cost": {"weight_bytes_per_step", "matmul_params", "lm_head_params", "kv_bytes_per_token", "num_layers",
                 "num_heads", "head_dim", "sliding_windows"},
"""
    + depth_section.SCHEMA
    + """}
ratios: {"prefill_speed@prompt<L>:kvserve/<peer>", "decode_speed@prompt<L>:kvserve/<peer>",
         "decode_speed@batch<B>:kvserve/<peer>", "floor/kvserve decode@batch<B>"} (> 1: kvserve is faster;
         the floor ratio is the share of the floor's speed that kvserve reaches); with --peer kvserve-int8 the same
         keys with kvserve-int8 in kvserve's place, against every other system (kvserve, the exact path, included);
         with --depth:"""
    + depth_section.RATIOS
    + """
Times are medians over --repeats runs, a run's decode time its median step (a stall of the host moves a mean over
the steps, not the median: decode_ms_per_token_mean_runs has the means); floors are max(bytes read / bandwidth,
FLOPs / matmul rate) with both rates measured in the same run. llama.cpp rows come from llama-bench (pp and tg at
empty context, run midway through kvserve's repeats; tg after a context of N tokens at depth, between the halves of
each depth's runs)."""
)


@dataclass(frozen=True, slots=True)
class LatencyPlan:
    prompt_lens: list[int]
    output_len: int
    batch_sizes: list[int]
    batch_prompt_len: int
    batch_output_len: int
    repeats: int
    seed: int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "latency",
        "TTFT and decode speed of one request, decode step time by batch size",
        __doc__.splitlines()[0],
        SCHEMA,
    )
    w = p.add_argument_group("workload")
    w.add_argument("--prompt-lens", type=int_list, default=[32, 512, 2048], help="single-request prompt lengths")
    w.add_argument("--output-len", type=int, default=32, help="tokens decoded per single request")
    w.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32], help="decode batch sizes")
    w.add_argument("--batch-prompt-len", type=int, default=32, help="prompt length of each batched request")
    w.add_argument("--batch-output-len", type=int, default=16, help="tokens decoded per batched request")
    w.add_argument(
        "--peer",
        action="append",
        choices=["hf", "llama-cpp", "kvserve-int8"],
        default=[],
        help="peers measured in the same run (repeatable); kvserve-int8 is kvserve on the same flags with "
        "--activation-quantization int8",
    )
    w.add_argument(
        "--llama-bench",
        type=Path,
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-bench binary (scripts/build_llama_cpp.sh builds it); without it the "
        "llama-cpp peer is skipped with a note",
    )
    w.add_argument(
        "--llama-cpp-model",
        type=Path,
        default=None,
        metavar="FILE.gguf",
        help="the GGUF llama-bench loads (default: --model when it is a .gguf file or the default model)",
    )
    depth_section.add_args(w)
    add_repeats_arg(p, default=3)
    add_output_args(p, "TTFT by prompt length and decode ms/token by batch size, with floors")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench.common import INT8_PEER, load_hf_peer, load_int8_activation_peer, load_kvserve
    from kvserve.bench.floor import model_cost
    from kvserve.bench.machine import machine_info, measure_ceilings
    from kvserve.bench.report import Report, config_of, emit

    plan = LatencyPlan(
        args.prompt_lens,
        args.output_len,
        args.batch_sizes,
        args.batch_prompt_len,
        args.batch_output_len,
        args.repeats,
        args.seed,
    )
    kvserve = load_kvserve(args)
    engine = kvserve.engine
    systems: list[System] = [kvserve]
    if "hf" in args.peer:
        systems.append(load_hf_peer(args, kvserve))
    if INT8_PEER in args.peer:
        systems.append(load_int8_activation_peer(args))
    int8 = {INT8_PEER} | ({"kvserve"} if args.activation_quantization == "int8" else set())
    report = Report("latency", machine_info(), config_of(args))
    device = str(engine.core.device)
    ceilings = measure_ceilings(device=device, int8=bool(int8 & {s.name for s in systems}))
    model = engine.core.runner.model
    assert isinstance(model, torch.nn.Module), "the floor is counted over a loaded torch module's tensors"
    cost = model_cost(model, engine.core.model_config, engine.core.kv_config.bytes_per_token)
    # llama-bench's pp / tg runs between the halves of kvserve's repeats (as --depth's do), so that a host whose speed
    # drifts over the minutes of a run moves both systems' figures alike.
    llama_rows: tuple[list[dict], list[dict]] = ([], [])

    def llama_midway() -> None:
        nonlocal llama_rows
        llama_rows = llama_cpp_rows(args, plan, report)

    single, batch = measure(systems, plan, engine, midway=llama_midway if "llama-cpp" in args.peer else None)
    depth_plan, depth_rows = depth_section.plan_from_args(args), []
    if depth_plan is not None:
        llama = llama_cpp_depth(args, engine, report) if "llama-cpp" in args.peer else None
        depth_systems = depth_section.depth_systems(args, depth_plan, kvserve)
        depth_rows = depth_section.measure(depth_plan, depth_systems, llama, report, args.seed)
    # Measured again afterwards: on a shared machine the ceilings drift too, and a floor must be the best case.
    ceilings = ceilings.best_of(measure_ceilings(device=device, int8=ceilings.int8_matmul_gops is not None))
    depth_section.add_floors(depth_rows, cost, ceilings, int8="kvserve" in int8)
    single += llama_rows[0]
    batch += llama_rows[1]
    # Each system's rows against its own floor: int8 activations' matmuls at the int8 rate, the others' at float32's.
    for row in single:
        i8 = row["system"] in int8
        row["prefill_floor_ms"] = cost.prefill_floor_ms(ceilings, row["prompt_len"], i8)
        row["decode_floor_ms"] = cost.decode_floor_ms(ceilings, 1, row["prompt_len"] + row["output_len"] // 2, i8)
    for row in batch:
        row["floor_ms_per_step"] = cost.decode_floor_ms(
            ceilings, row["batch_size"], row["prompt_len"] + row["output_len"] // 2, row["system"] in int8
        )
    report.results = {"single": single, "batch": batch, "ceilings": ceilings.to_json(), "model_cost": cost.to_json()}
    report.ratios = ratios(single, batch)
    report.tables += tables(single, batch, plan)
    if depth_plan is not None:
        report.results["depth"] = depth_rows
        report.ratios.update(depth_section.ratios(depth_rows))
        report.tables.append(depth_section.table(depth_rows, depth_plan))
    report.notes.append(
        f"Floors: {cost.weight_bytes_per_step / 1e6:.0f} MB of weights per step at "
        f"{ceilings.bandwidth_gbps:.1f} GB/s (measured: copy {ceilings.copy_bandwidth_gbps:.1f}, read "
        f"{ceilings.read_bandwidth_gbps:.1f}), {2 * cost.matmul_params / 1e6:.0f} MFLOP per token at "
        f"{ceilings.matmul_gflops:.0f} GFLOP/s (fp32 matmul, measured)"
        + (
            f"; int8 activations' matmuls at {ceilings.int8_matmul_gops:.0f} GOP/s (torch._int_mm, measured)"
            if ceilings.int8_matmul_gops is not None
            else ""
        )
    )
    if args.plot:
        plot(args.plot, single, batch, depth_rows)
    emit(report, args.json)
    return 0


def measure(
    systems: list[System], plan: LatencyPlan, engine: LLMEngine, midway: Callable[[], None] | None = None
) -> tuple[list[dict], list[dict]]:
    """Alternate systems inside every repeat, with fresh random prompts each time (no prefix-cache hits); `midway`
    (a peer measured outside this process) runs once, before repeat repeats // 2."""
    from kvserve.bench.systems import special_token_ids
    from kvserve.bench.workload import random_token_ids

    vocab, exclude = engine.core.model_config.vocab_size, special_token_ids(engine)
    rng = random.Random(plan.seed)
    single_runs: dict[tuple[str, int], list[Timeline]] = {(s.name, n): [] for s in systems for n in plan.prompt_lens}
    batch_runs: dict[tuple[str, int], list[Timeline]] = {(s.name, b): [] for s in systems for b in plan.batch_sizes}
    for repeat in range(plan.repeats):
        if midway is not None and repeat == plan.repeats // 2:
            midway()
        for n in plan.prompt_lens:
            prompt = random_token_ids(rng, n, vocab, exclude)
            for s in systems:
                single_runs[(s.name, n)].append(s.timed_generate([prompt], plan.output_len))
        for b in plan.batch_sizes:
            prompts = [random_token_ids(rng, plan.batch_prompt_len, vocab, exclude) for _ in range(b)]
            for s in systems:
                batch_runs[(s.name, b)].append(s.timed_generate(prompts, plan.batch_output_len))
    single = [single_row(name, n, plan.output_len, runs) for (name, n), runs in single_runs.items()]
    batch = [batch_row(name, b, plan, runs) for (name, b), runs in batch_runs.items()]
    return single, batch


def single_row(system: str, prompt_len: int, output_len: int, timelines: list[Timeline]) -> dict:
    from kvserve.bench.stats import median

    ttft = [1e3 * t.ttft_s for t in timelines]
    decode = [1e3 * t.decode_step_s for t in timelines if t.decode_step_s is not None]
    decode_ms = median(decode) if decode else None
    means = [1e3 * t.decode_step_mean_s for t in timelines if t.decode_step_mean_s is not None]
    return {
        "system": system,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "ttft_ms": median(ttft),
        "ttft_ms_runs": ttft,
        "decode_ms_per_token": decode_ms,
        "decode_ms_per_token_runs": decode,
        "decode_ms_per_token_mean_runs": means,  # each run's mean step, stalls included (decode_ms: its median step)
        "decode_tokens_per_s": 1e3 / decode_ms if decode_ms else None,
    }


def batch_row(system: str, batch_size: int, plan: LatencyPlan, timelines: list[Timeline]) -> dict:
    from kvserve.bench.stats import median

    steps = [1e3 * t.decode_step_s for t in timelines if t.decode_step_s is not None]
    step_ms = median(steps) if steps else None
    return {
        "system": system,
        "batch_size": batch_size,
        "prompt_len": plan.batch_prompt_len,
        "output_len": plan.batch_output_len,
        "ms_per_step": step_ms,
        "ms_per_step_runs": steps,
        "ms_per_token": step_ms / batch_size if step_ms else None,
        "tokens_per_s": 1e3 * batch_size / step_ms if step_ms else None,
    }


def llama_cpp_gguf(args: argparse.Namespace) -> tuple[Path | None, str]:
    """The GGUF file llama-bench loads and, where there is none or no binary, why the peer is skipped."""
    from kvserve.model.source import ModelFormat, resolve_model

    source = resolve_model(args.model)
    gguf = args.llama_cpp_model or (source.path if source.format == ModelFormat.GGUF else None)
    if args.llama_bench is None or gguf is None:
        why = "no --llama-bench PATH given" if args.llama_bench is None else "no GGUF file (--llama-cpp-model)"
        return None, f"llama.cpp peer skipped: {why} (scripts/build_llama_cpp.sh builds llama-bench)"
    return gguf, ""


def llama_cpp_depth(args: argparse.Namespace, engine: LLMEngine, report: Report) -> depth_section.LlamaDepth | None:
    """llama-bench -d at each depth, on the GGUF kvserve's engine loaded (None, with a note, where it cannot run)."""
    import torch

    gguf, why = llama_cpp_gguf(args)
    if gguf is None:
        if why not in report.notes:
            report.notes.append(why)
        return None
    c = engine.core.kv_config
    return depth_section.LlamaDepth(
        str(args.llama_bench), str(gguf), torch.get_num_threads(), c.num_layers, c.num_kv_heads, c.head_dim
    )


def llama_cpp_rows(args: argparse.Namespace, plan: LatencyPlan, report: Report) -> tuple[list[dict], list[dict]]:
    """llama-bench's pp/tg rates as rows of the same tables (TTFT = prompt / pp rate)."""
    from kvserve.bench.peers.llama_cpp import run_llama_bench

    gguf, why = llama_cpp_gguf(args)
    if gguf is None:
        if why not in report.notes:
            report.notes.append(why)
        return [], []
    import torch

    result = run_llama_bench(
        args.llama_bench, gguf, plan.prompt_lens, max(plan.output_len, 1), torch.get_num_threads(), plan.repeats
    )
    report.notes.append(
        "llama.cpp rows: llama-bench pp<N> for TTFT (prompt processing only) and tg"
        f"{result.decode_tokens} at empty context for decode; batch 1 only"
    )
    tg = result.decode_tokens_per_s
    decode_ms = 1e3 / tg if tg else None
    pp = result.prompt_tokens_per_s
    single: list[dict] = [
        {
            "system": "llama.cpp",
            "prompt_len": n,
            "output_len": plan.output_len,
            "ttft_ms": 1e3 * n / pp[n] if n in pp else None,
            "ttft_ms_runs": [],
            "decode_ms_per_token": decode_ms,
            "decode_ms_per_token_runs": [],
            "decode_ms_per_token_mean_runs": [],
            "decode_tokens_per_s": tg,
        }
        for n in plan.prompt_lens
    ]
    batch = [
        {
            "system": "llama.cpp",
            "batch_size": 1,
            "prompt_len": 0,
            "output_len": result.decode_tokens,
            "ms_per_step": decode_ms,
            "ms_per_step_runs": [],
            "ms_per_token": decode_ms,
            "tokens_per_s": tg,
        }
    ]
    return single, batch


def ratios(single: list[dict], batch: list[dict]) -> dict[str, float | None]:
    """kvserve's speed over each peer's (inverse time ratios), and kvserve's share of the floor's speed. With the
    kvserve-int8 peer, its speed over every other system's too (kvserve's exact path included)."""
    from kvserve.bench.common import INT8_PEER
    from kvserve.bench.stats import ratio

    out: dict[str, float | None] = {}
    names = list(dict.fromkeys(r["system"] for r in single + batch))
    pairs = [("kvserve", other) for other in names if other != "kvserve"]
    if INT8_PEER in names:
        pairs += [(INT8_PEER, other) for other in names if other != INT8_PEER]
    for mine, other in pairs:
        a = {r["prompt_len"]: r for r in single if r["system"] == mine}
        for r in single:
            if r["system"] == other and r["prompt_len"] in a:
                k = a[r["prompt_len"]]
                out[f"prefill_speed@prompt{r['prompt_len']}:{mine}/{other}"] = ratio(r["ttft_ms"], k["ttft_ms"])
                out[f"decode_speed@prompt{r['prompt_len']}:{mine}/{other}"] = ratio(
                    r["decode_ms_per_token"], k["decode_ms_per_token"]
                )
        b = {r["batch_size"]: r for r in batch if r["system"] == mine}
        for r in batch:
            if r["system"] == other and r["batch_size"] in b:
                out[f"decode_speed@batch{r['batch_size']}:{mine}/{other}"] = ratio(
                    r["ms_per_step"], b[r["batch_size"]]["ms_per_step"]
                )
    for mine in ("kvserve", INT8_PEER):
        for r in batch:
            if r["system"] == mine:
                out[f"floor/{mine} decode@batch{r['batch_size']}"] = ratio(r["floor_ms_per_step"], r["ms_per_step"])
    return out


def tables(single: list[dict], batch: list[dict], plan: LatencyPlan) -> list[Table]:
    from kvserve.bench.report import Table

    t1 = Table(
        f"Single request: TTFT and decode of {plan.output_len} tokens (medians of {plan.repeats})",
        ["system", "prompt", "TTFT ms", "floor ms", "decode ms/tok", "floor ms/tok", "decode tok/s"],
    )
    for r in sorted(single, key=lambda r: (r["prompt_len"], r["system"] != "kvserve")):
        t1.add(
            r["system"],
            r["prompt_len"],
            r["ttft_ms"],
            r["prefill_floor_ms"],
            r["decode_ms_per_token"],
            r["decode_floor_ms"],
            r["decode_tokens_per_s"],
        )
    t2 = Table(
        f"Batched decode: {plan.batch_prompt_len}-token prompts, {plan.batch_output_len} tokens each",
        ["system", "batch", "ms/step", "floor ms/step", "ms/token", "tok/s"],
    )
    for r in sorted(batch, key=lambda r: (r["batch_size"], r["system"] != "kvserve")):
        t2.add(
            r["system"], r["batch_size"], r["ms_per_step"], r["floor_ms_per_step"], r["ms_per_token"], r["tokens_per_s"]
        )
    return [t1, t2]


def plot(path: str, single: list[dict], batch: list[dict], depth_rows: list[dict]) -> None:
    from kvserve.bench.plot import Panel, Series, line_plot

    names = list(dict.fromkeys(r["system"] for r in single + batch))

    def series(rows: list[dict], x: str, y: str) -> list[Series]:
        out = []
        for name in names:
            mine = sorted((r for r in rows if r["system"] == name), key=lambda r: r[x])
            if mine:
                out.append(Series(name, [r[x] for r in mine], [r[y] for r in mine]))
        return out

    def floor_series(rows: list[dict], x: str, y: str) -> Series:
        mine = sorted((r for r in rows if r["system"] == "kvserve"), key=lambda r: r[x])
        return Series("floor", [r[x] for r in mine], [r[y] for r in mine], style="k--")

    panels = [
        Panel(
            "Time to first token (one request)",
            "prompt tokens",
            "ms",
            series(single, "prompt_len", "ttft_ms") + [floor_series(single, "prompt_len", "prefill_floor_ms")],
            log_x=True,
            log_y=True,
        ),
        Panel(
            "Decode step time",
            "batch size",
            "ms per step",
            series(batch, "batch_size", "ms_per_step") + [floor_series(batch, "batch_size", "floor_ms_per_step")],
            log_x=True,
            log_y=True,
        ),
    ]
    if depth_rows:
        panels.append(depth_section.panel(depth_rows))
    line_plot(path, panels)
