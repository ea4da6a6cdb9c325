"""`kvserve bench spec`: speculative decoding (n-gram prompt lookup) off vs on, in the same run, on input-grounded
workloads (edit a given function, quote a given document) and open-ended text (story continuation), by batch size.
The drafting engine is a sibling of the plain one (same loaded model), with --speculative-config (default: n-gram,
k = 4, the default adaptive gate); runs alternate between them."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from collections.abc import Callable
from typing import Any

from kvserve.bench.options import add_engine_args, add_output_args, add_repeats_arg, int_list, new_command

SCHEMA = """\
results: {"points": [{"workload", "batch_size", "off_decode_tok_s", "on_decode_tok_s", "off_runs", "on_runs",
                      "speedup", "same_tokens", "drafts", "draft_tokens", "accepted_tokens"}],
          "speculative_config": {...}, "output_len": int}
ratios: {"speedup@<workload>/<batch>": on / off decode tokens/s (medians over --repeats)}
decode tokens/s: batch * (output_len - 1) / the time from the step in which every request had its first token
to the last step (greedy, EOS ignored). same_tokens: both engines produced the same tokens (they must).
drafts / draft_tokens / accepted_tokens: the drafting engine's counters over all its runs of the point."""

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
WORKLOADS = ("code-edit", "quote", "story")
_STORIES = ("Once upon a time, in a small village by the sea, there lived an old fisherman who",
            "The spaceship drifted silently past the rings of the gas giant while the crew",
            "It was the last day of summer, and the children ran down to the river where",
            "Nobody in the city remembered when the clock tower had last rung, until one night")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(sub, "spec", "speculative decoding off vs on, input-grounded and open-ended, by batch size",
                    __doc__.splitlines()[0], SCHEMA)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    add_repeats_arg(p, default=3)
    add_output_args(p, "decode tokens/s off vs on, per workload, against batch size")
    add_engine_args(p)
    p.set_defaults(func=run)


def _sources() -> list[str]:
    """Real code and prose to ground the prompts in: kvserve's own functions and module docstrings."""
    from kvserve.engine import scheduler
    from kvserve.kv import manager, pool

    functions: list[Callable[..., Any]] = [pool.BlockPool.free, manager.KVCacheManager.allocate_slots,
                                           scheduler.Scheduler.quarantine, pool.BlockPool.cache_block]
    return [inspect.getsource(f) for f in functions]


def _docs() -> list[str]:
    from kvserve.engine import sampler, scheduler
    from kvserve.kv import manager, pool

    return [m.__doc__ or "" for m in (sampler, pool, manager, scheduler)] + [pool.BlockPool.__doc__ or ""]


def workload_prompts(name: str, batch: int) -> list[str]:
    """`batch` prompts of one workload, cycling through its sources."""
    if name == "code-edit":
        code = _sources()
        return [f"Here is a Python function:\n\n{code[i % len(code)]}\nThe same function with its docstring removed "
                f"and nothing else changed:\n\n" for i in range(batch)]
    if name == "quote":
        docs = _docs()
        return [f"Document:\n\n{docs[i % len(docs)]}\n\nQuote the document above word for word:\n\n"
                for i in range(batch)]
    if name == "story":
        return [_STORIES[i % len(_STORIES)] for i in range(batch)]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _decode_tok_s(timeline, batch: int, output_len: int) -> float | None:
    """Decode tokens/s once every request is decoding (None: too short to have a decode phase)."""
    span = timeline.stamps[-1] - timeline.stamps[timeline.first_all]
    return batch * (output_len - 1) / span if span > 0 else None


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.common import alternate, load_kvserve, warm_up
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.stats import median, ratio
    from kvserve.bench.systems import KVServeSystem
    from kvserve.spec_decode.config import parse_speculative_config

    # --speculative-config (default: DEFAULT_SPEC) is the drafting engine's, adaptive gate included (add e.g.
    # "disable_by_batch_size": 64 to measure drafting at every batch size); the plain engine has none.
    config = parse_speculative_config(args.speculative_config or json.dumps(DEFAULT_SPEC))
    assert config is not None
    off = load_kvserve(argparse.Namespace(**{**vars(args), "speculative_config": None}))
    on = KVServeSystem(off.engine.sibling(speculative_config=config))
    on.name = "kvserve+spec"
    warm_up(on)
    tokenizer = off.engine.tokenizer
    if args.output_len < 2 or args.output_len >= off.engine.max_model_len:
        raise ValueError(f"--output-len must be in [2, max-model-len {off.engine.max_model_len}), "
                         f"got {args.output_len}")
    points = []
    table = Table(f"Decode tokens/s, speculation off vs on (medians of {args.repeats})",
                  ["workload", "batch", "off tok/s", "on tok/s", "speedup", "accepted/drafted", "same"])
    for workload in args.workloads.split(","):
        for batch in args.batch_sizes:
            room = off.engine.max_model_len - args.output_len  # a long document keeps its end (the instruction)
            prompts = [tokenizer.encode(t)[-room:] for t in workload_prompts(workload.strip(), batch)]
            before = on.engine.stats()
            tokens: dict[str, list[list[int]]] = {}

            def once(system, _round, prompts=prompts):
                timeline = system.timed_generate(prompts, args.output_len)
                return _decode_tok_s(timeline, len(prompts), args.output_len)

            runs = alternate([off, on], args.repeats, once)
            after = on.engine.stats()
            for system in (off, on):  # one more (untimed) run each, to compare the tokens
                tokens[system.name] = _generate_tokens(system, prompts, args.output_len)
            point = {"workload": workload, "batch_size": batch,
                     "off_runs": runs[off.name], "on_runs": runs[on.name],
                     "off_decode_tok_s": median([r for r in runs[off.name] if r is not None] or [0.0]),
                     "on_decode_tok_s": median([r for r in runs[on.name] if r is not None] or [0.0]),
                     "same_tokens": tokens[off.name] == tokens[on.name],
                     "drafts": after.spec_decode_num_drafts - before.spec_decode_num_drafts,
                     "draft_tokens": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                     "accepted_tokens": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens}
            point["speedup"] = ratio(point["on_decode_tok_s"], point["off_decode_tok_s"])
            points.append(point)
            table.add(workload, batch, point["off_decode_tok_s"], point["on_decode_tok_s"], point["speedup"],
                      f"{point['accepted_tokens']}/{point['draft_tokens']}", point["same_tokens"])
    report = Report("spec", machine_info(), config_of(args))
    report.results = {"points": points, "speculative_config": dataclasses.asdict(config),
                      "output_len": args.output_len}
    report.ratios = {f"speedup@{p['workload']}/{p['batch_size']}": p["speedup"] for p in points}
    report.tables.append(table)
    if not all(p["same_tokens"] for p in points):
        report.notes.append("speculation changed some greedy output (it must not): see same_tokens")
    if args.plot:
        _plot(args.plot, points, args.batch_sizes)
    emit(report, args.json)
    return 0


def _generate_tokens(system, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    return [o.outputs[0].token_ids for o in LLM(engine=system.engine).generate(prompts, params, use_tqdm=False)]


def _plot(path: str, points: list[dict], batch_sizes: list[int]) -> None:
    from kvserve.bench.plot import Panel, Series, line_plot

    panels = []
    for workload in dict.fromkeys(p["workload"] for p in points):
        mine = [p for p in points if p["workload"] == workload]
        xs = [p["batch_size"] for p in mine]
        panels.append(Panel(workload, "batch size", "decode tokens/s", [
            Series("speculation off", xs, [p["off_decode_tok_s"] for p in mine]),
            Series("speculation on (n-gram)", xs, [p["on_decode_tok_s"] for p in mine]),
        ], log_x=len(batch_sizes) > 2))
    line_plot(path, panels, title="n-gram speculative decoding, same run")
