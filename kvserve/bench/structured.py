"""`kvserve bench structured`: what a grammar costs. Decode tokens/s of requests constrained by a JSON schema
against the same requests unconstrained, on one engine, alternating run by run; the grammar mask's own cost per
decode step (filling the bitmask, applying it to the logits) at each batch size; grammar compile time, cold and
cached; and the time to first token that a cached grammar adds."""

from __future__ import annotations

import argparse
import functools
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.bench.options import add_engine_args, add_output_args, add_repeats_arg, int_list, new_command

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine
    from kvserve.structured.params import StructuredOutputsParams

SCHEMA = """\
results: {"workload": {"schema", "prompt_len", "output_len", "repeats", "backend"},
          "decode": [{"batch_size", "unconstrained_tokens_per_s", "constrained_tokens_per_s", "ratio",
                      "unconstrained_runs", "constrained_runs", "unconstrained_step_ms", "constrained_step_ms"}],
          "mask": [{"batch_size", "steps", "fill_ms_per_step", "apply_ms_per_step", "mask_ms_per_step",
                    "mask_ms_per_row"}],
          "compile": {"backend_build_s", "cold_ms", "cold_ms_runs", "cached_ms", "cached_ms_runs"},
          "ttft": {"unconstrained_ms", "constrained_ms", "added_ms", "unconstrained_ms_runs", "constrained_ms_runs",
                   "cached_path_ms", "cached_path_ms_runs"}}
ratios: {"decode_batch_<B>": constrained / unconstrained decode tokens/s at batch B (targets: >= 0.85 at batch 1,
         >= 0.8 at batch 32), "ttft_constrained_over_unconstrained": with the grammar cached}
Decode tokens/s: tokens generated after every sequence had its first one, over the time since then (greedy, EOS
ignored, exactly --output-len tokens each: the schema's array needs more items than fit). The mask figures time
fill_step_bitmask + apply_token_bitmask_ alone, replaying the constrained runs' tokens through fresh matchers.
TTFT: add_request to the first token, one request alone, the grammar compiled before (a cache hit); its difference
(added_ms) is within the forward pass's noise, so cached_path_ms times what the grammar adds alone: the cache lookup
behind compile_async, a new matcher, the first mask's fill and apply."""

# A typical extraction target: records with bounded strings, numbers, an enum, a nested object, a short array and a
# pattern, in an array that needs more records than any quick run generates (so no request stops early).
_RECORD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z]{1,12}\\.(com|org|net)$"},
        "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "address", "skills", "active"],
}


def bench_schema(variant: int = 0) -> dict[str, Any]:
    """The benchmark's schema; another `variant` renames the list (a different grammar, for cold compiles)."""
    key = "people" if variant == 0 else f"people_{variant}"
    return {
        "type": "object",
        "properties": {key: {"type": "array", "items": _RECORD, "minItems": 1000}},
        "required": [key],
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "structured",
        "JSON-schema-constrained vs unconstrained decode, mask cost, compile time",
        (__doc__ or "").splitlines()[0],
        SCHEMA,
    )
    p.add_argument("--batch-sizes", type=int_list, default=[1, 32], help="decode batch sizes, e.g. 1,32")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens of each (random) prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    add_repeats_arg(p, 3)
    p.add_argument("--compile-schemas", type=int, default=5, help="distinct schemas compiled cold (then cached)")
    p.add_argument("--ttft-repeats", type=int, default=7, help="single-request TTFT runs per side")
    p.add_argument(
        "--compact-json",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="disable_any_whitespace on the schema (what a small model needs not to wander)",
    )
    add_output_args(p, "decode tokens/s constrained and unconstrained, per batch size")
    add_engine_args(p)
    p.set_defaults(func=run)


@dataclass(slots=True)
class _Run:
    """One batch generated to the end: decode speed, time to first token, and what was generated."""

    decode_tokens_per_s: float | None
    step_ms: float | None
    ttft_ms: float
    token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)


def _generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_len: int,
    structured: StructuredOutputsParams | None,
    salt: str,
) -> _Run:
    """The batch through the engine, step by step; `salt` keeps every run's prefill a cache miss, so runs compare."""
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, structured_outputs=structured)
    ids = [f"{salt}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, list(prompt), params, cache_salt=salt)
    first_all: float | None = None
    first_all_tokens = 0
    started: set[str] = set()
    finished: dict[str, Any] = {}
    steps_after = 0
    while len(finished) < len(ids):
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            started.add(out.request_id)
            if out.finished:
                finished[out.request_id] = out
        if first_all is None and len(started) == len(ids):
            first_all = now
            first_all_tokens = engine.core.num_generation_tokens_total
        elif first_all is not None and outputs:
            steps_after += 1
    end = time.perf_counter()
    outs = [finished[rid] for rid in ids]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    decoded = engine.core.num_generation_tokens_total - first_all_tokens
    span = end - (first_all or end)
    return _Run(
        decoded / span if span > 0 and decoded else None,
        1e3 * span / steps_after if steps_after else None,
        1e3 * ((first_all or end) - start),
        tokens,
        [o.outputs[0].finish_reason for o in outs],
    )


def _first_token_ms(
    engine: LLMEngine, prompt: list[int], structured: StructuredOutputsParams | None, salt: str
) -> float:
    return _generate(engine, [prompt], 1, structured, salt).ttft_ms


def _mask_cost(engine: LLMEngine, structured: StructuredOutputsParams, walks: list[list[int]]) -> dict[str, Any]:
    """Median milliseconds per step to fill one batch's bitmask and to apply it, replaying `walks` (one token list per
    row, as the constrained runs generated them) through fresh matchers."""
    import torch

    from kvserve.bench.stats import median
    from kvserve.structured.matcher import apply_token_bitmask_, fill_step_bitmask

    compiled = engine.grammar.compile(structured)
    matchers = [engine.grammar.matcher(compiled) for _ in walks]
    width = engine.grammar.backend.vocab.vocab_size
    logits = torch.randn(len(walks), width, generator=torch.Generator().manual_seed(0))
    fills, applies = [], []
    for t in range(min(len(w) for w in walks)):
        t0 = time.perf_counter()
        step = fill_step_bitmask(matchers, width)
        t1 = time.perf_counter()
        if step is None:  # cannot happen: every row has a matcher
            raise RuntimeError("no constrained row in the mask benchmark")
        apply_token_bitmask_(logits, *step)
        t2 = time.perf_counter()
        fills.append(1e3 * (t1 - t0))
        applies.append(1e3 * (t2 - t1))
        for matcher, walk in zip(matchers, walks):
            if not matcher.accept_token(walk[t]):
                raise RuntimeError(f"the grammar refused token {walk[t]} that it allowed during the run")
    fill, apply = median(fills), median(applies)
    return {
        "batch_size": len(walks),
        "steps": len(fills),
        "fill_ms_per_step": fill,
        "apply_ms_per_step": apply,
        "mask_ms_per_step": fill + apply,
        "mask_ms_per_row": (fill + apply) / len(walks),
    }


def _cached_path_ms(engine: LLMEngine, structured: StructuredOutputsParams, repeats: int) -> dict[str, Any]:
    """What a cached grammar adds before a request's first token, piece by piece and without the forward pass whose
    noise swamps it end to end: the cache lookup behind compile_async, a new matcher, the first mask (fill and
    apply on one row of logits)."""
    import torch

    from kvserve.bench.stats import median
    from kvserve.structured.matcher import apply_token_bitmask_, fill_step_bitmask

    width = engine.grammar.backend.vocab.vocab_size
    logits = torch.randn(1, width, generator=torch.Generator().manual_seed(1))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = engine.grammar.compile_async(structured).result()
        step = fill_step_bitmask([engine.grammar.matcher(compiled)], width)
        if step is None:  # cannot happen: the one row has a matcher
            raise RuntimeError("no constrained row in the TTFT benchmark")
        apply_token_bitmask_(logits, *step)
        runs.append(1e3 * (time.perf_counter() - t0))
    return {"cached_path_ms": median(runs), "cached_path_ms_runs": runs}


def _compile_times(engine: LLMEngine, count: int, compact: bool) -> dict[str, Any]:
    """Backend build (first use), then `count` distinct schemas compiled cold, then each again (cached)."""
    from kvserve.bench.stats import median
    from kvserve.structured.params import StructuredOutputsParams

    start = time.perf_counter()
    _ = engine.grammar.backend
    build_s = time.perf_counter() - start
    variants = [StructuredOutputsParams(json=bench_schema(i + 1), disable_any_whitespace=compact) for i in range(count)]
    runs: dict[str, list[float]] = {"cold": [], "cached": []}
    for kind in ("cold", "cached"):
        for params in variants:
            t0 = time.perf_counter()
            engine.grammar.compile(params)
            runs[kind].append(1e3 * (time.perf_counter() - t0))
    return {
        "backend_build_s": build_s,
        "cold_ms": median(runs["cold"]),
        "cold_ms_runs": runs["cold"],
        "cached_ms": median(runs["cached"]),
        "cached_ms_runs": runs["cached"],
    }


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.common import alternate_rounds, warm_up
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.stats import median, ratio
    from kvserve.bench.systems import KVServeSystem, build_engine, special_token_ids
    from kvserve.bench.workload import random_token_ids
    from kvserve.structured.params import StructuredOutputsParams

    if args.plot:
        from kvserve.bench.plot import check_plot_target

        check_plot_target(args.plot)
    engine = build_engine(args)
    warm_up(KVServeSystem(engine))
    structured = StructuredOutputsParams(json=bench_schema(), disable_any_whitespace=args.compact_json)
    compile_result = _compile_times(engine, args.compile_schemas, args.compact_json)
    engine.grammar.compile(structured)
    vocab, exclude = engine.core.model_config.vocab_size, special_token_ids(engine)
    rng = random.Random(args.seed)
    bos = [engine.core.model_config.bos_token_id] if engine.core.model_config.bos_token_id is not None else []

    def prompts(n: int) -> list[list[int]]:
        return [bos + random_token_ids(rng, args.prompt_len, vocab, exclude) for _ in range(n)]

    _generate(engine, prompts(1), 4, structured, "warm-constrained")  # first matcher, first masks: outside timing
    decode, masks = [], []
    t_decode = Table(
        f"Decode tokens/s, JSON-schema-constrained vs unconstrained ({args.output_len} tokens each, "
        f"median of {args.repeats})",
        [
            "batch",
            "unconstrained tok/s",
            "constrained tok/s",
            "constrained / unconstrained",
            "step ms unconstrained",
            "step ms constrained",
        ],
    )
    t_mask = Table(
        "Grammar mask per decode step (fill the bitmask + apply it to the logits), median",
        ["batch", "fill ms", "apply ms", "mask ms / step", "mask ms / row", "share of a decode step"],
    )
    sides = ("unconstrained", "constrained")
    round_prompts: dict[tuple[int, int], list[list[int]]] = {}  # both sides of a round run the same prompts

    def decode_run(batch: int, side: str, r: int) -> _Run:
        if (batch, r) not in round_prompts:
            round_prompts[batch, r] = prompts(batch)
        grammar = structured if side == "constrained" else None
        return _generate(engine, round_prompts[batch, r], args.output_len, grammar, f"{side}-{batch}-{r}")

    for batch in args.batch_sizes:
        runs = alternate_rounds(sides, args.repeats, functools.partial(decode_run, batch), flip=True)
        row = _decode_row(batch, runs, median)
        decode.append(row)
        t_decode.add(
            batch,
            row["unconstrained_tokens_per_s"],
            row["constrained_tokens_per_s"],
            row["ratio"],
            row["unconstrained_step_ms"],
            row["constrained_step_ms"],
        )
        mask = _mask_cost(engine, structured, runs["constrained"][-1].token_ids)
        masks.append(mask)
        t_mask.add(
            batch,
            mask["fill_ms_per_step"],
            mask["apply_ms_per_step"],
            mask["mask_ms_per_step"],
            mask["mask_ms_per_row"],
            ratio(mask["mask_ms_per_step"], row["unconstrained_step_ms"]),
        )

    ttft_prompts: dict[int, list[int]] = {}

    def ttft_run(side: str, r: int) -> float:
        if r not in ttft_prompts:
            ttft_prompts[r] = prompts(1)[0]
        grammar = structured if side == "constrained" else None
        return _first_token_ms(engine, ttft_prompts[r], grammar, f"ttft-{side}-{r}")

    ttft_runs = alternate_rounds(sides, args.ttft_repeats, ttft_run, flip=True)
    plain_ms, constrained_ms = median(ttft_runs["unconstrained"]), median(ttft_runs["constrained"])
    ttft: dict[str, Any] = {
        "unconstrained_ms": plain_ms,
        "constrained_ms": constrained_ms,
        "added_ms": constrained_ms - plain_ms,
        "unconstrained_ms_runs": ttft_runs["unconstrained"],
        "constrained_ms_runs": ttft_runs["constrained"],
    }
    ttft.update(_cached_path_ms(engine, structured, max(args.ttft_repeats, 5)))
    t_compile = Table(
        f"Grammar compile ({engine.grammar.backend_name} backend) and time to first token",
        [
            "backend build s",
            "compile cold ms",
            "compile cached ms",
            "TTFT ms unconstrained",
            "TTFT ms constrained (cached)",
            "TTFT added ms",
            "cached grammar path ms",
        ],
    )
    t_compile.add(
        compile_result["backend_build_s"],
        compile_result["cold_ms"],
        compile_result["cached_ms"],
        ttft["unconstrained_ms"],
        ttft["constrained_ms"],
        ttft["added_ms"],
        ttft["cached_path_ms"],
    )

    report = Report("structured", machine_info(), config_of(args))
    report.results = {
        "workload": {
            "schema": bench_schema(),
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "backend": engine.grammar.backend_name,
        },
        "decode": decode,
        "mask": masks,
        "compile": compile_result,
        "ttft": ttft,
    }
    report.ratios = {f"decode_batch_{row['batch_size']}": row["ratio"] for row in decode}
    report.ratios["ttft_constrained_over_unconstrained"] = ratio(ttft["constrained_ms"], ttft["unconstrained_ms"])
    report.notes.append(
        "targets: constrained decode >= 0.85x unconstrained at batch 1 and >= 0.8x at batch 32; "
        "a cached grammar adds < 5 ms to TTFT"
    )
    early = sorted({f for row in decode for f in row.pop("finish_reasons") if f != "length"})
    if early:
        report.notes.append(
            f"some constrained requests ended before --output-len ({', '.join(early)}): "
            "their batches shrank, so their tokens/s are not comparable"
        )
    report.tables += [t_decode, t_mask, t_compile]
    if args.plot:
        from kvserve.bench.plot import Series, bar_plot

        bar_plot(
            args.plot,
            "Decode tokens/s with and without a JSON-schema grammar",
            "tokens/s",
            [f"batch {row['batch_size']}" for row in decode],
            [
                Series("unconstrained", [], [row["unconstrained_tokens_per_s"] for row in decode]),
                Series("constrained", [], [row["constrained_tokens_per_s"] for row in decode]),
            ],
        )
    emit(report, args.json)
    return 0


def _decode_row(batch: int, runs: dict[str, list[_Run]], median: Any) -> dict[str, Any]:
    """One batch size's decode figures: medians over the repeats, and the ratio of the medians."""

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return median(present) if present else None

    row: dict[str, Any] = {"batch_size": batch}
    for side, side_runs in runs.items():
        row[f"{side}_tokens_per_s"] = med([r.decode_tokens_per_s for r in side_runs])
        row[f"{side}_runs"] = [r.decode_tokens_per_s for r in side_runs]
        row[f"{side}_step_ms"] = med([r.step_ms for r in side_runs])
    row["finish_reasons"] = [f for r in runs["constrained"] for f in r.finish_reasons]
    unconstrained, constrained = row["unconstrained_tokens_per_s"], row["constrained_tokens_per_s"]
    row["ratio"] = constrained / unconstrained if unconstrained and constrained else None
    return row
