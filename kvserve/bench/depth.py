"""`kvserve bench latency --depth N[,N...]`: decode over a cached prompt of N tokens (llama-bench's `-d`), for
kvserve at each KV cache dtype asked for and for llama.cpp at each of its cache types, with the floor of each.

What is measured: a generation of --output-len tokens after a prompt of `depth` random tokens, whose KV is already
cached (a first, untimed generation over the same prompt fills the prefix cache, as llama-bench's depth run fills its
context and keeps it across repetitions); the figure is the mean time of its decode steps, at contexts depth + 1 ..
depth + output_len. llama.cpp: `llama-bench -p 0 -n OUTPUT_LEN -d DEPTH` (its tg at that depth). Systems alternate:
each depth's kvserve runs are split around the llama-bench call (half before, half after), kvserve's dtypes in turn
within each round.

The floor of a figure: max(bytes / bandwidth, FLOPs / matmul rate) of one step at context depth + output_len / 2:
every weight once plus the context's K and V at the cache's bytes a token (kvserve's dtype; llama.cpp's f16: 2 bytes
a value, its q8_0: 34 bytes a run of 32), and 2 FLOPs a weight plus 4 a head dim per attended key."""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.bench.floor import ModelCost
    from kvserve.bench.machine import Ceilings
    from kvserve.bench.plot import Panel
    from kvserve.bench.report import Report, Table
    from kvserve.bench.systems import KVServeSystem

log = logging.getLogger(__name__)

LLAMA_CPP = "llama.cpp"
# llama.cpp's KV cache types (llama-bench -ctk/-ctv) this command knows the bytes of: bytes per run of 32 values.
LLAMA_CPP_KV_BYTES_PER_32 = {"f32": 128, "f16": 64, "bf16": 64, "q8_0": 34}

SCHEMA = """  "depth": [{"system", "kv_cache_dtype", "depth", "output_len", "decode_ms_per_token",
             "decode_ms_per_token_runs", "kv_bytes_per_token", "floor_ms"}]   (with --depth)"""
RATIOS = """ "decode_speed@depth<N>:<system>/<peer>" (kvserve at each KV dtype against llama.cpp at each cache type),
 "floor/<system> decode@depth<N>" (the share of the floor's speed reached)"""


@dataclass(frozen=True, slots=True)
class DepthPlan:
    depths: list[int]
    output_len: int
    repeats: int
    kv_dtypes: list[str]  # kvserve's, as --kv-cache-dtype names; the engine's own first
    llama_kv_types: list[str]  # llama-bench -ctk/-ctv values


def add_args(group: argparse._ArgumentGroup) -> None:
    from kvserve.bench.options import int_list

    group.add_argument(
        "--depth",
        type=int_list,
        default=[],
        metavar="N[,N...]",
        help="decode over a cached prompt of N tokens (llama-bench's -d), at each N; see the depth section below",
    )
    group.add_argument(
        "--depth-kv-cache-dtypes",
        type=_names,
        default=[],
        metavar="DTYPE[,DTYPE...]",
        help="kvserve KV cache dtypes measured at depth besides --kv-cache-dtype's (each its own engine, its KV "
        "budget sized to the deepest context)",
    )
    group.add_argument(
        "--llama-cpp-kv-types",
        type=_names,
        default=["f16"],
        metavar="TYPE[,TYPE...]",
        help=f"llama-bench cache types at depth (-ctk/-ctv; of {', '.join(LLAMA_CPP_KV_BYTES_PER_32)}; "
        "default f16, llama.cpp's own default)",
    )


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected names separated by commas, got {text!r}")
    return names


def plan_from_args(args: argparse.Namespace) -> DepthPlan | None:
    from kvserve.vocab import KV_DTYPES, check_choice

    if not args.depth:
        return None
    for name in args.depth_kv_cache_dtypes:
        check_choice("--depth-kv-cache-dtypes", name, ("auto", *KV_DTYPES))
    for name in args.llama_cpp_kv_types:
        check_choice("--llama-cpp-kv-types", name, tuple(LLAMA_CPP_KV_BYTES_PER_32))
    dtypes = list(dict.fromkeys([args.kv_cache_dtype, *args.depth_kv_cache_dtypes]))
    return DepthPlan(sorted(args.depth), args.output_len, args.repeats, dtypes, args.llama_cpp_kv_types)


@dataclass(frozen=True, slots=True)
class DepthSystem:
    """kvserve at one KV cache dtype, as the depth rows name it, e.g. "kvserve (bfloat16 KV)"."""

    label: str
    system: KVServeSystem

    @property
    def kv_dtype(self) -> str:
        return self.system.engine.core.kv_config.dtype_name


def depth_systems(args: argparse.Namespace, plan: DepthPlan, kvserve: KVServeSystem) -> list[DepthSystem]:
    """kvserve at each KV dtype of the plan: the command's own engine for its --kv-cache-dtype, and one more engine per
    other dtype with a KV budget of the deepest context (so that several fit in memory together)."""
    from kvserve.bench.common import warm_up
    from kvserve.bench.systems import KVServeSystem
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine_args import engine_config_from_args

    deepest = plan.depths[-1] + plan.output_len
    limit = kvserve.engine.core.max_model_len
    if deepest > limit:
        raise SystemExit(
            f"--depth {plan.depths[-1]} with --output-len {plan.output_len} needs a context of {deepest} tokens; "
            f"this engine's max-model-len is {limit}"
        )
    systems = []
    base = engine_config_from_args(args)
    for name in plan.kv_dtypes:
        if name == args.kv_cache_dtype:
            system = kvserve
        else:
            probe = kvserve.engine.core.kv_config
            budget = _kv_budget(probe.num_layers, probe.num_kv_heads, probe.head_dim, probe.block_size, name, deepest)
            system = KVServeSystem(
                LLMEngine.from_config(replace(base, kv_cache_dtype=name, kv_cache_memory_bytes=budget))
            )
            warm_up(system)
        systems.append(DepthSystem(f"kvserve ({system.engine.core.kv_config.dtype_name} KV)", system))
    return systems


def _kv_budget(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: str, tokens: int) -> int:
    """Bytes of KV cache for `tokens` tokens at `dtype` with a few blocks to spare (every layer keeps every token;
    windows only need less)."""
    import torch

    from kvserve.kv.cache import KVCacheConfig, resolve_kv_cache_dtype

    config = KVCacheConfig(layers, kv_heads, head_dim, block_size, resolve_kv_cache_dtype(dtype, torch.float32))
    return (tokens // block_size + 8) * config.bytes_per_block


def measure(
    plan: DepthPlan, systems: list[DepthSystem], llama: LlamaDepth | None, report: Report, seed: int
) -> list[dict]:
    """Rows of decode at depth: kvserve's systems alternated within each round, llama-bench between the halves."""
    from kvserve.bench.systems import special_token_ids
    from kvserve.bench.workload import random_token_ids

    engine = systems[0].system.engine
    vocab, exclude = engine.core.model_config.vocab_size, special_token_ids(engine)
    rng = random.Random(seed + 57)
    rows: list[dict] = []
    for depth in plan.depths:
        prompt = random_token_ids(rng, depth, vocab, exclude)
        runs: dict[str, list[float]] = {s.label: [] for s in systems}
        for s in systems:  # fills the prefix cache: the depth's prefill, untimed
            log.info("%s: prefilling a depth of %d tokens", s.label, depth)
            s.system.timed_generate([prompt], plan.output_len)
        for round_index in range(plan.repeats):
            if llama is not None and round_index == plan.repeats // 2:
                rows += llama.rows(depth, plan, report)
            for s in systems:
                step_s = s.system.timed_generate([prompt], plan.output_len).decode_step_s
                if step_s is not None:
                    runs[s.label].append(1e3 * step_s)
        for s in systems:
            rows.append(_row(s.label, s.kv_dtype, depth, plan, runs[s.label]))
            rows[-1]["kv_bytes_per_token"] = s.system.engine.core.kv_config.bytes_per_token
    return rows


def _row(system: str, kv_dtype: str, depth: int, plan: DepthPlan, runs: list[float]) -> dict:
    from kvserve.bench.stats import median

    return {
        "system": system,
        "kv_cache_dtype": kv_dtype,
        "depth": depth,
        "output_len": plan.output_len,
        "decode_ms_per_token": median(runs) if runs else None,
        "decode_ms_per_token_runs": runs,
        "kv_bytes_per_token": None,
        "floor_ms": None,
    }


@dataclass(frozen=True, slots=True)
class LlamaDepth:
    """llama-bench on the same GGUF at each depth and cache type."""

    binary: str
    gguf: str
    threads: int
    layers: int
    kv_heads: int
    head_dim: int

    def rows(self, depth: int, plan: DepthPlan, report: Report) -> list[dict]:
        from pathlib import Path

        from kvserve.bench.peers.llama_cpp import run_llama_bench_depth

        out = []
        for kv_type in plan.llama_kv_types:
            log.info("llama-bench: a depth of %d tokens, %s cache", depth, kv_type)
            tokens_per_s = run_llama_bench_depth(
                Path(self.binary), Path(self.gguf), depth, plan.output_len, self.threads, plan.repeats, kv_type
            )
            row = _row(f"{LLAMA_CPP} ({kv_type} KV)", kv_type, depth, plan, [])
            row["decode_ms_per_token"] = 1e3 / tokens_per_s if tokens_per_s else None
            row["kv_bytes_per_token"] = (
                2 * self.layers * self.kv_heads * self.head_dim * LLAMA_CPP_KV_BYTES_PER_32[kv_type] // 32
            )
            out.append(row)
        if not any(f"llama-bench -p 0 -n {plan.output_len} -d" in n for n in report.notes):
            report.notes.append(
                f"llama.cpp at depth: llama-bench -p 0 -n {plan.output_len} -d N -r {plan.repeats} (its tg at that "
                "depth, the depth's prefill untimed and kept across its repetitions)"
            )
        return out


def add_floors(rows: list[dict], cost: ModelCost, ceilings: Ceilings, int8: bool = False) -> None:
    """Each row's floor at its own KV bytes a token (the context midway through its decode); `int8`: kvserve's rows
    with --activation-quantization int8, whose matmuls count at the int8 rate."""
    for row in rows:
        at = replace(cost, kv_bytes_per_token=row["kv_bytes_per_token"])
        mine = int8 and not row["system"].startswith(LLAMA_CPP)
        row["floor_ms"] = at.decode_floor_ms(ceilings, 1, row["depth"] + row["output_len"] // 2, mine)


def ratios(rows: list[dict]) -> dict[str, float | None]:
    from kvserve.bench.stats import ratio

    out: dict[str, float | None] = {}
    by = {(r["system"], r["depth"]): r for r in rows}
    names = list(dict.fromkeys(r["system"] for r in rows))
    peers = [n for n in names if n.startswith(LLAMA_CPP)]
    for mine in (n for n in names if n not in peers):
        for depth in sorted({r["depth"] for r in rows}):
            k = by.get((mine, depth))
            if k is None:
                continue
            for peer in peers:
                p = by.get((peer, depth))
                if p is not None:
                    out[f"decode_speed@depth{depth}:{mine}/{peer}"] = ratio(
                        p["decode_ms_per_token"], k["decode_ms_per_token"]
                    )
            out[f"floor/{mine} decode@depth{depth}"] = ratio(k["floor_ms"], k["decode_ms_per_token"])
    return out


def table(rows: list[dict], plan: DepthPlan) -> Table:
    from kvserve.bench.report import Table

    t = Table(
        f"Decode over a cached prompt of `depth` tokens, {plan.output_len} tokens (medians of {plan.repeats})",
        ["depth", "system", "KV dtype", "ms/token", "floor ms", "x floor", "KV bytes/token"],
    )
    for r in sorted(rows, key=lambda r: (r["depth"], r["system"].startswith(LLAMA_CPP), r["system"])):
        ms, floor = r["decode_ms_per_token"], r["floor_ms"]
        t.add(
            r["depth"],
            r["system"],
            r["kv_cache_dtype"],
            ms,
            floor,
            ms / floor if ms and floor else None,
            r["kv_bytes_per_token"],
        )
    return t


def panel(rows: list[dict]) -> Panel:
    """ms a token against depth, a line per system (and KV dtype), each KV size's floor dashed."""
    from kvserve.bench.plot import Panel, Series

    series: list[Series] = []
    for name in dict.fromkeys(r["system"] for r in rows):
        mine = sorted((r for r in rows if r["system"] == name), key=lambda r: r["depth"])
        series.append(Series(name, [r["depth"] for r in mine], [r["decode_ms_per_token"] for r in mine]))
    floors: dict[int, list[dict]] = {}
    for r in rows:
        floors.setdefault(r["kv_bytes_per_token"], []).append(r)
    styles = ["k--", "k:", "k-.", "k-"]
    for i, (_, mine) in enumerate(sorted(floors.items(), reverse=True)):
        dtypes = "/".join(dict.fromkeys(r["kv_cache_dtype"] for r in mine))
        points = {r["depth"]: r["floor_ms"] for r in mine}
        depths = sorted(points)
        series.append(Series(f"floor, {dtypes} KV", depths, [points[d] for d in depths], style=styles[i % 4]))
    return Panel("Decode at depth (batch 1)", "depth (cached prompt tokens)", "ms per token", series, log_x=True)
