"""`kvserve bench agents`: coding agents' recorded conversations replayed against kvserve and llama-server.

The conversations (`--conversation`, default: the repository's tests/fixtures/agents/claude-code.json and codex.json)
are the request bodies Claude Code and Codex sent, turn by turn, tool results included (the fixtures' README says how
they were captured). Each turn is sent as recorded, streamed, to the client's own endpoint (`/v1/messages` with
Claude Code's query and headers, `/v1/responses`), changing only `model` (the served name) and the output length
(`--output-len`, default 1: the next turn is the recorded one whatever a server answers, so what is measured is the
prompt; and with tools a server may hold back a reply's first tokens until it knows whether they start a tool call,
which one output token makes the same on every server). llama-server (`--llama-server`, on the same GGUF, its
prompt cache on as by default) gets Claude Code's turns on its own `/v1/messages` and Codex's as chat completions
(`responses_to_chat`: its tools flattened, hosted tools left out), as `--llama-server-codex-endpoint` says.

Per turn: TTFT (sending the request to the first event carrying output) and the cached fraction the server reports
(Anthropic's cache_read_input_tokens, Responses' and chat's cached_tokens, llama-server's timings.cache_n). Both
servers are up at once, the turns alternating between them (each system first in turn), so a system's turn 1 is cold
and its later turns find what its own earlier turns left.

A short chat is injected during the first turn of the first conversation (`--inject-after` seconds after it is sent,
while its prompt is computed): a `--chat-words`-word question to /v1/chat/completions, `--chat-output-len` tokens
(EOS ignored), and its latency (sending to the last byte) set against the median of the same kind of request sent
alone (`--solo-repeats`, on the idle server, before the conversations; each question different, so none hits
another's cache beyond the chat template's own start).

Targets (issue 55): turns 2+ TTFT p50 <= 0.3x llama-server's; first turn no slower than llama-server's; the injected
chat within 2x its solo latency. Time it on a quiet machine: the first turns are long prefills."""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import tempfile
from pathlib import Path
from typing import Any

from kvserve.bench.agent_requests import (
    AgentConversation,
    StreamedReply,
    new_conversation,
    responses_to_chat,
    stream_request,
    turn_body,
)
from kvserve.bench.options import add_output_args, new_command

SCHEMA = """\
results: {"conversations": [{"client", "version", "endpoint", "turns"}],
          "systems": {NAME: {"args", "turns": [{"conversation", "turn", "endpoint", "ttft_ms", "latency_ms",
                                                 "prompt_tokens", "cached_tokens", "cached_fraction", "error"}],
                             "first_turn_ttft_ms": {CLIENT: ms}, "later_turns_ttft_ms_p50",
                             "new_conversations": [a turn's fields and "phase": "new conversation" or
                                                   "after restart"] (with --new-conversations),
                             "injected": {"solo_latency_ms": [...], "solo_latency_ms_median", "solo_ttft_ms_median",
                                          "errors": [solo failures], "latency_ms", "ttft_ms", "latency_over_solo",
                                          "sent_during_turn", "error",
                                          "first_turn_slowdown_at_most": the first turn's TTFT over that TTFT less
                                          the chat's latency (the turn lost at most the time the chat was served)}}}}
NAME: "kvserve", "llama-server" (with --llama-server). Times in ms; a failed turn has "error" and null times.
ratios: {"later_turns_ttft_p50_kvserve_over_llama_server", "first_turn_ttft_<client>_kvserve_over_llama_server",
         "injected_latency_over_solo_<system>"}"""

SERVED_NAME = "bench"
# The user's words of the new conversations (--new-conversations): on the same servers, then after restarting them.
NEW_TASKS = ("Add a --verbose flag to the command line.", "Explain what the tests in this project cover.")
PHASES = ("replay (cold)", "new conversation", "after restart")
DEFAULT_CONVERSATIONS = ("claude-code.json", "codex.json")
# Words of the injected chat's questions (a seeded draw: every question different from its first word on).
WORDS = (
    "file", "test", "parser", "cache", "block", "request", "token", "server", "thread", "queue", "error", "value",
    "function", "module", "branch", "commit", "list", "map", "loop", "index",
)  # fmt: skip


def fixtures_dir() -> Path:
    """The repository's recorded conversations (a source checkout: the fixtures are not installed with the package)."""
    return Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "agents"


def chat_question(rng: random.Random, words: int, number: int) -> str:
    """A short question, different for every `number`, of about `words` words."""
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Question {number}: in one sentence, what does this mean: {body}?"


def chat_body(question: str, output_len: int) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


class Replay:
    """The replay's plan and its measurements: which system gets which request on which endpoint."""

    def __init__(self, conversations: list[AgentConversation], args: argparse.Namespace) -> None:
        self.conversations = conversations
        self.args = args
        self.rng = random.Random(args.seed)
        self.questions = 0

    def next_question(self) -> dict[str, Any]:
        self.questions += 1
        return chat_body(chat_question(self.rng, self.args.chat_words, self.questions), self.args.chat_output_len)

    def request(
        self, system: str, conversation: AgentConversation, turn: int, new_text: str | None = None
    ) -> tuple[str, dict[str, Any], dict]:
        """(endpoint path, body, headers) of a turn for `system`; with `new_text`, the turn (a first one) starting
        another conversation with those words."""
        body = turn_body(conversation, turn, SERVED_NAME, self.args.output_len)
        if new_text is not None:
            body = new_conversation(conversation, body, new_text)
        peer_chat = self.args.llama_server_codex_endpoint == "chat"
        if system != "kvserve" and conversation.endpoint == "/v1/responses" and peer_chat:
            return "/v1/chat/completions", responses_to_chat(body, self.args.output_len), {}
        return conversation.path, body, conversation.headers

    async def run(self, urls: dict[str, str], on_request: Any) -> dict[str, dict[str, Any]]:
        import httpx

        from kvserve.bench.stats import median

        names = list(urls)
        out: dict[str, dict[str, Any]] = {n: {"turns": [], "injected": {}} for n in names}
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.args.timeout)) as client:
            for name in names:  # warm-up (unmeasured), then the solo chats, on each idle server
                await stream_request(client, urls[name] + "/v1/chat/completions", self.next_question())
                solo = []
                for _ in range(self.args.solo_repeats):
                    solo.append(await stream_request(client, urls[name] + "/v1/chat/completions", self.next_question()))
                    on_request()
                out[name]["injected"] = {
                    "solo_latency_ms": [_ms(r.latency_s) for r in solo],
                    "solo_latency_ms_median": median([1e3 * r.latency_s for r in solo]),
                    "solo_ttft_ms_median": median([1e3 * (r.ttft_s or r.latency_s) for r in solo]),
                    "errors": [r.error for r in solo if r.error],
                }
            k = 0
            for c, conversation in enumerate(self.conversations):
                for t in range(len(conversation.turns)):
                    for name in names[k % len(names) :] + names[: k % len(names)]:
                        path, body, headers = self.request(name, conversation, t)
                        url = urls[name] + path
                        if c == 0 and t == 0:
                            reply, chat, during = await self._with_injected(client, url, body, headers, urls[name])
                            out[name]["injected"].update(self._injected_row(chat, during, out[name]["injected"]))
                        else:
                            reply = await stream_request(client, url, body, headers)
                        out[name]["turns"].append(self._turn_row(conversation, t, path, reply))
                        on_request()
                    k += 1
        return out

    async def new_conversations(
        self, urls: dict[str, str], phase: str, text: str, on_request: Any
    ) -> dict[str, list[dict[str, Any]]]:
        """Each conversation's first turn with other words from the user (`text`): another conversation of the same
        agent in the same project, whose system prompt and tools are those the replay's first turn sent."""
        import httpx

        names = list(urls)
        out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.args.timeout)) as client:
            for k, conversation in enumerate(self.conversations):
                for name in names[k % len(names) :] + names[: k % len(names)]:
                    path, body, headers = self.request(name, conversation, 0, text)
                    reply = await stream_request(client, urls[name] + path, body, headers)
                    out[name].append({"phase": phase, **self._turn_row(conversation, 0, path, reply)})
                    on_request()
        return out

    async def _with_injected(
        self, client: Any, url: str, body: dict[str, Any], headers: dict, base_url: str
    ) -> tuple[StreamedReply, StreamedReply, bool]:
        """The turn, the short chat sent `--inject-after` seconds after it, and whether the turn was still running
        when the chat was sent (if not, --inject-after is too long for this machine)."""
        turn = asyncio.create_task(stream_request(client, url, body, headers))
        await asyncio.sleep(self.args.inject_after)
        during = not turn.done()
        chat = await stream_request(client, base_url + "/v1/chat/completions", self.next_question())
        return await turn, chat, during

    @staticmethod
    def _injected_row(chat: StreamedReply, during: bool, solo: dict[str, Any]) -> dict[str, Any]:
        solo_ms = solo["solo_latency_ms_median"]
        latency = _ms(chat.latency_s) if chat.error is None else None
        return {
            "latency_ms": latency,
            "ttft_ms": _ms(chat.ttft_s),
            "latency_over_solo": latency / solo_ms if latency is not None and solo_ms else None,
            "sent_during_turn": during,
            "error": chat.error,
        }

    @staticmethod
    def _turn_row(conversation: AgentConversation, turn: int, path: str, reply: StreamedReply) -> dict[str, Any]:
        ok = reply.error is None
        return {
            "conversation": conversation.client,
            "turn": turn + 1,
            "endpoint": path.partition("?")[0],
            "ttft_ms": _ms(reply.ttft_s if reply.ttft_s is not None else reply.latency_s) if ok else None,
            "latency_ms": _ms(reply.latency_s) if ok else None,
            "prompt_tokens": reply.prompt_tokens,
            "cached_tokens": reply.cached_tokens,
            "cached_fraction": reply.cached_fraction,
            "error": reply.error,
        }


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "agents",
        "Claude Code's and Codex's recorded conversations replayed against kvserve and llama-server: TTFT and "
        "cached fraction per turn, and a short chat injected during the first turn",
        __doc__,
        SCHEMA,
    )
    p.add_argument(
        "--conversation",
        action="append",
        default=None,
        metavar="PATH",
        help="a recorded conversation ({client, version, endpoint, headers, turns}); repeat for more (default: "
        + " and ".join(f"tests/fixtures/agents/{n}" for n in DEFAULT_CONVERSATIONS)
        + " of the source tree)",
    )
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="kvserve's --model (llama-server: its GGUF)")
    p.add_argument("--max-model-len", type=int, default=32768, help="both servers' context")
    p.add_argument("--kv-cache-memory-bytes", default="4GiB", help="kvserve's KV budget")
    p.add_argument(
        "--kvserve-args",
        default="--enable-auto-tool-choice --tool-call-parser hermes",
        help="more `kvserve serve` flags, one string (default: %(default)s)",
    )
    p.add_argument("--llama-server", default=None, metavar="PATH", help="also llama-server on the same GGUF")
    p.add_argument(
        "--llama-server-args", default="--jinja", help="more llama-server flags, one string (default: %(default)s)"
    )
    p.add_argument(
        "--llama-server-codex-endpoint",
        choices=("chat", "responses"),
        default="chat",
        help="how llama-server is sent a /v1/responses conversation: as chat completions (default) or on its own "
        "/v1/responses",
    )
    p.add_argument("--output-len", type=int, default=1, help="output tokens of every turn (the prompt is measured)")
    p.add_argument("--inject-after", type=float, default=5.0, help="seconds into the first turn the chat is sent")
    p.add_argument("--chat-words", type=int, default=16, help="words of the injected chat's question")
    p.add_argument("--chat-output-len", type=int, default=32, help="tokens of the injected chat's answer")
    p.add_argument("--solo-repeats", type=int, default=3, help="solo chats per system (their median is the base)")
    p.add_argument(
        "--new-conversations",
        action="store_true",
        help="then each conversation's first turn with other words from the user (a new conversation of the same "
        "agent: the same system prompt and tools), on the same servers and again after restarting them (kvserve "
        "keeps what its tier holds when --kvserve-args gives it a --kv-offloading-path)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "TTFT per turn, per system and conversation (log scale)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from kvserve.bench.machine import machine_info
    from kvserve.bench.offload_peer import LlamaServer
    from kvserve.bench.report import Report, config_of, emit
    from kvserve.bench.server_process import ServerProcess
    from kvserve.model.source import resolve_model

    paths = [Path(p) for p in args.conversation or [fixtures_dir() / n for n in DEFAULT_CONVERSATIONS]]
    conversations = [AgentConversation.load(p) for p in paths]
    clients = [c.client for c in conversations]
    if len(set(clients)) != len(clients):
        raise ValueError(f"--conversation: one conversation a client, got {clients} (the tables name them by client)")
    for flag in ("output_len", "chat_output_len", "chat_words", "solo_repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    model = str(resolve_model(args.model).path)
    logs = Path(tempfile.mkdtemp(prefix="kvserve-bench-agents-"))
    kvserve_args = ["--model", model, "--served-model-name", SERVED_NAME, "--max-model-len", str(args.max_model_len)]
    kvserve_args += ["--kv-cache-memory-bytes", args.kv_cache_memory_bytes, *shlex.split(args.kvserve_args)]
    llama_args = ["-m", model, "-c", str(args.max_model_len), "--alias", SERVED_NAME]
    llama_args += shlex.split(args.llama_server_args)
    system_args = {"kvserve": kvserve_args}
    if args.llama_server:
        system_args["llama-server"] = llama_args
    replay = Replay(conversations, args)
    servers: list[Any] = []

    def start(run: int) -> dict[str, str]:
        """Both servers, fresh processes (run 0: the replay; 1: after a restart); their base URLs."""
        kv = ServerProcess.start(kvserve_args, logs / f"kvserve-{run}.log", timeout_s=900.0)
        servers.append(kv)
        urls = {"kvserve": kv.base_url}
        if args.llama_server:
            peer = LlamaServer(args.llama_server, llama_args, logs / f"llama-server-{run}.log")
            servers.append(peer)
            urls["llama-server"] = peer.base_url
        return urls

    def stop() -> None:
        while servers:
            servers.pop().stop()

    per_turn = sum(len(c.turns) for c in conversations) + (2 * len(conversations) if args.new_conversations else 0)
    try:
        urls = start(0)
        with tqdm(
            total=len(urls) * (args.solo_repeats + per_turn), desc="bench agents", unit="request", disable=None
        ) as bar:
            systems = asyncio.run(replay.run(urls, lambda: bar.update(1)))
            if args.new_conversations:
                first = asyncio.run(replay.new_conversations(urls, "new conversation", NEW_TASKS[0], bar.update))
                stop()
                urls = start(1)
                again = asyncio.run(replay.new_conversations(urls, "after restart", NEW_TASKS[1], bar.update))
                for name in systems:
                    systems[name]["new_conversations"] = first[name] + again[name]
    finally:
        stop()
    report = Report("agents", machine_info(), config_of(args))
    report.results = {
        "conversations": [
            {"client": c.client, "version": c.version, "endpoint": c.endpoint, "turns": len(c.turns)}
            for c in conversations
        ],
        "systems": {name: summarize(row, system_args[name]) for name, row in systems.items()},
    }
    report.ratios = ratios(report.results["systems"], conversations)
    report.tables.append(turn_table(report.results["systems"], conversations))
    report.tables.append(injected_table(report.results["systems"], args))
    if args.new_conversations:
        report.tables.append(new_conversation_table(report.results["systems"]))
    report.notes.append(f"server logs in {logs}")
    emit(report, args.json)
    if args.plot:
        plot(report.results["systems"], conversations, args.plot)
    return 0


def summarize(row: dict[str, Any], args: list[str]) -> dict[str, Any]:
    """A system's turns with its first-turn TTFT per conversation and the p50 TTFT of every later turn."""
    from kvserve.bench.stats import percentile

    later = [t["ttft_ms"] for t in row["turns"] if t["turn"] > 1 and t["ttft_ms"] is not None]
    first = {t["conversation"]: t["ttft_ms"] for t in row["turns"] if t["turn"] == 1}
    injected, turn = row["injected"], row["turns"][0]["ttft_ms"]
    chat = injected.get("latency_ms")
    # The first turn lost at most the time the chat was served: its slowdown is at most turn / (turn - chat).
    ok = chat is not None and turn is not None and turn > chat and injected.get("sent_during_turn")
    injected["first_turn_slowdown_at_most"] = turn / (turn - chat) if ok else None
    return {
        "args": args,
        "turns": row["turns"],
        "first_turn_ttft_ms": first,
        "later_turns_ttft_ms_p50": percentile(later, 50) if later else None,
        "injected": row["injected"],
        "new_conversations": row.get("new_conversations", []),
    }


def ratios(systems: dict[str, dict[str, Any]], conversations: list[AgentConversation]) -> dict[str, float | None]:
    from kvserve.bench.stats import ratio

    out: dict[str, float | None] = {}
    if "llama-server" in systems:
        mine, peer = systems["kvserve"], systems["llama-server"]
        out["later_turns_ttft_p50_kvserve_over_llama_server"] = ratio(
            mine["later_turns_ttft_ms_p50"], peer["later_turns_ttft_ms_p50"]
        )
        for c in conversations:
            key = f"first_turn_ttft_{c.client.replace('-', '_')}_kvserve_over_llama_server"
            out[key] = ratio(mine["first_turn_ttft_ms"].get(c.client), peer["first_turn_ttft_ms"].get(c.client))
    for name, row in systems.items():
        out[f"injected_latency_over_solo_{name.replace('-', '_')}"] = row["injected"].get("latency_over_solo")
    return out


def turn_table(systems: dict[str, dict[str, Any]], conversations: list[AgentConversation]) -> Any:
    from kvserve.bench.report import Table

    names = list(systems)
    columns = ["conversation", "turn"]
    for name in names:
        columns += [f"{name} prompt tokens", f"{name} TTFT ms", f"{name} cached"]
    table = Table("Recorded agent turns: TTFT (ms) and the cached fraction each server reports", columns)
    rows = {name: {(t["conversation"], t["turn"]): t for t in systems[name]["turns"]} for name in names}
    for c in conversations:
        for turn in range(1, len(c.turns) + 1):
            cells: list[Any] = [f"{c.client} {c.version}", turn]
            for name in names:
                t = rows[name][(c.client, turn)]
                failed = "error: " + t["error"][:40] if t["error"] else None
                cells += [t["prompt_tokens"], failed or t["ttft_ms"], t["cached_fraction"]]
            table.add(*cells)
    return table


def injected_table(systems: dict[str, dict[str, Any]], args: argparse.Namespace) -> Any:
    from kvserve.bench.report import Table

    table = Table(
        f"A {args.chat_words}-word chat ({args.chat_output_len} tokens out) sent {args.inject_after:g} s into the "
        "first turn, against the same chat alone",
        ["system", "solo latency ms (median)", "injected latency ms", "injected TTFT ms", "injected / solo",
         "first turn slowed at most"],
    )  # fmt: skip
    for name, row in systems.items():
        i = row["injected"]
        cells = [i["solo_latency_ms_median"], i.get("latency_ms"), i.get("ttft_ms"), i.get("latency_over_solo")]
        table.add(name, *cells, i.get("first_turn_slowdown_at_most"))
    return table


def new_conversation_table(systems: dict[str, dict[str, Any]]) -> Any:
    """Per conversation, its first turn in the replay (cold), as a new conversation, and again after a restart."""
    from kvserve.bench.report import Table

    names = list(systems)
    columns = ["conversation", "first turn"]
    for name in names:
        columns += [f"{name} TTFT ms", f"{name} cached"]
    table = Table(
        "A new conversation's first turn (the same system prompt and tools, other words from the user)", columns
    )
    rows: dict[str, dict[tuple[str, str], dict[str, Any]]] = {name: {} for name in names}
    for name in names:
        for t in systems[name]["turns"]:
            if t["turn"] == 1:
                rows[name][(t["conversation"], "replay (cold)")] = t
        for t in systems[name]["new_conversations"]:
            rows[name][(t["conversation"], t["phase"])] = t
    for conversation, phase in sorted(rows[names[0]], key=lambda k: (k[0], PHASES.index(k[1]))):
        cells: list[Any] = [conversation, phase]
        for name in names:
            t = rows[name][(conversation, phase)]
            cells += [("error: " + t["error"][:40]) if t["error"] else t["ttft_ms"], t["cached_fraction"]]
        table.add(*cells)
    return table


def plot(systems: dict[str, dict[str, Any]], conversations: list[AgentConversation], path: str) -> None:
    """TTFT per turn, a panel per conversation, a line per system (log scale)."""
    from kvserve.bench.plot import Panel, Series, line_plot

    panels = []
    for c in conversations:
        series = []
        for name, row in systems.items():
            turns = [t for t in row["turns"] if t["conversation"] == c.client]
            series.append(Series(name, [t["turn"] for t in turns], [t["ttft_ms"] for t in turns]))
        panels.append(Panel(f"{c.client} {c.version}: TTFT per turn", "turn", "TTFT ms", series, log_y=True))
    line_plot(path, panels)
