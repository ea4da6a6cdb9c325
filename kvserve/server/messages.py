"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as a translation onto the chat path.

Why a translation (as the Responses API is): a Messages request is a chat request in other clothes (`system` is a
system message, `tool_use` blocks an assistant's tool calls, `tool_result` blocks tool messages, `tool_choice`'s
auto / any / tool / none chat's auto / required / named / none), so it goes through the one chat handler, whose
templates, tool parsers, grammars, prefix cache and errors are tested; the reply, or its stream of chat chunks, is
rewritten into a Message and Anthropic's events (`message_start`, `ping`, per block `content_block_start`,
`content_block_delta` (`text_delta` or `input_json_delta`), `content_block_stop`, then `message_delta` with the stop
reason and the usage, and `message_stop`).

`cache_control` marks (on system blocks, message blocks and tools) are checked as Anthropic checks them (type
"ephemeral", ttl "5m" or "1h", at most four, 1h ones before 5m ones) and give the usage Anthropic's split: the prompt
tokens served from the KV cache (pool or tier) are `cache_read_input_tokens`; those this request computed up to its
last breakpoint, in whole KV blocks (what the prefix cache keeps), are `cache_creation_input_tokens`; the rest are
`input_tokens`, so the three add up to the prompt, which count_tokens returns. A breakpoint's token position is found
by rendering the conversation up to its block and taking the longest common prefix with the whole prompt.

What Claude Code sends besides (issue 55, tests/fixtures/agents/claude-code.json): `role: "system"` messages inside
`messages` (beta `mid-conversation-system-2026-04-07`), rendered as the model's template allows (a system turn where
it has one, else merged into the user turn next to it: kvserve.model.chat_template); `max_tokens` beyond the context
left after its prompt, which generates until the window is full and stops with `model_context_window_exceeded`, as
Anthropic's API does; `thinking`, `context_management`, `output_config.effort`, `metadata` and `service_tier`, which
are accepted and change nothing (the models kvserve serves write no thinking blocks; nothing is cleared from a
context the client resends whole), and named in the X-Kvserve-Ignored-Fields header, with any unknown field.

What kvserve does not have is a 400 naming the field: images and documents, server tools (web search, code
execution, ...; dropped with a warning under --ignore-unsupported-tools), a final assistant message to continue
(prefill). Errors have Anthropic's shape (kvserve.server.errors) and name the Messages fields the client sent
(`tools[3].input_schema`, never chat's `tools[3].function.parameters`: messages_error); the key may come as
`x-api-key` (kvserve.server.auth).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError

from kvserve.sampling_params import KVPin
from kvserve.server.api_tools import ChatTools, unsupported_tool
from kvserve.server.cache_control import (
    TTL_SECONDS,
    Breakpoint,
    CacheUsage,
    breakpoint_positions,
    breakpoints,
)
from kvserve.server.cache_diagnostics import (
    FingerprintStore,
    PromptFingerprint,
    Tenant,
    cache_miss_reason,
    tenant_of,
)
from kvserve.server.chat import KeptPrefix, create_chat_completion, kvserve_headers
from kvserve.server.context import ServerContext
from kvserve.server.errors import APIError, bad_request, from_exception
from kvserve.server.prepare import ChatRender
from kvserve.server.protocol import CacheFields, ChatCompletionRequest, FastList
from kvserve.server.streaming import chat_chunks
from kvserve.server.tools import plan_tools
from kvserve.structured.partial_json import partial_object

logger = logging.getLogger(__name__)


class MessagesRequest(CacheFields):
    """The body of POST /v1/messages, typed as strictly as chat's; `cache_salt` is kvserve's (vLLM's)."""

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: FastList[dict[str, Any]]
    system: str | FastList[dict[str, Any]] | None = None
    stop_sequences: FastList[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    tools: FastList[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    context_management: dict[str, Any] | None = None  # Claude Code's clear_thinking edits: ignored (nothing to clear)
    cache_control: dict[str, Any] | None = None  # automatic caching: a mark on the last block of the last message
    output_config: dict[str, Any] | None = None  # `format`: a json_schema the reply must follow; `effort` is ignored
    diagnostics: dict[str, Any] | None = None  # previous_message_id: why this request missed that one's cache
    structured_outputs: dict[str, Any] | None = None  # vLLM's, as on chat and the Responses API


class CountTokensRequest(CacheFields):
    """The body of POST /v1/messages/count_tokens: what decides a prompt's tokens."""

    model: str | None = None
    messages: FastList[dict[str, Any]]
    system: str | FastList[dict[str, Any]] | None = None
    tools: FastList[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


PromptBody = MessagesRequest | CountTokensRequest

IGNORED_FIELDS_HEADER = "X-Kvserve-Ignored-Fields"
_ACCEPTED_NO_EFFECT = ("thinking", "context_management", "metadata", "service_tier")


def ignored_fields(body: MessagesRequest) -> list[str]:
    """The request's fields that change nothing here: the ones accepted for Claude Code's sake, and unknown ones."""
    names = [name for name in _ACCEPTED_NO_EFFECT if name in body.model_fields_set]
    if "effort" in (body.output_config or {}):
        names.append("output_config.effort")
    return names + sorted(body.unknown_fields())


# -- request: Messages -> chat ----------------------------------------------------------------------------------


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{where} must be an object with a type", param=where)
    return str(block["type"])


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", param=f"{where}.text")
    return text


def _unsupported(kind: str, where: str) -> APIError:
    return bad_request(f"{where}: content blocks of type {kind!r} are not supported by kvserve", param=f"{where}.type")


def _text_blocks(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (system, a tool result's content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{where}[{j}]")
        if kind != "text":
            raise _unsupported(kind, f"{where}[{j}]")
        texts.append(_text(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def _user_messages(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks in order: text joins a user message, each tool_result is a tool message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            flush()
            result = _text_blocks(block.get("content", ""), f"{at}.content")
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": result})
        else:
            raise _unsupported(kind, at)
    flush()
    return out


def _assistant_message(content: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn's blocks as one message: its text and its tool calls (thinking blocks are skipped)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request(f"{at}.input must be an object", param=f"{at}.input")
            function = {"name": _string(block, "name", at), "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": _string(block, "id", at), "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _unsupported(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _message(message: Any, where: str, blocks: int | None = None) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages; `blocks`: its first blocks only (a breakpoint's prefix)."""
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", param=where)
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise bad_request(f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}", param=f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
    content = content if blocks is None else content[:blocks]
    if role == "system":  # mid-conversation (Claude Code's beta): text blocks, rendered as the template allows
        return [{"role": "system", "content": _text_blocks(content, f"{where}.content")}]
    return _user_messages(content, where) if role == "user" else [_assistant_message(content, where)]


def chat_messages(body: PromptBody, upto: Breakpoint | None = None) -> list[dict[str, Any]]:
    """The conversation as chat messages; with `upto`, only as far as that breakpoint's block."""
    out: list[dict[str, Any]] = []
    if body.system is not None and (upto is None or upto.section != "tools"):
        system = body.system
        if upto is not None and upto.section == "system" and isinstance(system, list):
            system = system[: upto.block + 1]
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if upto is not None and upto.section != "messages":
        return out
    last = len(body.messages) - 1 if upto is None else upto.message
    for i, message in enumerate(body.messages[: last + 1]):
        blocks = upto.block + 1 if upto is not None and i == last else None
        out.extend(_message(message, f"messages[{i}]", blocks))
    return out


def chat_tools(tools: list[dict[str, Any]] | None, ignore_unsupported: bool = False) -> ChatTools:
    """Custom tools (name, description, input_schema) as chat's functions; Anthropic's server tools (web search,
    code execution, ...) are a 400, or left out under --ignore-unsupported-tools."""
    if not tools:
        return ChatTools()
    out, origin, dropped = [], [], []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            dropped.append(
                unsupported_tool(where, kind, ignore_unsupported, "only custom tools: name, description, input_schema")
            )
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema must be a JSON schema object", param=f"{where}.input_schema")
        function: dict[str, Any] = {"name": _string(tool, "name", where), "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
        origin.append(where)
    return ChatTools(out or None, tuple(origin), tuple(dropped))


def _chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) for Anthropic's auto / any / tool / none."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice.name must name a tool when tool_choice.type is 'tool'", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request(
        f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}", param="tool_choice.type"
    )


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """output_config.format (a json_schema) as chat's response_format."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}", param="output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _check_turns(body: PromptBody) -> None:
    if not body.messages:
        raise bad_request("messages must not be empty", param="messages")
    last = body.messages[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        raise bad_request(
            "a final assistant message (prefilling the reply) is not supported by kvserve",
            param=f"messages[{len(body.messages) - 1}]",
        )


def chat_request(body: PromptBody, stream: bool, tools: ChatTools) -> ChatCompletionRequest:
    """The chat request this Messages request stands for (count_tokens: the same prompt, one token to generate),
    with `tools` (chat_tools of its tools)."""
    _check_turns(body)
    tool_choice, parallel = _chat_tool_choice(body.tool_choice)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "tools": tools.tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "cache_salt": body.cache_salt,
        "include_kv_cache": body.include_kv_cache,
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
        "max_tokens": 1,
    }
    if isinstance(body, MessagesRequest):
        chat |= {
            "response_format": _response_format(body.output_config),
            "structured_outputs": body.structured_outputs,
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
            "stream": stream,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True} if stream else None,
        }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:  # a value the Messages fields let through and chat's do not
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg', 'invalid')}", param=where or None) from None


# Chat's names of the fields a Messages request has under other names: in `param` (and the message) of an error of
# the chat path underneath. Tool fields are ChatTools.renamed's (it knows where each tool came from).
_MESSAGES_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), name)
    for pattern, name in (
        (r"\bresponse_format\.json_schema\.schema\b", "output_config.format.schema"),
        (r"\bresponse_format\b", "output_config.format"),
        (r"\btool_choice\.function\.name\b", "tool_choice.name"),
        (r"\btool_choice\.function\b", "tool_choice"),
        (r"\bmax_completion_tokens\b", "max_tokens"),
    )
)
# Bare names, renamed in `param` only (in prose, "the prompt" is English).
_MESSAGES_PARAMS = {"prompt": "messages", "stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def messages_error(error: APIError, tools: ChatTools) -> APIError:
    """A chat-path error as this request's own: the fields it names are the Messages fields the client sent."""
    error = tools.renamed(error, "input_schema")
    message, param = error.message, error.param
    for pattern, name in _MESSAGES_NAMES:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param is not None else None
    if param is not None:
        param = _MESSAGES_PARAMS.get(param, param)
    return APIError(error.status, message, param=param, code=error.code)


# -- reply: chat -> Messages ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """A request that opted into cache diagnostics (kvserve.server.cache_diagnostics): its fingerprint, the previous
    message it names (None on a first turn) and that one's fingerprint (None: not found), and where to keep its own."""

    fingerprint: PromptFingerprint
    previous_id: str | None
    previous: PromptFingerprint | None
    store: FingerprintStore
    tenant: Tenant  # whose messages it is compared with and kept among (its cache_salt)

    @classmethod
    def of(cls, ctx: ServerContext, body: MessagesRequest, model: str) -> Diagnosis | None:
        if "diagnostics" not in body.model_fields_set:
            return None
        previous_id = (body.diagnostics or {}).get("previous_message_id")
        if previous_id is not None and not isinstance(previous_id, str):
            raise bad_request(
                "diagnostics.previous_message_id must be a message id or null", "diagnostics.previous_message_id"
            )
        fingerprint = PromptFingerprint.of(body, model)
        tenant = tenant_of(body.cache_salt)
        return cls(fingerprint, previous_id, ctx.fingerprints.get(tenant, previous_id), ctx.fingerprints, tenant)

    def body(self, usage: dict[str, Any]) -> dict[str, Any] | None:
        """The reply's `diagnostics`: null on a first turn, or when nothing diverged."""
        if self.previous_id is None:
            return None
        reason = cache_miss_reason(self.previous, self.fingerprint, usage["cache_read_input_tokens"])
        return {"cache_miss_reason": reason} if reason is not None else None

    def keep(self, message_id: str, usage: dict[str, Any]) -> None:
        """Remember this request's fingerprint, with its prompt's tokens, for the next turn to name."""
        tokens = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        self.store.put(self.tenant, message_id, replace(self.fingerprint, prompt_tokens=tokens))


@dataclass(slots=True)
class MessageShell:
    """What every Message object of one request carries besides its content, stop reason and usage."""

    message_id: str
    model: str
    marks: list[Breakpoint]
    positions: list[int]
    block_size: int
    max_tokens: int  # as the client asked: more than the context left is no error here
    max_model_len: int
    diagnosis: Diagnosis | None = None

    def stop(
        self, finish: str | None, chat_stop: Any, called: bool, chat_usage: dict[str, Any] | None
    ) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence); a reply cut where the context window ends, before its max_tokens, is
        Anthropic's `model_context_window_exceeded`."""
        usage = chat_usage or {}
        total = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        window_full = total >= self.max_model_len and int(usage.get("completion_tokens", 0)) < self.max_tokens
        return stop_reason(finish, chat_stop, called, window_full)

    def keep_prefix(self, kept: KeptPrefix) -> None:
        """The truncate policy dropped turns: a mark past the prefix the prompt sent shares with the whole conversation
        marked text that was dropped (or moved: past it, its position would point into another prompt): not placed."""
        if kept.tokens is not None:
            self.positions = [p if p <= kept.tokens else 0 for p in self.positions]

    def kv_cache(self, report: dict[str, Any]) -> dict[str, Any]:
        """The include_kv_cache report with a `not_placed` entry in `pins` for each mark that pinned nothing because it
        could not be placed in the prompt (kvserve.server.cache_control.breakpoint_positions), in mark order, once
        the report has the placed marks' outcomes (its last one)."""
        pins = report.get("pins")
        placed = [p >= self.block_size for p in self.positions]
        if not isinstance(pins, list) or len(pins) != sum(placed) or all(placed):
            return report
        outcomes = iter(pins)
        entry = {"num_tokens": 0, "outcome": "not_placed", "displaced": 0}
        return report | {"pins": [next(outcomes) if ok else dict(entry) for ok in placed]}

    def usage(self, chat_usage: dict[str, Any] | None) -> dict[str, Any]:
        chat_usage = chat_usage or {}
        prompt = int(chat_usage.get("prompt_tokens", 0))
        cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        split = CacheUsage.of(prompt, cached, self.marks, self.positions, self.block_size)
        return split.body(int(chat_usage.get("completion_tokens", 0)))

    def build(
        self, content: list[dict[str, Any]], stop: tuple[str | None, str | None], usage: dict[str, Any]
    ) -> dict[str, Any]:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }
        if self.diagnosis is not None:
            message["diagnostics"] = self.diagnosis.body(usage)
        return message

    def keep(self, usage: dict[str, Any]) -> None:
        """At the end of the reply: an opted-in request's fingerprint is kept for the next turn."""
        if self.diagnosis is not None:
            self.diagnosis.keep(self.message_id, usage)


def stop_reason(finish: str | None, chat_stop: Any, called: bool, window_full: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for chat's finish_reason and stop_reason (the matched stop string, or the stop
    token's id); `window_full`: the reply ended where the context window does, before max_tokens."""
    if finish == "length":
        return ("model_context_window_exceeded" if window_full else "max_tokens"), None
    if called or finish == "tool_calls":
        return "tool_use", None
    if isinstance(chat_stop, str):
        return "stop_sequence", chat_stop
    return "end_turn", None


def _tool_use(call: dict[str, Any], cut: bool) -> dict[str, Any]:
    """A call as a tool_use block; `cut`: max_tokens ended the reply, so its arguments may stop short (a forced call's
    grammar is cut too): its input is what they say so far (partial_object), as Anthropic's partial block."""
    f = call["function"]
    try:
        arguments = json.loads(f["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = partial_object(f["arguments"]) if cut else None
    if not isinstance(arguments, dict):  # the parsers hand over JSON objects only; never a silent {}
        raise APIError(500, f"tool call {f['name']!r} has arguments that are not a JSON object: {f['arguments']!r}")
    return {"type": "tool_use", "id": call["id"], "name": f["name"], "input": arguments}


def content_blocks(message: dict[str, Any], cut: bool) -> list[dict[str, Any]]:
    """A chat reply's message as content blocks in the order the model wrote them (its `parts`: chat's
    ordered_parts), text and tool_use; `cut`: max_tokens ended it."""
    calls = message.get("tool_calls") or []
    blocks: list[dict[str, Any]] = []
    for part in message["parts"]:
        if isinstance(part, str):
            blocks.append({"type": "text", "text": part})
        else:
            blocks.append(_tool_use(calls[part], cut))
    return blocks


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


async def create_message(ctx: ServerContext, body: MessagesRequest, raw: Request) -> Response:
    unknown = body.unknown_fields()
    if unknown:
        logger.info("ignoring unknown request fields: %s", ", ".join(unknown))
    marks = breakpoints(body)
    tools = chat_tools(body.tools, ctx.settings.ignore_unsupported_tools)
    try:
        request = chat_request(body, body.stream, tools)
        model = ctx.resolve_model(body.model)
        render = ChatRender(
            tools=plan_tools(request, ctx.settings).tools,
            tool_style=ctx.settings.tool_style,
            cache_salt=body.cache_salt,
        )
        parts = [(m.where, chat_messages(body, m)) for m in marks]
        positions = await ctx.preparer.run(breakpoint_positions, ctx.preparer, chat_messages(body), parts, render)
        diagnosis = Diagnosis.of(ctx, body, model)
        shell = MessageShell(
            _new_id("msg"), model, marks, positions, ctx.facts.block_size, body.max_tokens, ctx.max_model_len, diagnosis
        )
        pins = tuple(KVPin(p, TTL_SECONDS[m.ttl]) for m, p in zip(marks, positions) if p >= ctx.facts.block_size)
        # length_wins: a reply cut after a whole call says max_tokens, as Anthropic's (chat's says "tool_calls")
        kept = KeptPrefix()
        reply = await create_chat_completion(
            ctx, request, raw, kv_pins=pins, kept=kept, length_wins=True, ordered_parts=True, fill_context=True
        )
        shell.keep_prefix(kept)
    except (APIError, ValueError) as e:
        raise messages_error(from_exception(e), tools) from None
    headers = kvserve_headers(reply) | tools.headers()
    ignored = ignored_fields(body)
    if ignored:
        headers[IGNORED_FIELDS_HEADER] = ", ".join(ignored)
    if isinstance(reply, StreamingResponse):
        return StreamingResponse(_events(shell, reply.body_iterator), media_type="text/event-stream", headers=headers)
    if not isinstance(reply, JSONResponse):
        return reply  # 499: the client went away
    chat = json.loads(bytes(reply.body))
    choice = chat["choices"][0]
    message = choice["message"]
    content = content_blocks(message, cut=choice["finish_reason"] == "length")
    stop = shell.stop(
        choice["finish_reason"], choice.get("stop_reason"), bool(message.get("tool_calls")), chat.get("usage")
    )
    usage = shell.usage(chat.get("usage"))
    shell.keep(usage)
    message = shell.build(content, stop, usage)
    if "kv_cache" in chat:
        message["kv_cache"] = shell.kv_cache(chat["kv_cache"])
    return JSONResponse(message, headers=headers)


async def count_tokens(ctx: ServerContext, body: CountTokensRequest) -> JSONResponse:
    """The prompt's tokens as POST /v1/messages would count them (input + cache read + cache creation)."""
    breakpoints(body)  # a bad cache_control is the same 400 here
    ctx.resolve_model(body.model)
    tools = chat_tools(body.tools, ctx.settings.ignore_unsupported_tools)
    try:
        request = chat_request(body, False, tools)
        render = ChatRender(tools=plan_tools(request, ctx.settings).tools, tool_style=ctx.settings.tool_style)
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        ids = await ctx.preparer.run(ctx.preparer.tokenize_messages, messages, render)
    except (APIError, ValueError) as e:
        raise messages_error(from_exception(e), tools) from None
    return JSONResponse({"input_tokens": len(ids)}, headers=tools.headers())


# -- the event stream -------------------------------------------------------------------------------------------

_OPENAI_TO_ANTHROPIC_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "not_found_error": "not_found_error",
    "service_unavailable_error": "overloaded_error",
}


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


ANTHROPIC_PING = _event("ping")  # the keepalive of a Messages stream (Anthropic's SDKs skip it, wherever it comes)


class _Blocks:
    """The content blocks of a streamed reply: the one open, and how many there have been."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "text", or the chat call index of the open tool_use block as "call:<i>"

    def start(self, key: str, block: dict[str, Any]) -> list[str]:
        frames = self.stop()
        self.open = key
        frames.append(_event("content_block_start", index=self.count, content_block=block))
        return frames

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [_event("content_block_stop", index=self.count - 1)]


async def _events(shell: MessageShell, body: AsyncIterable[Any]) -> AsyncIterator[str]:
    """The chat stream's chunks as Anthropic's events. The first chunk (after prefill) carries the prompt's usage
    (chat's continuous usage), so message_start has the input and cache counts; message_delta has them all."""
    blocks = _Blocks()
    started = False
    called = False
    finish: str | None = None
    chat_stop: Any = None
    usage: dict[str, Any] | None = None
    kv_cache: dict[str, Any] | None = None  # include_kv_cache: the chat stream's first chunk's, then its last's
    async for chunk in chat_chunks(body):
        if "error" in chunk:
            error = chunk["error"]
            kind = _OPENAI_TO_ANTHROPIC_TYPES.get(error.get("type"), "api_error")
            yield _event("error", error={"type": kind, "message": error.get("message", "")})
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        if "kv_cache" in chunk:
            kv_cache = chunk["kv_cache"]
        if not started:
            started = True
            start = shell.build([], (None, None), shell.usage(usage))
            if "kv_cache" in chunk:
                start["kv_cache"] = chunk["kv_cache"]
            yield _event("message_start", message=start)
            yield _event("ping")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if blocks.open != "text":
                    for frame in blocks.start("text", {"type": "text", "text": ""}):
                        yield frame
                yield _event(
                    "content_block_delta",
                    index=blocks.count,
                    delta={"type": "text_delta", "text": delta["content"]},
                )
            for piece in delta.get("tool_calls") or []:
                called = True
                key = f"call:{piece['index']}"
                f = piece.get("function") or {}
                if blocks.open != key:
                    block = {"type": "tool_use", "id": piece.get("id", ""), "name": f.get("name", ""), "input": {}}
                    for frame in blocks.start(key, block):
                        yield frame
                if f.get("arguments"):
                    yield _event(
                        "content_block_delta",
                        index=blocks.count,
                        delta={"type": "input_json_delta", "partial_json": f["arguments"]},
                    )
            if choice.get("finish_reason"):
                finish, chat_stop = choice["finish_reason"], choice.get("stop_reason")
    if not started:
        yield _event("message_start", message=shell.build([], (None, None), shell.usage(usage)))
    for frame in blocks.stop():
        yield frame
    reason, sequence = shell.stop(finish, chat_stop, called, usage)
    final = shell.usage(usage)
    shell.keep(final)
    extra = {"kv_cache": shell.kv_cache(kv_cache)} if kv_cache is not None else {}  # the last: with the pins
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=final, **extra)
    yield _event("message_stop")
