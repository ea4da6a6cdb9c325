"""The requests `kvserve bench agents` replays: a coding agent's recorded conversation (tests/fixtures/agents/*.json),
each turn's body as the client sent it, how a peer without the client's endpoint is sent the same turn (a Responses
request as a chat completion), and one streamed reply read the same way whatever the API: when its first content
came, how long it took, and what the server says it read from its cache.

Why one reader for three APIs: TTFT must mean the same on every server. The first content is the first event that
carries output (an Anthropic content block, a Responses output item or delta, a chat delta with text or a tool
call); keep-alive pings and SSE comments are not content."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The Responses events that carry output (the rest announce or close the response).
_RESPONSES_OUTPUT = ("response.output_item.added", "response.output_text.delta", "response.function_call_arguments")


@dataclass(frozen=True, slots=True)
class AgentConversation:
    """One recorded conversation: the client, the endpoint it spoke to, its protocol headers, its request bodies."""

    client: str
    version: str
    endpoint: str  # "/v1/messages" or "/v1/responses"
    headers: dict[str, str]
    turns: list[dict[str, Any]]
    query: str = ""

    @classmethod
    def load(cls, path: Path) -> AgentConversation:
        doc = json.loads(path.read_text())
        missing = {"client", "version", "endpoint", "turns"} - set(doc)
        if missing or doc["endpoint"] not in ("/v1/messages", "/v1/responses") or not doc["turns"]:
            raise ValueError(
                f"{path}: not a recorded agent conversation ({{client, version, endpoint: /v1/messages or "
                f"/v1/responses, headers, turns: [body, ...]}}); missing {sorted(missing) or 'turns'}"
            )
        return cls(
            doc["client"],
            doc["version"],
            doc["endpoint"],
            dict(doc.get("headers") or {}),
            doc["turns"],
            doc.get("query", ""),
        )

    @property
    def path(self) -> str:
        """The endpoint with the client's query string (Claude Code's `?beta=true`)."""
        return self.endpoint + (f"?{self.query}" if self.query else "")


def turn_body(conversation: AgentConversation, index: int, model: str, output_len: int) -> dict[str, Any]:
    """Turn `index` as the client sent it, streamed, to `model`, with its output cut to `output_len` tokens (the next
    turn is the recorded one whatever the server answers, so only the prompt's processing is measured)."""
    body = {**conversation.turns[index], "model": model, "stream": True}
    if conversation.endpoint == "/v1/messages":
        body["max_tokens"] = output_len
    else:
        body["max_output_tokens"] = output_len
    return body


def new_conversation(conversation: AgentConversation, body: dict[str, Any], text: str) -> dict[str, Any]:
    """A first turn's body as the client would send it to start another conversation in the same project: the same
    system prompt, tools and context, with `text` for the user's own words (the last text of the last user message)."""
    key = "messages" if conversation.endpoint == "/v1/messages" else "input"
    messages = [dict(m) for m in body[key]]
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        if isinstance(message.get("content"), str):
            message["content"] = text
            return {**body, key: messages}
        parts = [dict(part) for part in message.get("content") or []]
        for part in reversed(parts):
            if part.get("type") in ("text", "input_text"):
                part["text"] = text
                message["content"] = parts
                return {**body, key: messages}
    raise ValueError(f"{conversation.client}: its first turn has no user text to change")


def _text(content: Any) -> str:
    """A Responses message's content (a string or parts with text) as one string."""
    if isinstance(content, str):
        return content
    return "\n\n".join(str(part.get("text", "")) for part in content or [] if isinstance(part, dict))


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool},
    }


def responses_to_chat(body: dict[str, Any], output_len: int) -> dict[str, Any]:
    """A Responses request as the chat completion a server without /v1/responses is sent: `instructions` and
    `developer` messages as system messages, function calls as an assistant message's tool calls, their outputs as
    tool messages, reasoning items left out; function tools as chat tools, a namespace's functions among them, hosted
    tools (web_search, ...) left out, since no local server runs them."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] in ("developer", "system") else item["role"]
            messages.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item.get("arguments", "")}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"))})
    tools = []
    for tool in body.get("tools") or []:
        if tool.get("type") == "function":
            tools.append(_chat_tool(tool))
        elif tool.get("type") == "namespace":
            tools += [_chat_tool(t) for t in tool.get("tools") or [] if t.get("type") == "function"]
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": True, "max_tokens": output_len}
    chat["stream_options"] = {"include_usage": True}
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = body.get("tool_choice", "auto")
    return chat


@dataclass(slots=True)
class StreamedReply:
    """One streamed request as the client saw it. prompt_tokens and cached_tokens are the server's own report (None
    when it gives none)."""

    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None
    events: int = 0
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def cached_fraction(self) -> float | None:
        if self.prompt_tokens is None or self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens


def _is_output(event: dict[str, Any]) -> bool:
    """Whether an SSE event of any of the three APIs carries output."""
    kind = str(event.get("type", ""))
    if kind in ("content_block_start", "content_block_delta"):
        return True
    if kind.startswith(_RESPONSES_OUTPUT):
        return True
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") or choice.get("text"):
            return True
    return False


def _read_usage(event: dict[str, Any], reply: StreamedReply) -> None:
    """The prompt and cache counts an event reports, in whichever API's shape: Anthropic's usage (input + cache read
    + cache creation), Responses' (input_tokens with input_tokens_details.cached_tokens), chat's (prompt_tokens with
    prompt_tokens_details.cached_tokens) or llama-server's timings (prompt_n computed, cache_n reused)."""
    nested = [event.get(k) for k in ("response", "message")]  # Responses' response.completed, Anthropic's start
    for usage in (event.get("usage"), *(n.get("usage") for n in nested if isinstance(n, dict))):
        if not isinstance(usage, dict):
            continue
        reply.usage.update({k: v for k, v in usage.items() if v is not None})
    u = reply.usage
    if "cache_read_input_tokens" in u or "cache_creation_input_tokens" in u:
        read = int(u.get("cache_read_input_tokens") or 0)
        reply.prompt_tokens = int(u.get("input_tokens") or 0) + read + int(u.get("cache_creation_input_tokens") or 0)
        reply.cached_tokens = read
    elif "input_tokens" in u or "prompt_tokens" in u:
        reply.prompt_tokens = int(u.get("input_tokens", u.get("prompt_tokens")) or 0)
        details = u.get("input_tokens_details") or u.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            reply.cached_tokens = int(details["cached_tokens"])
    if "output_tokens" in u or "completion_tokens" in u:
        reply.output_tokens = int(u.get("output_tokens", u.get("completion_tokens")) or 0)
    timings = event.get("timings")
    if isinstance(timings, dict) and timings.get("cache_n") is not None:
        reply.cached_tokens = int(timings["cache_n"])
        reply.prompt_tokens = int(timings["cache_n"]) + int(timings.get("prompt_n") or 0)


async def stream_request(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> StreamedReply:
    """POST `body` to `url` and read its SSE stream to the end (an HTTP error or an error event is kept in `error`)."""
    import httpx

    reply = StreamedReply()
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers or {}) as r:
            if r.status_code != 200:
                reply.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError:  # a chunk with a broken escape still marks an arrival
                        reply.ttft_s = reply.ttft_s if reply.ttft_s is not None else time.perf_counter() - start
                        continue
                    reply.events += 1
                    if event.get("type") in ("error", "response.failed") or (
                        "error" in event and "choices" not in event
                    ):
                        reply.error = f"error event: {json.dumps(event)[:300]}"
                        break
                    if reply.ttft_s is None and _is_output(event):
                        reply.ttft_s = time.perf_counter() - start
                    _read_usage(event, reply)
    except (httpx.HTTPError, ValueError) as e:
        reply.error = f"{type(e).__name__}: {e}"
    reply.latency_s = time.perf_counter() - start
    return reply
