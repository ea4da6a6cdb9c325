"""`kvserve bench quantization`: what each --quantization (weights) costs in accuracy and buys in memory and
speed, each method measured in the same run against "none" (the checkpoint's weights in float32). Per method:
weight bytes, start time, perplexity on the first N tokens of the GPL-3 text (BOS prepended, one window),
greedy agreement with "none", prefill time of one prompt, decode ms per step at batch 1 and at a larger batch."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from kvserve.bench.kv_dtype import PROMPTS, add_accuracy_args
from kvserve.bench.options import add_engine_args, add_output_args, add_repeats_arg, int_list, new_command
from kvserve.units import GiB

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine

BASELINE = "none"

SCHEMA = """\
results: {"methods": [{"quantization", "weight_bytes", "start_s", "perplexity", "perplexity_delta_perc",
                       "greedy_identical_prompts", "greedy_first_divergence", "greedy_match_perc",
                       "divergences_near_tie", "prefill_ms", "decode_ms_per_step": {"<batch>": ms},
                       "decode_tokens_per_s": {"<batch>": tok/s}}],
          "ppl_tokens", "greedy_prompts", "greedy_tokens", "prefill_len", "decode_batches", "decode_context"}
ratios: {"weight_bytes@<method>": bytes / none's, "ppl_delta_perc@<method>", "prefill@<method>": speed vs none,
         "decode@<method>,batch<B>": speed vs none} (> 1: faster); for a METHOD+act-int8 whose METHOD also ran, the
         same against METHOD (float32 activations on the same weights): "act_int8_ppl_delta_perc@<method>",
         "act_int8_prefill@<method>", "act_int8_decode@<method>,batch<B>"
Times are medians over --repeats runs, the methods alternating within each repeat. start_s: building the engine
(a later start: caches already on disk). Greedy columns as in `bench kv-dtype`."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "quantization",
        "accuracy, memory and speed of each --quantization (weights)",
        __doc__.splitlines()[0],
        SCHEMA,
    )
    p.add_argument(
        "--methods",
        default="none,q8_0",
        help="comma-separated --quantization values (none runs first), each optionally followed by "
        "+lm-head-TYPE (adds --lm-head-quantization TYPE, e.g. gguf+lm-head-q4_0) and +act-int8 (adds "
        "--activation-quantization int8, e.g. gguf,gguf+act-int8)",
    )
    add_accuracy_args(p, greedy_tokens=32)
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill figure")
    p.add_argument("--decode-batches", type=int_list, default=[1, 32], help="batch sizes of the decode figures")
    p.add_argument("--decode-context", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens generated per request in a timed run")
    add_repeats_arg(p, 3)
    add_output_args(p, "(no plot for this command)")
    add_engine_args(p)
    p.set_defaults(func=run, kv_cache_memory_bytes=GiB, max_num_batched_tokens=512, enable_prefix_caching=False)


ACT_INT8 = "+act-int8"


def method_config(base: EngineConfig, name: str) -> EngineConfig:
    """METHOD[+lm-head-TYPE][+act-int8] -> `base` with the --quantization, --lm-head-quantization and
    --activation-quantization it names."""
    activation = "int8" if name.endswith(ACT_INT8) else "none"
    quantization, _, head = name.removesuffix(ACT_INT8).partition("+lm-head-")
    return replace(
        base, quantization=quantization, lm_head_quantization=head or None, activation_quantization=activation
    )


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.kv_dtype import agreement, greedy_outputs, perplexity, perplexity_ids, random_prompts
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.stats import ratio
    from kvserve.bench.systems import KVServeSystem
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine_args import engine_config_from_args
    from kvserve.model.quantization import weight_bytes

    names = [BASELINE] + [m for m in args.methods.split(",") if m and m != BASELINE]
    base_config = engine_config_from_args(args)
    engines: dict[str, LLMEngine] = {}
    rows: dict[str, dict] = {}
    for name in names:
        config = method_config(base_config, name)
        LLMEngine.from_config(replace(config))  # first start fills the caches, untimed
        start = time.perf_counter()
        engines[name] = LLMEngine.from_config(replace(config))
        rows[name] = {
            "quantization": name,
            "weight_bytes": weight_bytes(engines[name].core.runner.model),
            "start_s": time.perf_counter() - start,
        }
    first = engines[BASELINE]
    ppl_ids = perplexity_ids(first, args.text.read_text(encoding="utf-8"), args.ppl_tokens)
    prompts = list(PROMPTS[: args.greedy_prompts])
    greedy = {name: greedy_outputs(engine, prompts, args.greedy_tokens) for name, engine in engines.items()}
    for name, engine in engines.items():
        rows[name].update(perplexity=perplexity(engine, ppl_ids), **agreement(greedy[BASELINE], greedy[name]))

    prefill_prompt = random_prompts(first, 1, args.prefill_len, args.seed)
    decode_prompts = random_prompts(first, max(args.decode_batches), args.decode_context, args.seed + 1)
    systems = {name: KVServeSystem(engine) for name, engine in engines.items()}
    prefill: dict[str, list[float]] = {name: [] for name in names}
    decode: dict[tuple[str, int], list[float]] = {(name, b): [] for name in names for b in args.decode_batches}
    for system in systems.values():
        system.timed_generate([decode_prompts[0][:8]], 2)  # warm-up
    for _ in range(args.repeats):
        for name, system in systems.items():
            prefill[name].append(system.timed_generate(prefill_prompt, 1).ttft_s)
            for b in args.decode_batches:
                step = system.timed_generate(decode_prompts[:b], args.decode_tokens).decode_step_s
                if step is not None:
                    decode[name, b].append(step)

    base = rows[BASELINE]
    report = Report("quantization", machine_info(), config_of(args))
    for name in names:
        row = rows[name]
        row["perplexity_delta_perc"] = 100.0 * (row["perplexity"] / base["perplexity"] - 1.0)
        row["prefill_ms"] = 1e3 * statistics.median(prefill[name])
        row["decode_ms_per_step"] = {
            str(b): 1e3 * statistics.median(decode[name, b]) for b in args.decode_batches if decode[name, b]
        }
        row["decode_tokens_per_s"] = {b: int(b) * 1e3 / ms for b, ms in row["decode_ms_per_step"].items()}
        report.ratios[f"weight_bytes@{name}"] = ratio(row["weight_bytes"], base["weight_bytes"])
        report.ratios[f"ppl_delta_perc@{name}"] = row["perplexity_delta_perc"]
        report.ratios[f"prefill@{name}"] = ratio(base["prefill_ms"], row["prefill_ms"])
        for b, ms in row["decode_ms_per_step"].items():
            report.ratios[f"decode@{name},batch{b}"] = ratio(base["decode_ms_per_step"].get(b), ms)
    for name in names:  # int8 activations against float32 ones on the same weights, where both ran
        row, exact = rows[name], rows.get(name.removesuffix(ACT_INT8))
        if not name.endswith(ACT_INT8) or exact is None:
            continue
        report.ratios[f"act_int8_ppl_delta_perc@{name}"] = 100.0 * (row["perplexity"] / exact["perplexity"] - 1.0)
        report.ratios[f"act_int8_prefill@{name}"] = ratio(exact["prefill_ms"], row["prefill_ms"])
        for b, ms in row["decode_ms_per_step"].items():
            report.ratios[f"act_int8_decode@{name},batch{b}"] = ratio(exact["decode_ms_per_step"].get(b), ms)
    report.results = {
        "methods": list(rows.values()),
        "ppl_tokens": len(ppl_ids) - 1,
        "greedy_prompts": len(prompts),
        "greedy_tokens": args.greedy_tokens,
        "prefill_len": args.prefill_len,
        "decode_batches": args.decode_batches,
        "decode_context": args.decode_context,
    }
    table = Table(
        f"Weight quantization: perplexity on {len(ppl_ids) - 1} tokens, greedy vs none ({len(prompts)} "
        f"prompts x {args.greedy_tokens} tokens), prefill of {args.prefill_len} tokens, decode at "
        f"context {args.decode_context}",
        [
            "quantization",
            "weights MB",
            "start s",
            "ppl",
            "ppl +%",
            "identical",
            "near-tie",
            "prefill ms",
            *[f"decode b{b} ms" for b in args.decode_batches],
            *[f"x none b{b}" for b in args.decode_batches],
        ],
    )
    for name in names:
        r = rows[name]
        divergent = len(prompts) - r["greedy_identical_prompts"]
        table.add(
            name,
            r["weight_bytes"] / 1e6,
            r["start_s"],
            r["perplexity"],
            r["perplexity_delta_perc"],
            f"{r['greedy_identical_prompts']}/{len(prompts)}",
            f"{r['divergences_near_tie']}/{divergent}",
            r["prefill_ms"],
            *[r["decode_ms_per_step"].get(str(b)) for b in args.decode_batches],
            *[report.ratios.get(f"decode@{name},batch{b}") for b in args.decode_batches],
        )
    report.tables.append(table)
    report.notes.append(
        "identical: prompts whose greedy tokens equal none's throughout; near-tie: of the others, "
        "how many first diverge at a near-tie (vLLM's check_logprobs_close rule)"
    )
    emit(report, args.json)
    return 0
