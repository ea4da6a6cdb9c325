"""Capture what coding-agent CLIs send, and turn the capture into tests/fixtures/agents/*.json.

`serve PORT LOG`: a logging stub on 127.0.0.1 that records each request (method, path, headers, JSON body) as a line
of LOG and answers with a minimal valid streamed reply, no model involved: Anthropic's events on /v1/messages,
Responses events on /v1/responses. A conversation whose last input is not a tool result gets a call of the next tool
of STUB_TOOLS (comma-separated; `ns.name` is function `name` of namespace tool `ns`, answered as Codex reads it:
`"name"` plus `"namespace"`) with the arguments at the same place in STUB_ARGS (a JSON list), the n-th call of a
conversation taking the n-th tool; after a tool result the reply is the text "done".

`fixture claude|codex LOG OUT`: the captured POSTs as a fixture: the structure kept (roles, fields, tool names,
schemas), the prose (system prompts, developer messages, system reminders, tool and parameter descriptions) replaced
by neutral words of the same length in tokens of the instruct model's tokenizer, and random identifiers by fixed fake
ones. tests/fixtures/agents/README.md says how the fixtures there were captured.

Usage (the whole recipe is in tests/fixtures/agents/README.md):
  STUB_TOOLS=Bash,Read \
  STUB_ARGS='[{"command": "ls", "description": "List files"}, {"file_path": "/tmp/agents-demo/hello.py"}]' \
    python scripts/capture_agent_requests.py serve 8781 claude.jsonl
  python scripts/capture_agent_requests.py fixture claude claude.jsonl tests/fixtures/agents/claude-code.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")


# -- the stub --------------------------------------------------------------------------------------------------


def _planned_calls() -> list[tuple[str, dict[str, Any]]]:
    tools = os.environ.get("STUB_TOOLS", "Bash").split(",")
    args = json.loads(os.environ.get("STUB_ARGS", '[{"command": "ls", "description": "List files"}]'))
    return list(zip(tools, args))


def _offered(tools: list[dict[str, Any]] | None) -> set[str]:
    names = set()
    for t in tools or []:
        names.add(str(t.get("name")))
        for inner in t.get("tools", []) if t.get("type") == "namespace" else []:
            names.add(f"{t['name']}.{inner.get('name')}")
    return names


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def _anthropic_reply(body: dict[str, Any]) -> str:
    messages = body.get("messages") or [{}]
    blocks = [b for m in messages if isinstance(m.get("content"), list) for b in m["content"] if isinstance(b, dict)]
    last = messages[-1].get("content")
    after_result = isinstance(last, list) and any(b.get("type") == "tool_result" for b in last if isinstance(b, dict))
    plan = _planned_calls()
    tool, args = plan[sum(b.get("type") == "tool_use" for b in blocks) % len(plan)]
    usage = {"input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant"}
    message |= {"model": body.get("model"), "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    out = [_event("message_start", {"message": message})]
    if tool in _offered(body.get("tools")) and not after_result:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": tool, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(args)}
        reason = "tool_use"
    else:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": "done" if after_result else "ok"}
        reason = "end_turn"
    out.append(_event("content_block_start", {"index": 0, "content_block": block}))
    out.append(_event("content_block_delta", {"index": 0, "delta": delta}))
    out.append(_event("content_block_stop", {"index": 0}))
    stop = {"delta": {"stop_reason": reason, "stop_sequence": None}, "usage": {"output_tokens": 5}}
    out.append(_event("message_delta", stop))
    out.append(_event("message_stop", {}))
    return "".join(out)


def _responses_reply(body: dict[str, Any]) -> str:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    after_result = False
    for item in reversed(items):
        if item.get("type") in TOOL_OUTPUTS:
            after_result = True
            break
        if item.get("type", "message") == "message" and item.get("role") == "user":
            break
    plan = _planned_calls()
    tool, args = plan[sum(i.get("type") == "function_call" for i in items) % len(plan)]
    seq = iter(range(1 << 30))
    response = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": 0, "model": body.get("model")}
    response |= {"status": "in_progress", "output": [], "usage": None}
    out = [_event("response.created", {"sequence_number": next(seq), "response": response})]
    item: dict[str, Any]
    if tool in _offered(body.get("tools")) and not after_result:
        namespace, _, name = tool.rpartition(".")
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed", "name": name}
        item |= {"call_id": f"call_{uuid.uuid4().hex[:24]}", "arguments": json.dumps(args)}
        if namespace:
            item["namespace"] = namespace
    else:
        text = "done" if after_result else "ok"
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress"}
        out.append(
            _event("response.output_item.added", {"sequence_number": next(seq), "output_index": 0, "item": item})
        )
        ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        out.append(_event("response.output_text.delta", {"sequence_number": next(seq), **ids, "delta": text}))
        item = item | {"status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]}
    out.append(_event("response.output_item.done", {"sequence_number": next(seq), "output_index": 0, "item": item}))
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5}
    usage |= {"output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    final = response | {"status": "completed", "output": [item], "usage": usage}
    out.append(_event("response.completed", {"sequence_number": next(seq), "response": final}))
    return "".join(out)


def serve(port: int, log: Path) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _record(self, body: Any) -> None:
            with log.open("a") as f:
                row = {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
                f.write(json.dumps(row) + "\n")

        def _send(self, status: int, payload: Any, content_type: str = "application/json") -> None:
            data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._record(None)
            self._send(404, {"error": {"message": "not found"}})

        def do_HEAD(self) -> None:
            self._record(None)
            self._send(200, "")

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(raw)
            self._record(body)
            path = self.path.split("?")[0]
            if path.endswith("/messages/count_tokens"):
                self._send(200, {"input_tokens": 100})
            elif path.endswith("/messages") and body.get("stream"):
                self._send(200, _anthropic_reply(body), "text/event-stream")
            elif path.endswith("/responses"):
                self._send(200, _responses_reply(body), "text/event-stream")
            else:
                self._send(404, {"error": {"message": f"the stub does not answer {path}"}})

        def log_message(self, format: str, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


# -- the fixture -----------------------------------------------------------------------------------------------

WORDS = (
    "the a of to and in is for on with as by this that it be are or from at an which when each one can not will "
    "use file value list item step part note text line field name type set call read write run check keep give "
    "order number time case rule result input output request reply block table entry record page group state "
    "first last next other same new old long short small large simple clear usual plain given known open closed "
    "before after while until where here there then also only just still even more less most least many few"
).split()
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class Scrubber:
    """Prose to neutral words of the same token count (the instruct model's tokenizer); identifiers to fakes."""

    def __init__(self) -> None:
        from kvserve.model.source import resolve_model
        from kvserve.model.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(resolve_model("qwen2.5-coder-0.5b-instruct"))
        self.fakes: dict[str, str] = {}

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def filler(self, n: int, seed: str) -> str:
        """Neutral words of `n` tokens (n-1 where re-encoding the cut merges two), lines of 14 words."""
        if n <= 0:
            return ""
        rng = random.Random(seed)
        words: list[str] = []
        text = ""
        while self.count(text) < n:
            words.extend(rng.choice(WORDS) for _ in range(max(1, (n - self.count(text)) // 2)))
            text = ".\n".join(" ".join(words[i : i + 14]) for i in range(0, len(words), 14))
        out = self.tokenizer.decode(self.tokenizer.encode(text, add_special_tokens=False)[:n]).rstrip()
        while self.count(out) > n:
            out = out[:-1].rstrip()
        return out

    def prose(self, text: str, seed: str) -> str:
        """`text` as neutral words; an XML-like tag framing it (`<system-reminder>...`) and leading space kept."""
        framed = re.fullmatch(r"(\s*<([a-z_-]+)>\n?)(.*?)(\n?</\2>\s*)", text, re.S)
        if framed:
            return framed.group(1) + self.filler(self.count(framed.group(3)), seed) + framed.group(4)
        return text[: len(text) - len(text.lstrip())] + self.filler(self.count(text.strip()), seed)

    def schema(self, schema: Any, seed: str) -> Any:
        """A JSON schema with every `description` annotation neutral (a property named description is kept)."""
        if isinstance(schema, list):
            return [self.schema(x, f"{seed}/{i}") for i, x in enumerate(schema)]
        if not isinstance(schema, dict):
            return schema
        out = {}
        for key, value in schema.items():
            if key == "description" and isinstance(value, str):
                out[key] = self.prose(value, seed + "/description")
            elif key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
                out[key] = {name: self.schema(sub, f"{seed}/{name}") for name, sub in value.items()}
            else:
                out[key] = self.schema(value, f"{seed}/{key}")
        return out

    def ids(self, body: dict[str, Any]) -> dict[str, Any]:
        """Every UUID in `body` as a fake one, the same UUID always the same fake (a session stays one session)."""

        def fake(m: re.Match[str]) -> str:
            n = self.fakes.setdefault(m.group(0), f"{len(self.fakes):08x}")
            return f"{n}-0000-4000-8000-{int(n, 16):012x}"

        result: dict[str, Any] = json.loads(UUID.sub(fake, json.dumps(body)))
        return result


def claude_fixture(rows: list[dict[str, Any]], scrub: Scrubber) -> dict[str, Any]:
    posts = [r for r in rows if r["method"] == "POST" and r["path"].split("?")[0] == "/v1/messages"]
    headers = {k.lower(): v for k, v in posts[0]["headers"].items()}
    turns = []
    for row in posts:
        body = scrub.ids(row["body"])
        body["metadata"]["user_id"] = re.sub(
            r'"device_id":"[0-9a-f]+"', '"device_id":"' + "0" * 64 + '"', body["metadata"]["user_id"]
        )
        for i, block in enumerate(body["system"]):
            if not block["text"].startswith("x-anthropic-billing-header"):
                block["text"] = scrub.prose(block["text"], f"system/{i}")
        for i, message in enumerate(body["messages"]):
            if message["role"] == "system":
                message["content"] = scrub.prose(message["content"], f"messages/{i}")
            elif isinstance(message["content"], list):
                for j, block in enumerate(message["content"]):
                    if block.get("type") == "text" and block["text"].lstrip().startswith("<system-reminder>"):
                        block["text"] = scrub.prose(block["text"], f"messages/{i}/{j}")
        for tool in body["tools"]:
            tool["description"] = scrub.prose(tool["description"], f"tools/{tool['name']}")
            tool["input_schema"] = scrub.schema(tool["input_schema"], f"tools/{tool['name']}")
        turns.append(body)
    return {
        "client": "claude-code",
        "version": "2.1.197",
        "endpoint": "/v1/messages",
        "query": posts[0]["path"].partition("?")[2],
        "headers": {k: headers[k] for k in ("anthropic-version", "anthropic-beta") if k in headers},
        "turns": turns,
    }


def _codex_tool(tool: dict[str, Any], scrub: Scrubber, seed: str) -> dict[str, Any]:
    tool = dict(tool)
    if isinstance(tool.get("description"), str):
        tool["description"] = scrub.prose(tool["description"], seed)
    if "parameters" in tool:
        tool["parameters"] = scrub.schema(tool["parameters"], seed)
    if "tools" in tool:
        tool["tools"] = [_codex_tool(t, scrub, f"{seed}/{t.get('name')}") for t in tool["tools"]]
    return tool


def codex_fixture(rows: list[dict[str, Any]], scrub: Scrubber) -> dict[str, Any]:
    posts = [r for r in rows if r["method"] == "POST" and r["path"] == "/v1/responses"]
    headers = {k.lower(): v for k, v in posts[0]["headers"].items()}
    turns = []
    for row in posts:
        body = scrub.ids(row["body"])
        meta = body.get("client_metadata") or {}
        if "x-codex-turn-metadata" in meta:
            turn = json.loads(meta["x-codex-turn-metadata"])
            turn["turn_started_at_unix_ms"] = 1_800_000_000_000
            meta["x-codex-turn-metadata"] = json.dumps(turn, separators=(",", ":"))
        for i, item in enumerate(body["input"]):
            if item.get("type", "message") == "message" and item.get("role") == "developer":
                for j, part in enumerate(item["content"]):
                    part["text"] = scrub.prose(part["text"], f"input/{i}/{j}")
        body["tools"] = [_codex_tool(t, scrub, f"tools/{t.get('name', t.get('type'))}") for t in body["tools"]]
        turns.append(body)
    return {
        "client": "codex",
        "version": "0.171.0",
        "endpoint": "/v1/responses",
        "headers": {k: headers[k] for k in ("accept", "x-codex-beta-features") if k in headers},
        "turns": turns,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="the logging stub")
    s.add_argument("port", type=int)
    s.add_argument("log", type=Path)
    f = sub.add_parser("fixture", help="a capture as a fixture")
    f.add_argument("client", choices=("claude", "codex"))
    f.add_argument("log", type=Path)
    f.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.port, args.log)
        return
    rows = [json.loads(line) for line in args.log.read_text().splitlines()]
    scrub = Scrubber()
    fixture = claude_fixture(rows, scrub) if args.client == "claude" else codex_fixture(rows, scrub)
    args.out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
