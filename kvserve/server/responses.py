"""POST /v1/responses: OpenAI's Responses API, as a translation onto the chat path.

Why a translation and not a second engine path: a Responses request is a chat request in other clothes (`input` items
are messages, `instructions` a system message, `text.format` a response_format, function tools the same tools), so
it goes through the one chat handler, whose tool parsing, constraints, prefix caching and errors are tested, and
its reply (or its stream of chunks) is rewritten into Responses objects and typed events:
`response.created`, `response.in_progress`, per output item `response.output_item.added`, for text
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, for a call `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`, then `response.output_item.done`, and `response.completed`, each with its
`sequence_number`.

`store` defaults to true, as OpenAI's does (vLLM's is off unless an environment variable turns it on): clients
written for OpenAI chain turns with `previous_response_id`. Stored responses (the Response object, the conversation
so far and the cache salt, prompt derived) live in this process's memory only, in an LRU of `max_stored_responses`
(256); `GET /v1/responses/{id}` returns one, `DELETE` forgets it, and an evicted or unknown id is a 404 naming it. The
body is typed as strictly as chat's; `cache_salt` is chat's (a chained request without one keeps its chain's) and
`structured_outputs` vLLM's. Fields clients send routinely (`include`, `truncation`, `metadata`, `user`,
`service_tier`, `safety_identifier`, `reasoning`) are accepted; `metadata` is echoed, the rest
change nothing. What kvserve does not have is a 400 naming the field: built-in tools (web search, file search, code
interpreter, computer use, MCP, image generation: left out of the prompt with a warning under
--ignore-unsupported-tools, kvserve.server.api_tools), `background: true`, non-text input parts (images, files,
audio). Errors of the chat path underneath are renamed to the fields this request has (responses_error).

What Codex sends (issue 55, tests/fixtures/agents/codex.json): `store: false` and the whole conversation every turn,
`prompt_cache_key`, its instructions as `developer` messages, `reasoning` and `include`, `client_metadata`, and a
`{"type": "namespace"}` tool, a group of functions: each is offered to the model as `namespace__name` (Codex's own
flat form) and a call of one comes back as `"name"` plus `"namespace"`, the only form Codex dispatches (a flat or
dotted name is "unsupported call" there); a call it sends back with its `namespace` is rendered by that name again.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError

from kvserve.server.api_tools import NAMESPACE_SEPARATOR, ChatTools, unsupported_tool
from kvserve.server.chat import create_chat_completion, kvserve_headers
from kvserve.server.context import ServerContext
from kvserve.server.errors import APIError, bad_request, from_exception
from kvserve.server.protocol import CacheFields, ChatCompletionRequest, FastList
from kvserve.server.response_store import ResponseStore, StoredResponse
from kvserve.server.streaming import chat_chunks, sse

logger = logging.getLogger(__name__)


class ResponsesRequest(CacheFields):
    """The request body, typed as strictly as chat's (`"4"` is no integer, `"yes"` no boolean), with the same cache
    fields (`cache_salt`); unknown fields are logged and ignored (new SDK fields must not break old servers)."""

    model: str | None = None
    input: str | FastList[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: FastList[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    include: FastList[str] | None = None
    truncation: str | None = None
    user: str | None = None
    seed: int | None = None  # kvserve's (as vLLM's): reproducible sampling
    # vLLM's: a constraint of structured output (regex, choice, grammar, json) or its options; with text.format a 400
    structured_outputs: dict[str, Any] | None = None


# -- request: Responses -> chat ---------------------------------------------------------------------------------

_TEXT_PARTS = ("input_text", "output_text", "text")


def _content_text(content: Any, where: str, key: str = "content") -> str:
    """`where.key` (a message's content, a call output's output): a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.{key} must be a string or a list of content parts", param=f"{where}.{key}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}.{key}[{j}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                param=f"{where}.{key}[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    """`item[key]`, which OpenAI types as a string (a call's `arguments` too: JSON text, never an object, which the
    prompt would otherwise get as Python's repr); a 400 naming the field otherwise."""
    value = item.get(key)
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        raise bad_request(f"{where}.{key} must be a string, got {got}", param=f"{where}.{key}")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: text is one user message; messages keep their role (developer is system);
    function_call items become an assistant's tool_calls, function_call_output items tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            content = _content_text(item.get("content"), where)
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            name = _string(item, "name", where)
            namespace = item.get("namespace")
            if namespace is not None:  # a call of a namespace tool's function: its name in the prompt
                name = prompt_name(_string(item, "namespace", where), name)
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": name, "arguments": _string(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            text = _content_text(item.get("output"), where, "output")  # text or text parts, as OpenAI types it
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's item sent back by a client; this model has none to read
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported", param=f"{where}.type")
    return messages


def prompt_name(namespace: str, name: str) -> str:
    """A namespace tool's function as the prompt names it (Codex's flat form, `namespace__name`)."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _function(tool: dict[str, Any], name: str, description: str | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {k: tool[k] for k in ("parameters", "strict") if k in tool}
    text = "\n".join(t for t in (description, tool.get("description")) if isinstance(t, str) and t)
    if text:
        function["description"] = text
    return {"type": "function", "function": {"name": name, **function}}


def chat_tools(tools: list[dict[str, Any]] | None, ignore_unsupported: bool = False) -> ChatTools:
    """Function tools as chat's; a `namespace` tool's functions each as one, named `namespace__name` (its description
    before theirs), so that a call of one is read back as `name` plus `namespace`, as Codex dispatches it; built-in
    tools (web search, file search, ...) a 400, or left out under --ignore-unsupported-tools."""
    if not tools:
        return ChatTools()
    out: list[dict[str, Any]] = []
    origin: list[str] = []
    dropped: list[str] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, _string(tool, "name", where)))
            origin.append(where)
        elif kind == "namespace":
            namespace = _string(tool, "name", where)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad_request(f"{where}.tools must be a list of function tools", param=f"{where}.tools")
            for j, function in enumerate(inner):
                at = f"{where}.tools[{j}]"
                if not isinstance(function, dict) or function.get("type", "function") != "function":
                    raise bad_request(f"{at} must be a function tool", param=f"{at}.type")
                name = prompt_name(namespace, _string(function, "name", at))
                namespaced[name] = (namespace, function["name"])
                out.append(_function(function, name, tool.get("description")))
                origin.append(at)
        else:
            dropped.append(unsupported_tool(where, kind, ignore_unsupported, "only function and namespace tools"))
    names = [t["function"]["name"] for t in out]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None and twice in namespaced:
        raise bad_request(f"tools: two functions are named {twice!r} in the prompt", param="tools")
    return ChatTools(out or None, tuple(origin), tuple(dropped), namespaced)


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        name = choice["name"]
        if isinstance(choice.get("namespace"), str):
            name = prompt_name(choice["namespace"], name)
        return {"type": "function", "function": {"name": name}}
    raise bad_request(
        f"tool_choice {choice!r}: only 'none', 'auto', 'required' or a function are supported", param="tool_choice"
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a type", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name", "output"),
                "schema": fmt.get("schema"),
                "strict": fmt.get("strict"),
            },
        }
    raise bad_request(f"text.format.type {fmt.get('type')!r} is not supported", param="text.format.type")


def chat_request(
    body: ResponsesRequest,
    history: list[dict[str, Any]],
    stream: bool,
    cache_salt: str | None = None,
    tools: ChatTools | None = None,
) -> ChatCompletionRequest:
    """The chat request this Responses request stands for, after `history` (a chain's conversation so far), computed
    under `cache_salt` (the request's own, or its chain's), with `tools` (chat_tools of its tools; default: them)."""
    tools = tools if tools is not None else chat_tools(body.tools)
    if body.background:
        raise bad_request("background mode is not supported by kvserve", param="background")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += history + input_messages(body.input)
    if not messages:
        raise bad_request("input must not be empty", param="input")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools.tools,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "structured_outputs": body.structured_outputs,
        "seed": body.seed,
        "cache_salt": cache_salt,
        "include_kv_cache": body.include_kv_cache,
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:  # a value the Responses fields let through and chat's do not
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        error = bad_request(f"{where}: {first.get('msg', 'invalid')}", param=where or None)
        raise responses_error(error, tools) from None


# Chat's field names as a Responses client knows them (what it sent): the errors of the chat path underneath are
# renamed, in `param` and in the message. Applied in order; the rest of a path is kept.
_RESPONSES_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), name)
    for pattern, name in (
        (r"\bresponse_format\.json_schema\.schema\b", "text.format.schema"),
        (r"\bresponse_format\b", "text.format"),
        (r"\btool_choice\.function\b", "tool_choice"),
        (r"\bmax_(?:completion_)?tokens\b", "max_output_tokens"),
        (r"\bmessages\b", "input"),
        (r"\bprompt\b", "input"),
    )
)


def _responses_names(text: str) -> str:
    for pattern, name in _RESPONSES_NAMES:
        text = pattern.sub(name, text)
    return text


def responses_error(error: APIError, tools: ChatTools) -> APIError:
    """A chat-path error as this request's own: the fields it names are the Responses fields the client sent (a
    tool's, where that tool came from: ChatTools.renamed)."""
    error = tools.renamed(error, "parameters")
    param = _responses_names(error.param) if error.param is not None else None
    return APIError(error.status, _responses_names(error.message), param=param, code=error.code)


# -- reply: chat -> Responses -----------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0)
    prompt = usage.get("prompt_tokens", 0)
    return {
        "input_tokens": prompt,
        # cache_write_tokens: the prompt tokens computed by this request (their full blocks join the prefix cache)
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed", namespace: str | None = None
) -> dict[str, Any]:
    """A function_call output item; a namespace tool's function's call carries its `namespace` (what Codex reads)."""
    item = {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


@dataclass(slots=True)
class ResponseShell:
    """What every Responses object of one request carries besides its output, status and usage, and what storing it
    keeps: the conversation before its output and the cache salt it was computed under."""

    response_id: str
    created_at: int
    model: str
    body: ResponsesRequest
    conversation: list[dict[str, Any]]
    cache_salt: str | None
    tools: ChatTools

    def call(self, item_id: str, call_id: str, prompt_name: str, arguments: str, status: str) -> dict[str, Any]:
        """The output item of a call the model wrote as `prompt_name`."""
        namespace, name = self.tools.call_name(prompt_name)
        return call_item(item_id, call_id, name, arguments, status, namespace)

    def keep(self, store: ResponseStore, final: dict[str, Any]) -> None:
        """Store the finished response (`store: true`, the default), for GET and previous_response_id."""
        if self.body.store:
            conversation = self.conversation + input_messages(final["output"])
            store.put(self.response_id, StoredResponse(final, conversation, self.cache_salt))

    def build(
        self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None, finish: str | None = None
    ) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" and finish == "length" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "text": b.text or {"format": {"type": "text"}},
            "truncation": b.truncation or "disabled",
            "usage": usage,
            "user": b.user,
        }


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


async def create_response(ctx: ServerContext, body: ResponsesRequest, raw: Request) -> Response:
    unknown = body.unknown_fields()
    if unknown:
        logger.info("ignoring unknown request fields: %s", ", ".join(unknown))
    store: ResponseStore = ctx.responses
    previous = store.get(body.previous_response_id) if body.previous_response_id else None
    history = previous.conversation if previous is not None else []
    cache_salt = previous.chained_salt(body.cache_salt) if previous is not None else body.cache_salt
    tools = chat_tools(body.tools, ctx.settings.ignore_unsupported_tools)
    request = chat_request(body, history, body.stream, cache_salt, tools)
    conversation = history + input_messages(body.input)
    model = ctx.resolve_model(body.model)
    shell = ResponseShell(_new_id("resp"), int(time.time()), model, body, conversation, cache_salt, tools)
    try:
        reply = await create_chat_completion(ctx, request, raw, length_wins=True)
    except (APIError, ValueError) as e:
        raise responses_error(from_exception(e), tools) from None
    headers = kvserve_headers(reply) | tools.headers()
    if isinstance(reply, StreamingResponse):
        events = _events(ctx, shell, reply.body_iterator)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    if not isinstance(reply, JSONResponse):
        return reply  # 499: the client went away
    chat = json.loads(bytes(reply.body))
    choice = chat["choices"][0]
    output: list[dict[str, Any]] = []
    message = choice["message"]
    if message.get("content"):
        output.append(message_item(_new_id("msg"), message["content"], _status(choice["finish_reason"])))
    for call in message.get("tool_calls") or []:
        f = call["function"]
        output.append(shell.call(_new_id("fc"), call["id"], f["name"], f["arguments"], "completed"))
    result = shell.build(output, _status(choice["finish_reason"]), _usage(chat.get("usage")), choice["finish_reason"])
    if "kv_cache" in chat:
        result["kv_cache"] = chat["kv_cache"]
    shell.keep(store, result)
    return JSONResponse(result, headers=headers)


def retrieve_response(ctx: ServerContext, response_id: str) -> JSONResponse:
    """GET /v1/responses/{id}: the stored Response object, as it was returned (a 404 if not stored, or evicted)."""
    return JSONResponse(ctx.responses.get(response_id, param=None).response)


def delete_response(ctx: ServerContext, response_id: str) -> JSONResponse:
    """DELETE /v1/responses/{id}: forget it (a later GET or previous_response_id is a 404); OpenAI's reply shape."""
    ctx.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


class _EventWriter:
    """Numbers the events of one stream."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        frame = sse({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return f"event: {kind}\n{frame}"


async def _events(
    ctx: ServerContext,
    shell: ResponseShell,
    body: AsyncIterable[Any],
) -> AsyncIterator[str]:
    w = _EventWriter()
    yield w.event("response.created", response=shell.build([], "in_progress", None))
    yield w.event("response.in_progress", response=shell.build([], "in_progress", None))
    output: list[dict[str, Any]] = []
    text_item: dict[str, Any] | None = None  # the message item being streamed
    text_index = -1
    calls: dict[int, tuple[int, dict[str, Any]]] = {}  # chat call index -> (output index, item)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    kv_cache: dict[str, Any] | None = None  # include_kv_cache: the chat stream's first chunk has it

    def close_text() -> list[str]:
        nonlocal text_item
        if text_item is None:
            return []
        item, text_item = text_item, None
        part = item["content"][0]
        item["status"] = _status(finish)
        ids = {"item_id": item["id"], "output_index": text_index}
        return [
            w.event("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[]),
            w.event("response.content_part.done", **ids, content_index=0, part=part),
            w.event("response.output_item.done", output_index=text_index, item=item),
        ]

    async for chunk in chat_chunks(body):
        if "error" in chunk:
            yield w.event("error", code=chunk["error"].get("code"), message=chunk["error"].get("message"), param=None)
            return
        if chunk.get("usage"):
            usage = _usage(chunk["usage"])
        if "kv_cache" in chunk:
            kv_cache = chunk["kv_cache"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if text_item is None:
                    text_item = message_item(_new_id("msg"), "", "in_progress")
                    text_index = len(output)
                    output.append(text_item)
                    ids = {"item_id": text_item["id"], "output_index": text_index}
                    yield w.event("response.output_item.added", output_index=text_index, item=text_item)
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    yield w.event("response.content_part.added", **ids, content_index=0, part=part)
                text_item["content"][0]["text"] += delta["content"]
                ids = {"item_id": text_item["id"], "output_index": text_index}
                yield w.event("response.output_text.delta", **ids, content_index=0, delta=delta["content"], logprobs=[])
            for piece in delta.get("tool_calls") or []:
                index = piece["index"]
                f = piece.get("function") or {}
                if index not in calls:
                    for frame in close_text():
                        yield frame
                    item = shell.call(_new_id("fc"), piece.get("id", ""), f.get("name", ""), "", "in_progress")
                    calls[index] = (len(output), item)
                    output.append(item)
                    yield w.event("response.output_item.added", output_index=calls[index][0], item=item)
                out_index, item = calls[index]
                if f.get("arguments"):
                    item["arguments"] += f["arguments"]
                    yield w.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=out_index,
                        delta=f["arguments"],
                    )
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    for frame in close_text():
        yield frame
    for out_index, item in calls.values():
        item["status"] = "completed"
        yield w.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=out_index,
            arguments=item["arguments"],
            name=item["name"],
        )
        yield w.event("response.output_item.done", output_index=out_index, item=item)
    status = _status(finish)
    final = shell.build(output, status, usage, finish)
    if kv_cache is not None:
        final["kv_cache"] = kv_cache
    shell.keep(ctx.responses, final)
    # Always response.completed, its response's status saying "incomplete" when max_output_tokens ended it (as vLLM
    # does): the openai SDK's stream helper gives a final response only after that event.
    yield w.event("response.completed", response=final)
