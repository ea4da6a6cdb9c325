"""`kvserve bench prompt-cache`: the hosted APIs' caching contract on an agent trace, over Anthropic's Messages API.

Three servers up at once, the requests alternating between them (request by request, each system first in turn):
kvserve keeping `cache_control` pins, the same kvserve with every pin refused (`--max-pinned-kv-fraction 0`: the
marks still shape the usage, the pool's LRU alone decides what stays), and, with `--llama-server`, llama.cpp's
llama-server through its own /v1/messages (its default cache settings: one slot's prompt plus its RAM prompt cache).

The trace (Claude Code's shape): `--agents` agents, each with a system prompt of its own (`--system-words` words of
instructions and tool definitions) and a conversation growing over `--turns` turns (a question, then a reply of
`--reply-words` words that joins the history canned, the same for every system, so the prompts stay identical);
cache_control marks where Claude Code puts them: on the last system block and on the last block of the last message.
After each round of turns, `--fillers` other tenants' prompts of `--filler-words` words (no marks) pass through the
pool. Words are pseudo-words made of syllables (about two tokens each), the same text for every system.

TTFT: from sending the request to the first text delta, by one streaming client (httpx). Hit rate: the prompt tokens
the server reported as read from its cache (`cache_read_input_tokens`) over all prompt tokens (input + cache read +
cache creation) of turns 2 and later; llama-server reports its own way (null when it reports none)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.options import add_output_args, new_command

SCHEMA = """\
results: {"trace": {"agents", "turns", "system_words", "reply_words", "fillers", "filler_words", "output_len"},
          "systems": {NAME: {"ttft_ms_p50", "ttft_ms_p90", "hit_rate", "prompt_tokens", "cache_read_tokens",
                             "ttft_ms": [...] (turns 2+, in trace order)}}}
NAME: "kvserve pins", "kvserve no pins", "llama-server" (with --llama-server).
ratios: {"ttft_p50_pins_over_no_pins", "ttft_p50_pins_over_llama_server" (with --llama-server)}
TTFT: over HTTP, sending the request to the first text delta of the streamed reply."""

SERVED_NAME = "bench"
SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "fa", "gu", "ho", "ji", "ve", "zo", "be")


@dataclass(frozen=True, slots=True)
class AgentTrace:
    agents: int = 4
    turns: int = 8
    system_words: int = 2000
    question_words: int = 40
    reply_words: int = 60
    fillers: int = 2
    filler_words: int = 4000
    output_len: int = 8
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: an agent's turn (`agent` >= 0) or another tenant's filler (-1)."""

    agent: int
    turn: int
    body: dict[str, Any]


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


def build_trace(t: AgentTrace) -> list[TraceRequest]:
    """The requests in order: round by round, each agent's turn, then the fillers."""
    rng = random.Random(t.seed)
    systems = []
    for a in range(t.agents):
        tools: list[dict[str, Any]] = [
            {"type": "text", "text": f"You are agent {a}. " + _words(rng, t.system_words // 2)},
            {"type": "text", "text": "Tools: " + _words(rng, t.system_words - t.system_words // 2)},
        ]
        tools[-1]["cache_control"] = {"type": "ephemeral"}
        systems.append(tools)
    histories: list[list[dict[str, Any]]] = [[] for _ in range(t.agents)]
    out = []
    for turn in range(t.turns):
        for a in range(t.agents):
            question = {"type": "text", "text": _words(rng, t.question_words), "cache_control": {"type": "ephemeral"}}
            messages = [*histories[a], {"role": "user", "content": [question]}]
            body = {"system": systems[a], "messages": messages, "max_tokens": t.output_len}
            out.append(TraceRequest(a, turn, body))
            plain = {"type": "text", "text": question["text"]}  # marks move to the newest message, as Claude Code's
            histories[a] = [
                *histories[a],
                {"role": "user", "content": [plain]},
                {"role": "assistant", "content": _words(rng, t.reply_words)},
            ]
        for f in range(t.fillers):
            text = f"Tenant {turn}-{f}: " + _words(rng, t.filler_words)
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": t.output_len}
            out.append(TraceRequest(-1, turn, body))
    return out


async def _send(client: Any, url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Stream one request: (seconds to the first text delta, the final usage)."""
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    payload = {**body, "model": SERVED_NAME, "stream": True, "temperature": 0}
    async with client.stream("POST", url + "/v1/messages", json=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            kind = event.get("type")
            if kind == "message_start":
                usage.update({k: v for k, v in (event["message"].get("usage") or {}).items() if v is not None})
            elif kind == "content_block_delta" and ttft is None:
                ttft = time.perf_counter() - start
            elif kind == "message_delta":
                usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
            elif kind == "error":
                raise RuntimeError(f"{url}: {event}")
    return (ttft if ttft is not None else time.perf_counter() - start), usage


async def _run(trace: list[TraceRequest], urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    import httpx

    from kvserve.bench.stats import percentile

    names = list(urls)
    ttfts: dict[str, list[float]] = {n: [] for n in names}
    prompt = dict.fromkeys(names, 0)
    read: dict[str, int | None] = dict.fromkeys(names, 0)
    async with httpx.AsyncClient(timeout=1200.0) as client:
        for k, request in enumerate(trace):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                seconds, usage = await _send(client, urls[name], request.body)
                if request.agent < 0 or request.turn == 0:
                    continue
                ttfts[name].append(1e3 * seconds)
                total = sum(int(usage.get(f) or 0) for f in ("input_tokens", "cache_read_input_tokens"))
                total += int(usage.get("cache_creation_input_tokens") or 0)
                prompt[name] += total
                cached = usage.get("cache_read_input_tokens")
                current = read[name]
                read[name] = None if cached is None or current is None else current + int(cached)
    return {
        n: {
            "ttft_ms_p50": percentile(ttfts[n], 50),
            "ttft_ms_p90": percentile(ttfts[n], 90),
            "hit_rate": (read[n] or 0) / prompt[n] if read[n] is not None and prompt[n] else None,
            "prompt_tokens": prompt[n],
            "cache_read_tokens": read[n],
            "ttft_ms": ttfts[n],
        }
        for n in names
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "prompt-cache",
        "cache_control pins on an agent trace over /v1/messages: pins against none, and against llama-server",
        __doc__,
        SCHEMA,
    )
    d = AgentTrace()
    p.add_argument("--model", default=None, help="the model (default: kvserve's default GGUF; llama-server reads it)")
    p.add_argument("--kv-cache-memory-bytes", default="96MiB", help="kvserve's KV pool (small: the fillers evict)")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--chat-template", default=None, help="passed to kvserve serve (a model without one needs it)")
    p.add_argument(
        "--max-pinned-kv-fraction", default="0.5", help="the pinning server's pin budget (kvserve serve's flag)"
    )
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--system-words", type=int, default=d.system_words)
    p.add_argument("--question-words", type=int, default=d.question_words)
    p.add_argument("--reply-words", type=int, default=d.reply_words)
    p.add_argument("--fillers", type=int, default=d.fillers, help="other tenants' prompts after each round")
    p.add_argument("--filler-words", type=int, default=d.filler_words)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--llama-server", default=None, metavar="PATH", help="also llama-server on the same GGUF")
    add_output_args(p, "TTFT of every agent turn after the first, per system")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.machine import machine_info
    from kvserve.bench.offload_peer import LlamaServer
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.server_process import ServerProcess
    from kvserve.bench.stats import ratio
    from kvserve.model.source import resolve_model

    trace_shape = AgentTrace(
        args.agents,
        args.turns,
        args.system_words,
        args.question_words,
        args.reply_words,
        args.fillers,
        args.filler_words,
        args.output_len,
        args.seed,
    )
    if args.plot:
        from kvserve.bench.plot import check_plot_target

        check_plot_target(args.plot)
    trace = build_trace(trace_shape)
    model = str(resolve_model(args.model).path)
    logs = Path(tempfile.mkdtemp(prefix="kvserve-bench-prompt-cache-"))
    common = [
        "--model",
        model,
        "--served-model-name",
        SERVED_NAME,
        "--kv-cache-memory-bytes",
        args.kv_cache_memory_bytes,
        "--max-model-len",
        str(args.max_model_len),
        *(["--chat-template", args.chat_template] if args.chat_template else []),
    ]
    servers: list[Any] = []
    try:
        budget = ["--max-pinned-kv-fraction", args.max_pinned_kv_fraction]
        pins = ServerProcess.start([*common, *budget], logs / "pins.log", timeout_s=600.0)
        servers.append(pins)
        no_pins = ServerProcess.start([*common, "--max-pinned-kv-fraction", "0"], logs / "no-pins.log", 600.0)
        servers.append(no_pins)
        urls = {"kvserve pins": pins.base_url, "kvserve no pins": no_pins.base_url}
        llama_args: list[str] = []
        if args.llama_server:
            llama_args = ["-c", str(args.max_model_len), "-np", "1"]
            peer = LlamaServer(args.llama_server, ["-m", model, *llama_args], logs / "llama-server.log")
            servers.append(peer)
            urls["llama-server"] = peer.base_url
        systems = asyncio.run(_run(trace, urls))
    finally:
        for server in servers:
            server.stop()
    table = Table(
        f"Agent trace: {args.agents} agents x {args.turns} turns, {args.system_words}-word system prompts, "
        f"{args.fillers} x {args.filler_words}-word other tenants after each round; turns 2-{args.turns}",
        ["system", "TTFT p50 ms", "TTFT p90 ms", "hit rate", "prompt tokens"],
    )
    for name, row in systems.items():
        table.add(name, row["ttft_ms_p50"], row["ttft_ms_p90"], row["hit_rate"], row["prompt_tokens"])
    report = Report("prompt-cache", machine_info(), config_of(args))
    report.results = {
        "trace": {
            "agents": args.agents,
            "turns": args.turns,
            "system_words": args.system_words,
            "reply_words": args.reply_words,
            "fillers": args.fillers,
            "filler_words": args.filler_words,
            "output_len": args.output_len,
        },
        "systems": systems,
        "llama_server_args": llama_args or None,
    }
    s = systems
    pinned = s["kvserve pins"]["ttft_ms_p50"]
    report.ratios = {"ttft_p50_pins_over_no_pins": ratio(pinned, s["kvserve no pins"]["ttft_ms_p50"])}
    if "llama-server" in s:
        report.ratios["ttft_p50_pins_over_llama_server"] = ratio(
            s["kvserve pins"]["ttft_ms_p50"], s["llama-server"]["ttft_ms_p50"]
        )
    report.tables.append(table)
    emit(report, args.json)
    if args.plot:
        _plot(systems, args.plot)
    return 0


def _plot(systems: dict[str, dict[str, Any]], path: str) -> None:
    """TTFT of every agent turn after the first, in trace order, one line per system (log scale)."""
    from kvserve.bench.plot import Panel, Series, line_plot

    series = [Series(name, list(range(1, len(r["ttft_ms"]) + 1)), r["ttft_ms"]) for name, r in systems.items()]
    title = "TTFT of agent turns 2+ (other tenants in between)"
    line_plot(path, [Panel(title, "agent turn, in trace order", "TTFT ms", series, log_y=True)])
