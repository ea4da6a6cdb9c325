"""`kvserve bench prefix`: what prefix caching buys, measured. Scenario 1, a shared system prompt: requests
sent one after another, each a ~500-token system prompt plus its own short question; the first is cold,
the rest can reuse the prompt's blocks. Scenario 2, multi-turn chat: every turn resends the conversation so
far (previous prompt, the reply, a new user message). Each figure is measured with caching on and off,
alternating request by request between two engines that share one loaded model."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.bench.options import add_engine_args, add_output_args, new_command

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

SCHEMA = """\
results: {"shared_prompt": {"requests", "system_tokens", "question_tokens",
            "on": {"cold_ttft_ms", "warm_ttft_ms_median", "warm_ttft_ms", "hit_rate"},
            "off": {... same keys ...}},
          "multi_turn": {"turns": [{"turn", "prompt_tokens", "ttft_ms_on", "ttft_ms_off", "cached_tokens_on"}]}}
ratios: {"warm_over_cold_on": warm median / cold TTFT with caching (target <= 0.15),
         "warm_off_over_on": warm median TTFT off / on, "last_turn_off_over_on": TTFT ratio at the last turn}
TTFT: from add_request to the step that produced the request's first token (the engine driven directly,
no HTTP). hit_rate: prefix-cache hit tokens / looked-up tokens over the scenario."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "prefix",
        "TTFT with and without prefix caching: shared system prompt, multi-turn chat",
        __doc__.splitlines()[0],
        SCHEMA,
    )
    p.add_argument("--requests", type=int, default=20, help="requests sharing the system prompt")
    p.add_argument("--system-tokens", type=int, default=500, help="length of the shared system prompt")
    p.add_argument("--question-tokens", type=int, default=20, help="length of each request's own question")
    p.add_argument("--turns", type=int, default=8, help="turns of the multi-turn chat scenario")
    p.add_argument("--turn-user-tokens", type=int, default=40, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (the chat's replies)")
    add_output_args(p, "TTFT per chat turn, caching on and off")
    add_engine_args(p)
    p.set_defaults(func=run)


@dataclass(slots=True)
class _Timed:
    ttft_ms: float
    output_ids: list[int]
    cached_tokens: int


def _run_one(engine: LLMEngine, prompt: list[int], output_len: int, rid: str) -> _Timed:
    """One request alone through the engine, timing its first token."""
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft = None
    while True:
        outputs = engine.step()
        for out in outputs:
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                return _Timed(1e3 * (ttft or 0.0), list(out.outputs[0].token_ids), out.num_cached_tokens)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.common import warm_up
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.stats import median, ratio
    from kvserve.bench.systems import KVServeSystem, build_engine, special_token_ids
    from kvserve.bench.workload import random_token_ids

    args.enable_prefix_caching = True
    on = build_engine(args)
    off = on.sibling(enable_prefix_caching=False)
    for engine in (on, off):
        warm_up(KVServeSystem(engine))
    engines = {"on": on, "off": off}
    vocab, exclude = on.core.model_config.vocab_size, special_token_ids(on)
    rng = random.Random(args.seed)
    bos = [on.core.model_config.bos_token_id] if on.core.model_config.bos_token_id is not None else []

    # Scenario 1: a shared system prompt, requests one after another.
    system = bos + random_token_ids(rng, args.system_tokens, vocab, exclude)
    questions = [random_token_ids(rng, args.question_tokens, vocab, exclude) for _ in range(args.requests)]
    ttfts: dict[str, list[float]] = {"on": [], "off": []}
    before = {
        k: (e.stats().prefix_cache_queries_tokens, e.stats().prefix_cache_hits_tokens) for k, e in engines.items()
    }
    for i, question in enumerate(questions):
        for name, engine in engines.items():
            ttfts[name].append(_run_one(engine, system + question, args.output_len, f"shared-{name}-{i}").ttft_ms)
    shared = {"requests": args.requests, "system_tokens": len(system), "question_tokens": args.question_tokens}
    for name, engine in engines.items():
        queries = engine.stats().prefix_cache_queries_tokens - before[name][0]
        hits = engine.stats().prefix_cache_hits_tokens - before[name][1]
        shared[name] = {
            "cold_ttft_ms": ttfts[name][0],
            "warm_ttft_ms_median": median(ttfts[name][1:]) if len(ttfts[name]) > 1 else None,
            "warm_ttft_ms": ttfts[name][1:],
            "hit_rate": hits / queries if queries else 0.0,
        }
    t1 = Table(
        f"Shared {len(system)}-token system prompt, {args.requests} requests one after another",
        ["prefix caching", "cold TTFT ms", "warm TTFT ms (median)", "warm / cold", "hit rate"],
    )
    for name in ("on", "off"):
        s = shared[name]
        t1.add(
            name,
            s["cold_ttft_ms"],
            s["warm_ttft_ms_median"],
            ratio(s["warm_ttft_ms_median"], s["cold_ttft_ms"]),
            s["hit_rate"],
        )

    # Scenario 2: multi-turn chat, each turn resending the whole conversation.
    conversations = {name: bos + random_token_ids(rng, args.system_tokens, vocab, exclude) for name in engines}
    conversations["off"] = list(conversations["on"])
    turns = []
    t2 = Table(
        f"Multi-turn chat: {args.turns} turns, each resending the conversation",
        ["turn", "prompt tokens", "TTFT ms on", "TTFT ms off", "off / on", "cached tokens (on)"],
    )
    for turn in range(1, args.turns + 1):
        user = random_token_ids(rng, args.turn_user_tokens, vocab, exclude)
        row: dict[str, float] = {"turn": turn}
        for name, engine in engines.items():
            prompt = conversations[name] + user
            timed = _run_one(engine, prompt, args.output_len, f"chat-{name}-{turn}")
            conversations[name] = prompt + timed.output_ids
            row["prompt_tokens"] = len(prompt)
            row[f"ttft_ms_{name}"] = timed.ttft_ms
            if name == "on":
                row["cached_tokens_on"] = timed.cached_tokens
        turns.append(row)
        t2.add(
            turn,
            row["prompt_tokens"],
            row["ttft_ms_on"],
            row["ttft_ms_off"],
            ratio(row["ttft_ms_off"], row["ttft_ms_on"]),
            row["cached_tokens_on"],
        )

    report = Report("prefix", machine_info(), config_of(args))
    report.results = {"shared_prompt": shared, "multi_turn": {"turns": turns}}
    report.ratios = {
        "warm_over_cold_on": ratio(shared["on"]["warm_ttft_ms_median"], shared["on"]["cold_ttft_ms"]),
        "warm_off_over_on": ratio(shared["off"]["warm_ttft_ms_median"], shared["on"]["warm_ttft_ms_median"]),
        "last_turn_off_over_on": ratio(turns[-1]["ttft_ms_off"], turns[-1]["ttft_ms_on"]) if turns else None,
    }
    report.tables += [t1, t2]
    if args.plot:
        from kvserve.bench.plot import Panel, Series, line_plot

        xs = [t["turn"] for t in turns]
        line_plot(
            args.plot,
            [
                Panel(
                    "Multi-turn chat: time to first token per turn",
                    "turn",
                    "TTFT (ms)",
                    [
                        Series("prefix caching on", xs, [t["ttft_ms_on"] for t in turns]),
                        Series("prefix caching off", xs, [t["ttft_ms_off"] for t in turns]),
                    ],
                )
            ],
        )
    emit(report, args.json)
    return 0
