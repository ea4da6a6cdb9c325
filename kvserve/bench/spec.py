"""`kvserve bench spec`: speculative decoding (n-gram prompt lookup) off vs on, in the same run, on input-grounded
workloads (edit a given function, summarize / answer from / quote a given document) and open-ended text (story
continuation), by batch size. The drafting engine is a sibling of the plain one (same loaded model), with
--speculative-config (default: n-gram, k = 4, the default adaptive gate); runs alternate between them."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import textwrap
from collections.abc import Callable
from typing import Any

from kvserve.bench.options import add_engine_args, add_output_args, add_repeats_arg, int_list, new_command

SCHEMA = """\
results: {"points": [{"workload", "batch_size", "off_decode_tok_s", "on_decode_tok_s", "off_runs", "on_runs",
                      "speedup", "same_tokens", "drafts", "draft_tokens", "accepted_tokens"}],
          "speculative_config": {...}, "output_len": int, "min_prompts_per_run": int, "chat_template": bool}
ratios: {"speedup@<workload>/<batch>": on / off decode tokens/s (medians over --repeats)}
decode tokens/s: each run generates for the fewest whole groups of `batch` distinct prompts of the workload that
hold at least 4 prompts, one group at a time (greedy, EOS ignored): batch * (output_len - 1) tokens per group, over
the time from the step in which every request of the group had its first token to its last step, summed over the
groups. same_tokens: both engines produced the same tokens (they must). drafts / draft_tokens / accepted_tokens:
the drafting engine's counters over all its runs of the point. chat_template: instruction workloads went through
the model's chat template (false: the model has none, and they were written as plain text)."""

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
WORKLOADS = ("code-edit", "summarize", "qa", "quote", "story")
MIN_PROMPTS_PER_RUN = 4  # so that batch 1 measures several sources, not one lucky (or unlucky) prompt

# The edits a user asks for; each leaves most of the function as it was, so a correct reply repeats it.
_EDITS = (
    "Remove the docstring from this Python function and return the whole function, otherwise unchanged.",
    "Rename this function to `{name}_checked` and return the whole function.",
    'Add `logger.debug("{name} called")` as the first statement of this Python function and return the whole function.',
    "Add type hints wherever they are missing in this Python function and return the whole function.",
)
_SUMMARIES = (
    "Summarize this passage:\n\n{doc}",
    "{doc}\n\nSummarize the text above in a few sentences.",
    "Write a short summary of this documentation for a new contributor:\n\n{doc}",
)
_QUESTIONS = (
    "What does this module do, and why is it built this way?",
    "Which design choice does the passage explain, and what is the reason given?",
)
_QUOTE = "Quote the first paragraph of this document word for word:\n\n{doc}"
_STORIES = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The spaceship drifted silently past the rings of the gas giant while the crew",
    "It was the last day of summer, and the children ran down to the river where",
    "Nobody in the city remembered when the clock tower had last rung, until one night",
    "The letter arrived forty years late, its envelope yellow and its stamp from a country that",
    "On the morning of the storm, the lighthouse keeper noticed that the lamp",
    "My grandmother kept a locked wooden box under her bed, and the day she gave me the key",
    "The robot had been built to sort mail, but on its thousandth day at the post office it",
)
# Modules whose docstrings are prose (what and why), 950-2,550 characters each.
_DOC_MODULES = (
    "kvserve.engine.sampler",
    "kvserve.engine.detokenizer",
    "kvserve.engine.stop_strings",
    "kvserve.kv.quant",
    "kvserve.model.chat_template",
    "kvserve.spec_decode.verify",
    "kvserve.kv.vllm_events",
    "kvserve.engine.inspector",
)

Messages = list[dict[str, str]]
Prompt = Messages | str  # a chat (one user turn) or plain text to continue


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "spec",
        "speculative decoding off vs on, input-grounded and open-ended, by batch size",
        __doc__.splitlines()[0],
        SCHEMA,
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (story: plain continuation; the others: "
        "an instruction and a document, through the model's chat template)",
    )
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    add_repeats_arg(p, default=3)
    add_output_args(p, "decode tokens/s off vs on, per workload, against batch size")
    add_engine_args(p)
    p.set_defaults(func=run)


def _sources() -> list[Callable[..., Any]]:
    """Real code to edit: kvserve's own functions (10-25 lines each, docstrings and comments included)."""
    from kvserve.engine import scheduler
    from kvserve.kv import manager, pool

    return [
        pool.BlockPool.free,
        manager.KVCacheManager.allocate_slots,
        scheduler.Scheduler.quarantine,
        pool.BlockPool.cache_block,
        pool.BlockPool.allocate,
        manager.KVCacheManager.get_computed_blocks,
        manager.KVCacheManager.rollback,
        pool.BlockPool.check_invariants,
    ]


def _docs() -> list[str]:
    """Real prose to summarize, quote or answer from: module docstrings that explain what and why."""
    return [importlib.import_module(name).__doc__ or "" for name in _DOC_MODULES]


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def _variant(i: int, sources: int) -> int:
    """Which instruction prompt i gets: the source's index, shifted by one on each pass over the sources, so that
    a source comes back with the next instruction rather than the same one."""
    return i % sources + i // sources


def workload_prompts(name: str, count: int) -> list[Prompt]:
    """`count` prompts of one workload; consecutive prompts differ in source (and, past the number of sources, in
    instruction), so a batch never holds the same prompt twice until every combination is used."""
    if name == "code-edit":
        functions = _sources()
        prompts: list[Prompt] = []
        for i in range(count):
            f = functions[i % len(functions)]
            edit = _EDITS[_variant(i, len(functions)) % len(_EDITS)].format(name=f.__name__)
            prompts.append(_user(f"{edit}\n\n```python\n{textwrap.dedent(inspect.getsource(f))}```"))
        return prompts
    if name in ("summarize", "qa", "quote"):
        docs = _docs()
        picks = [(docs[i % len(docs)], _variant(i, len(docs))) for i in range(count)]
        if name == "summarize":
            return [_user(_SUMMARIES[j % len(_SUMMARIES)].format(doc=doc)) for doc, j in picks]
        if name == "qa":
            return [
                _user(
                    f"Answer the question from the passage.\n\nPassage:\n{doc}\n\nQuestion: "
                    f"{_QUESTIONS[j % len(_QUESTIONS)]}"
                )
                for doc, j in picks
            ]
        return [_user(_QUOTE.format(doc=doc)) for doc, _ in picks]
    if name == "story":
        return [_STORIES[i % len(_STORIES)] for i in range(count)]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def render_prompt(tokenizer, prompt: Prompt, room: int) -> list[int]:
    """Token ids of a prompt: a chat through the model's chat template (plain text when the model has none), cut
    to its last `room` tokens (a long document keeps its end, where the instruction or the generation prompt is)."""
    if isinstance(prompt, str):
        text = prompt
    elif tokenizer.chat_template is not None:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    else:
        text = "\n\n".join(m["content"] for m in prompt) + "\n\n"
    return tokenizer.encode(text)[-room:]


def _groups(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    return [prompts[i : i + batch] for i in range(0, len(prompts), batch)]


def _decode_time(timeline, batch: int, output_len: int) -> tuple[int, float]:
    """(decode tokens, seconds) once every request of the group is decoding; (0, 0.0): no decode phase."""
    span = timeline.stamps[-1] - timeline.stamps[timeline.first_all]
    return (batch * (output_len - 1), span) if span > 0 else (0, 0.0)


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
    if args.output_len < 2 or args.output_len >= off.engine.core.max_model_len:
        raise ValueError(
            f"--output-len must be in [2, max-model-len {off.engine.core.max_model_len}), got {args.output_len}"
        )
    room = off.engine.core.max_model_len - args.output_len
    points = []
    table = Table(
        f"Decode tokens/s, speculation off vs on (medians of {args.repeats})",
        ["workload", "batch", "off tok/s", "on tok/s", "speedup", "accepted/drafted", "same"],
    )
    for workload in (w.strip() for w in args.workloads.split(",")):
        for batch in args.batch_sizes:
            count = batch * math.ceil(MIN_PROMPTS_PER_RUN / batch)
            groups = _groups([render_prompt(tokenizer, p, room) for p in workload_prompts(workload, count)], batch)
            before = on.engine.stats()

            def once(system, _round, groups=groups):
                done = [
                    _decode_time(system.timed_generate(g, args.output_len), len(g), args.output_len) for g in groups
                ]
                seconds = sum(s for _, s in done)
                return sum(n for n, _ in done) / seconds if seconds > 0 else None

            runs = alternate([off, on], args.repeats, once)
            after = on.engine.stats()
            # one more (untimed) run each, to compare the tokens
            tokens = {s.name: [t for g in groups for t in _generate_tokens(s, g, args.output_len)] for s in (off, on)}
            point = {
                "workload": workload,
                "batch_size": batch,
                "off_runs": runs[off.name],
                "on_runs": runs[on.name],
                "off_decode_tok_s": median([r for r in runs[off.name] if r is not None] or [0.0]),
                "on_decode_tok_s": median([r for r in runs[on.name] if r is not None] or [0.0]),
                "same_tokens": tokens[off.name] == tokens[on.name],
                "drafts": after.spec_decode_num_drafts - before.spec_decode_num_drafts,
                "draft_tokens": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                "accepted_tokens": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
            }
            point["speedup"] = ratio(point["on_decode_tok_s"], point["off_decode_tok_s"])
            points.append(point)
            table.add(
                workload,
                batch,
                point["off_decode_tok_s"],
                point["on_decode_tok_s"],
                point["speedup"],
                f"{point['accepted_tokens']}/{point['draft_tokens']}",
                point["same_tokens"],
            )
    report = Report("spec", machine_info(), config_of(args))
    report.results = {
        "points": points,
        "speculative_config": dataclasses.asdict(config),
        "output_len": args.output_len,
        "min_prompts_per_run": MIN_PROMPTS_PER_RUN,
        "chat_template": tokenizer.chat_template is not None,
    }
    report.ratios = {f"speedup@{p['workload']}/{p['batch_size']}": p["speedup"] for p in points}
    report.tables.append(table)
    if tokenizer.chat_template is None:
        report.notes.append("the model has no chat template: instruction workloads were written as plain text")
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
        panels.append(
            Panel(
                workload,
                "batch size",
                "decode tokens/s",
                [
                    Series("speculation off", xs, [p["off_decode_tok_s"] for p in mine]),
                    Series("speculation on (n-gram)", xs, [p["on_decode_tok_s"] for p in mine]),
                ],
                log_x=len(batch_sizes) > 2,
            )
        )
    line_plot(path, panels, title="n-gram speculative decoding, same run")
