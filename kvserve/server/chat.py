"""POST /v1/chat/completions: messages through the model's chat template, then the same engine path.

Why the history policy: a chat client resends the whole conversation every turn, so prompts grow until
they no longer fit. By default that is a 400 (the client decides what to drop); with
`--chat-history-policy truncate` the server drops the oldest turns after the system prompt until the
conversation fits, and reports how many in the `X-Kvserve-Truncated-Turns` header.

Tools and output constraints: kvserve.server.tools (what tools and tool_choice render, force and read back) and
kvserve.server.constraints (response_format, structured_outputs, guided_*); both are compiled on the preparation
thread before the request is queued, so a bad schema is a 400 naming its field.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.kv.misses import common_prefix
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import KVPin
from kvserve.server.constraints import Constraint, compile_constraint, request_constraint
from kvserve.server.context import ServerContext
from kvserve.server.errors import bad_request
from kvserve.server.kv_report import check_include_kv_cache, kv_cache_report
from kvserve.server.logprobs import LogprobEntry, chat_logprobs, context_tail
from kvserve.server.prepare import ChatRender
from kvserve.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
)
from kvserve.server.sampling import (
    build_sampling_params,
    check_retention,
    reject_unsupported,
)
from kvserve.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    collect,
    compile_for,
    merged,
    sse,
    sse_with_errors,
    submit,
    unless_disconnected,
)
from kvserve.server.tools import (
    ParsedReply,
    StreamedCalls,
    ToolPlan,
    compile_tools,
    finish_reason,
    ignored_keywords_header,
    parse_reply,
    plan_tools,
)
from kvserve.server.tracker import ChoiceDelta, DeltaTracker
from kvserve.structured.tool_schemas import ForcedGrammar

TRUNCATED_TURNS_HEADER = "X-Kvserve-Truncated-Turns"


@dataclass(slots=True)
class KeptPrefix:
    """Set by create_chat_completion when the truncate policy dropped turns: how many tokens of the whole
    conversation's prompt the prompt it sent still starts with. Marks placed in the whole conversation (the Messages
    API's pins and its usage split) hold only up to there: past it they would point into another prompt."""

    tokens: int | None = None


async def create_chat_completion(
    ctx: ServerContext,
    request: ChatCompletionRequest,
    raw: Request,
    *,
    length_wins: bool = False,
    kv_pins: tuple[KVPin, ...] = (),
    kept: KeptPrefix | None = None,
    ordered_parts: bool = False,
    fill_context: bool = False,
) -> Response:
    """The chat completion, whole or streamed. `length_wins`: a reply cut by max_tokens finishes "length" even after
    complete tool calls (the Responses API's view; chat's own says "tool_calls" there, as vLLM's). `kv_pins`: prompt
    prefixes to pin in the KV cache (the Messages API's cache_control marks), as placed in the whole conversation;
    when the truncate policy drops turns, only those within the prefix the prompt sent still shares with it are
    pinned (`kept` is told that prefix). `ordered_parts`: a whole reply's
    messages also carry `parts` (ParsedReply.parts: its text and calls in the order written, which OpenAI's message
    cannot say), for the Messages API's translation to read; never sent to a chat client. `fill_context` (the
    Messages API; any request under --clamp-max-tokens): max_tokens beyond the context left after the prompt is no
    400, the reply generates until the window is full (the engine bounds every request by max-model-len)."""
    model = ctx.resolve_model(request.model)
    reject_unsupported(
        request, {"functions": request.functions, "function_call": request.function_call}, max_n=ctx.facts.max_num_seqs
    )
    if not request.messages:
        raise bad_request("messages must not be empty", param="messages")
    check_retention(request, ctx.facts)
    check_include_kv_cache(request.include_kv_cache, ctx.settings.kv_cache_report)
    if request.chat_template is not None and not ctx.settings.trust_request_chat_template:
        # A template is a program: even sandboxed, nested loops can hold the event loop for hours.
        raise bad_request(
            "chat_template in a request is refused unless the server runs with --trust-request-chat-template",
            param="chat_template",
        )
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if max_tokens == 0:
        raise bad_request("max_tokens must be at least 1", param="max_tokens")
    tools = plan_tools(request, ctx.settings)
    if length_wins:
        tools = replace(tools, tool_calls_at_length=False)
    constraint = _constraint(request, tools.constraint)
    params = build_sampling_params(
        request,
        ctx.facts.generation_defaults,
        max_tokens=max_tokens,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        structured_outputs=constraint.params if constraint else None,
    )
    if kv_pins:
        params = params.clone(kv_pins=kv_pins)
    if tools.keep_special_tokens:
        params = params.clone(skip_special_tokens=False)
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    render = ChatRender(
        request.add_generation_prompt, request.chat_template, tools.tools, ctx.settings.tool_style, request.cache_salt
    )
    truncate = ctx.settings.chat_history_policy == "truncate"
    try:
        forced = await compile_for(ctx, raw, lambda caller: _compile(ctx, tools, constraint, caller))
    except ClientDisconnected:
        return Response(status_code=499)
    if forced is not None and forced.ignored:  # the grammar that compiled: the schema without what the backend lacks
        params = params.clone(structured_outputs=forced.params)
    fits_with = None if fill_context or ctx.settings.clamp_max_tokens else max_tokens  # None: the prompt alone
    ids, dropped = await ctx.preparer.run(ctx.preparer.chat_prompt, messages, render, params, fits_with, truncate)
    headers = ignored_keywords_header(tools, forced)
    if dropped:
        headers[TRUNCATED_TURNS_HEADER] = str(dropped)
        if kv_pins or kept is not None:  # the marks were placed in the whole conversation: keep what is still there
            whole = await ctx.preparer.run(ctx.preparer.tokenize_messages, messages, render)
            shared = common_prefix(whole, ids)
            if kept is not None:
                kept.tokens = shared
            params = params.clone(kv_pins=tuple(p for p in kv_pins if p.num_tokens <= shared))
    chat_id, created = ctx.new_id("chatcmpl"), int(time.time())
    streams = submit(ctx, chat_id, [ids], params, request.cache_salt)
    if request.stream:
        frames = _stream(ctx, request, tools, chat_id, created, model, ids, merged(ctx, streams))
        return StreamingResponse(sse_with_errors(frames), media_type="text/event-stream", headers=headers)
    try:
        (tracker,) = await unless_disconnected(raw, collect(ctx, streams, [ids]))
    except ClientDisconnected:
        return Response(status_code=499)
    output = tracker.result()
    replies = [parse_reply(tools, c.text, ordered_parts) for c in output.outputs]
    choices = [_choice(ctx, request, tools, ids, c, r) for c, r in zip(output.outputs, replies)]
    body = ChatCompletionResponse(id=chat_id, created=created, model=model, choices=choices, usage=_usage(tracker))
    payload = body.model_dump()
    if ordered_parts:
        for choice, reply in zip(payload["choices"], replies):
            choice["message"]["parts"] = list(reply.parts)
    if request.include_kv_cache:
        payload["kv_cache"] = _kv_cache(ctx, request, tracker)
    return JSONResponse(payload, headers=headers)


def kvserve_headers(reply: Response) -> dict[str, str]:
    """A chat reply's X-Kvserve-* headers (dropped turns, ignored schema keywords): what the Messages and Responses
    APIs, translations onto chat, owe their clients too."""
    return {k: v for k, v in reply.headers.items() if k.lower().startswith("x-kvserve-")}


def _constraint(request: ChatCompletionRequest, forced: Constraint | None) -> Constraint | None:
    """The output constraint: a forced tool call's, else the request's own (response_format, structured_outputs,
    guided_*; checked even when a forced call overrides it, as vLLM lets the call win)."""
    requested = request_constraint(request)
    return forced or requested


def _compile(
    ctx: ServerContext, tools: ToolPlan, constraint: Constraint | None, caller: Future[Any]
) -> ForcedGrammar | None:
    """On a compile thread: a forced call's grammar (what it compiled as) and the request's constraint, so that a bad
    one is a 400 now."""
    forced = compile_tools(ctx.engine.grammar, tools, caller)
    if constraint is not None and constraint is not tools.constraint:
        compile_constraint(ctx.engine.grammar, constraint, caller)
    return forced


def _choice(
    ctx: ServerContext,
    request: ChatCompletionRequest,
    tools: ToolPlan,
    prompt: list[int],
    c: CompletionOutput,
    reply: ParsedReply,
) -> ChatChoice:
    """One whole choice: its text as content, or read by the tool plan into content and calls (`reply`)."""
    message = ChatResponseMessage(content=reply.content, tool_calls=reply.tool_calls or None)
    return ChatChoice(
        index=c.index,
        message=message,
        logprobs=_logprobs(ctx, request, prompt, c.token_ids, 0, c.token_ids, c.logprobs),
        finish_reason=finish_reason(tools, c.finish_reason, bool(reply.tool_calls)),
        stop_reason=c.stop_reason,
    )


def _logprobs(
    ctx: ServerContext,
    request: ChatCompletionRequest,
    prompt: list[int],
    generated: Sequence[int],
    start: int,
    ids: Sequence[int],
    entries: Sequence[LogprobEntry] | None,
) -> ChatChoiceLogprobs | None:
    """Chat logprobs of `ids`, generated from position `start` on (each measured against a few tokens
    before it only)."""
    if not request.logprobs:
        return None
    context = context_tail(prompt, generated, start)
    content = chat_logprobs(ctx.texts, context, ids, list(entries or [])[: len(ids)], request.top_logprobs or 0)
    return ChatChoiceLogprobs(content=content)


def _kv_cache(ctx: ServerContext, request: ChatCompletionRequest, tracker: DeltaTracker) -> dict[str, Any]:
    t = tracker
    return kv_cache_report(
        ctx.texts,
        t.prompt_token_ids,
        t.num_cached_tokens,
        t.num_restored_tokens,
        t.prefix_miss,
        t.pin_outcomes,
        policy=ctx.settings.kv_cache_report,
        salted=request.cache_salt is not None,
    )


def _usage(tracker: DeltaTracker) -> UsageInfo:
    prompt_tokens = len(tracker.prompt_token_ids)
    completion_tokens = tracker.num_generated_tokens
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=tracker.num_cached_tokens, restored_tokens=tracker.num_restored_tokens
        ),
    )


async def _stream(
    ctx: ServerContext,
    request: ChatCompletionRequest,
    tools: ToolPlan,
    chat_id: str,
    created: int,
    model: str,
    prompt: list[int],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    """Role chunks once the prompt is prefilled (the first output), then content deltas (or tool-call pieces),
    the finish reason, the usage chunk if asked for, and [DONE]. With vLLM's `continuous_usage_stats` (and
    `include_usage`) every chunk carries the usage so far: the role chunk's has the prompt's cached tokens already."""
    options = request.stream_options
    continuous = options is not None and options.include_usage and options.continuous_usage_stats

    def chunk(
        choices: list[ChatStreamChoice], usage: UsageInfo | None = None, first: bool = False, last: bool = False
    ) -> str:
        if usage is None and continuous:
            usage = _usage(tracker)
        body = ChatCompletionChunk(id=chat_id, created=created, model=model, choices=choices, usage=usage)
        payload = body.model_dump(exclude=None if usage else {"usage"})
        # known once the prompt is prefilled: with the role chunk; and again, with what became of the pins, at the end
        if (first or last) and request.include_kv_cache:
            payload["kv_cache"] = _kv_cache(ctx, request, tracker)
        return sse(payload)

    tracker = DeltaTracker(prompt)
    calls: dict[int, StreamedCalls] = {}  # per choice, when the reply is read for tool calls
    async for _, output in outputs:
        deltas = tracker.add(output)
        for d in deltas:
            if d.is_first:
                role = DeltaMessage(role="assistant", content="")
                yield chunk([ChatStreamChoice(index=d.index, delta=role)], first=True)
        for d in deltas:
            logprobs = _logprobs(
                ctx, request, prompt, tracker.generated(d.index), d.first_token, d.token_ids, d.logprobs
            )
            if tools.extractor is not None:
                if d.index not in calls:
                    calls[d.index] = StreamedCalls(tools)
                for frame in _tool_chunks(tools, calls[d.index], d, logprobs):
                    yield chunk([frame])
            elif d.finish_reason is not None:
                delta = DeltaMessage(content=d.text) if d.text else DeltaMessage()
                yield chunk(
                    [
                        ChatStreamChoice(
                            index=d.index,
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=d.finish_reason,
                            stop_reason=d.stop_reason,
                        )
                    ]
                )
            elif d.text or (logprobs is not None and logprobs.content):
                yield chunk([ChatStreamChoice(index=d.index, delta=DeltaMessage(content=d.text), logprobs=logprobs)])
    if tracker.finished and request.stream_options is not None and request.stream_options.include_usage:
        yield chunk([], _usage(tracker), last=True)
    yield SSE_DONE


def _tool_chunks(
    tools: ToolPlan, streamed: StreamedCalls, d: ChoiceDelta, logprobs: ChatChoiceLogprobs | None
) -> list[ChatStreamChoice]:
    """A piece of a reply read for tool calls: its content and call pieces, a chunk for each part in the order written
    (the piece's logprobs with the first), then (at the end) the finish reason in a chunk of its own, "tool_calls" when
    it called any."""
    finished = d.finish_reason is not None
    parts = streamed.add(d.text, finished)
    if not parts and logprobs is not None and logprobs.content:
        parts = [("", [])]
    frames = []
    for i, (content, pieces) in enumerate(parts):  # in the order written: a call, then text, are two chunks
        delta = DeltaMessage(content=content or None, tool_calls=pieces or None)
        frames.append(ChatStreamChoice(index=d.index, delta=delta, logprobs=logprobs if i == 0 else None))
    if finished:
        frames.append(
            ChatStreamChoice(
                index=d.index,
                delta=DeltaMessage(),
                finish_reason=finish_reason(tools, d.finish_reason, streamed.has_calls),
                stop_reason=d.stop_reason,
            )
        )
    return frames
