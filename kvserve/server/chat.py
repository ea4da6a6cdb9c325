"""POST /v1/chat/completions: messages through the model's chat template, then the same engine path.

Why the history policy: a chat client resends the whole conversation every turn, so prompts grow until
they no longer fit. By default that is a 400 (the client decides what to drop); with
`--chat-history-policy truncate` the server drops the oldest turns after the system prompt until the
conversation fits, and reports how many in the `X-Kvserve-Truncated-Turns` header.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.outputs import RequestOutput
from kvserve.server.context import ServerContext
from kvserve.server.errors import bad_request
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
    reject_unsupported,
)
from kvserve.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    collect,
    merged,
    sse,
    sse_with_errors,
    submit,
    unless_disconnected,
)
from kvserve.server.tracker import DeltaTracker

TRUNCATED_TURNS_HEADER = "X-Kvserve-Truncated-Turns"


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest, raw: Request) -> Response:
    model = ctx.resolve_model(request.model)
    reject_unsupported(request, {"tools": request.tools, "functions": request.functions,
                                 "function_call": request.function_call}, max_n=ctx.facts.max_num_seqs)
    if request.tool_choice not in (None, "none"):
        raise bad_request("tool_choice is not supported by this server", param="tool_choice")
    if request.response_format and request.response_format.get("type", "text") != "text":
        raise bad_request("response_format other than text is not supported by this server",
                          param="response_format")
    if not request.messages:
        raise bad_request("messages must not be empty", param="messages")
    if request.chat_template is not None and not ctx.settings.trust_request_chat_template:
        # A template is a program: even sandboxed, nested loops can hold the event loop for hours.
        raise bad_request("chat_template in a request is refused unless the server runs with "
                          "--trust-request-chat-template", param="chat_template")
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if max_tokens == 0:
        raise bad_request("max_tokens must be at least 1", param="max_tokens")
    params = build_sampling_params(request, ctx.facts.generation_defaults, max_tokens=max_tokens,
                                   logprobs=(request.top_logprobs or 0) if request.logprobs else None)
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    render = ChatRender(request.add_generation_prompt, request.chat_template)
    truncate = ctx.settings.chat_history_policy == "truncate"
    ids, dropped = await ctx.preparer.run(ctx.preparer.chat_prompt, messages, render, params, max_tokens, truncate)
    headers = {TRUNCATED_TURNS_HEADER: str(dropped)} if dropped else None
    chat_id, created = ctx.new_id("chatcmpl"), int(time.time())
    streams = submit(ctx, chat_id, [ids], params, request.cache_salt)
    if request.stream:
        frames = _stream(ctx, request, chat_id, created, model, ids, merged(ctx, streams))
        return StreamingResponse(sse_with_errors(frames), media_type="text/event-stream", headers=headers)
    try:
        (tracker,) = await unless_disconnected(raw, collect(ctx, streams, [ids]))
    except ClientDisconnected:
        return Response(status_code=499)
    output = tracker.result()
    choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                          logprobs=_logprobs(ctx, request, ids, c.token_ids, 0, c.token_ids, c.logprobs),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in output.outputs]
    body = ChatCompletionResponse(id=chat_id, created=created, model=model, choices=choices,
                                  usage=_usage(tracker))
    return JSONResponse(body.model_dump(), headers=headers)


def _logprobs(
    ctx: ServerContext, request: ChatCompletionRequest, prompt: list[int], generated: Sequence[int], start: int,
    ids: Sequence[int], entries: Sequence[LogprobEntry] | None,
) -> ChatChoiceLogprobs | None:
    """Chat logprobs of `ids`, generated from position `start` on (each measured against a few tokens
    before it only)."""
    if not request.logprobs:
        return None
    context = context_tail(prompt, generated, start)
    content = chat_logprobs(ctx.texts, context, ids, list(entries or [])[:len(ids)], request.top_logprobs or 0)
    return ChatChoiceLogprobs(content=content)


def _usage(tracker: DeltaTracker) -> UsageInfo:
    prompt_tokens = len(tracker.prompt_token_ids)
    completion_tokens = tracker.num_generated_tokens
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=tracker.num_cached_tokens))


async def _stream(
    ctx: ServerContext,
    request: ChatCompletionRequest,
    chat_id: str,
    created: int,
    model: str,
    prompt: list[int],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    """Role chunks once the prompt is prefilled (the first output), then content deltas, the finish
    reason, the usage chunk if asked for, and [DONE]."""

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(id=chat_id, created=created, model=model, choices=choices, usage=usage)
        return sse(body.model_dump(exclude=None if usage else {"usage"}))

    tracker = DeltaTracker(prompt)
    async for _, output in outputs:
        deltas = tracker.add(output)
        for d in deltas:
            if d.is_first:
                yield chunk([ChatStreamChoice(index=d.index, delta=DeltaMessage(role="assistant", content=""))])
        for d in deltas:
            logprobs = _logprobs(ctx, request, prompt, tracker.generated(d.index), d.first_token, d.token_ids,
                                 d.logprobs)
            if d.finish_reason is not None:
                delta = DeltaMessage(content=d.text) if d.text else DeltaMessage()
                yield chunk([ChatStreamChoice(index=d.index, delta=delta, logprobs=logprobs,
                                              finish_reason=d.finish_reason, stop_reason=d.stop_reason)])
            elif d.text or (logprobs is not None and logprobs.content):
                yield chunk([ChatStreamChoice(index=d.index, delta=DeltaMessage(content=d.text), logprobs=logprobs)])
    if tracker.finished and request.stream_options is not None and request.stream_options.include_usage:
        yield chunk([], _usage(tracker))
    yield SSE_DONE
