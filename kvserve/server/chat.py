"""POST /v1/chat/completions: messages through the model's chat template, then the same engine path.

Why the history policy: a chat client resends the whole conversation every turn, so prompts grow until
they no longer fit. By default that is a 400 (the client decides what to drop); with
`--chat-history-policy truncate` the server drops the oldest turns after the system prompt until the
conversation fits, and reports how many in the `X-Kvserve-Truncated-Turns` header.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.context import ServerContext
from kvserve.server.errors import bad_request
from kvserve.server.logprobs import chat_logprobs
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
    check_fits,
    fits,
    reject_unsupported,
)
from kvserve.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    final_outputs,
    merged,
    sse,
    sse_with_errors,
    submit,
    unless_disconnected,
)

TRUNCATED_TURNS_HEADER = "X-Kvserve-Truncated-Turns"
_HEAD_ROLES = ("system", "developer")


def split_turns(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """(leading system messages, turns): a turn starts at each user message and runs to the next one."""
    head_len = 0
    while head_len < len(messages) and messages[head_len].get("role") in _HEAD_ROLES:
        head_len += 1
    turns: list[list[dict[str, Any]]] = []
    for m in messages[head_len:]:
        if not turns or (m.get("role") == "user" and turns[-1] and any(x.get("role") == "user" for x in turns[-1])):
            turns.append([m])
        else:
            turns[-1].append(m)
    return messages[:head_len], turns


class _Renderer:
    """Chat messages -> prompt token ids, the way this request asks for it."""

    def __init__(self, ctx: ServerContext, request: ChatCompletionRequest) -> None:
        self._ctx = ctx
        self._request = request

    def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        tok = self._ctx.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=self._request.add_generation_prompt,
                                       chat_template=self._request.chat_template)
        self._ctx.check_prompt_chars(text, param="messages")
        return tok.encode(text)


def render_prompt(
    ctx: ServerContext, request: ChatCompletionRequest, max_tokens: int | None
) -> tuple[list[int], int]:
    """The prompt's token ids and how many old turns were dropped to make it fit (truncate policy)."""
    render = _Renderer(ctx, request)
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    ids = render(messages)
    limit = ctx.max_model_len
    if ctx.settings.chat_history_policy != "truncate" or fits(len(ids), max_tokens, limit):
        return ids, 0
    head, turns = split_turns(messages)
    best: tuple[list[int], int] | None = None
    lo, hi = 1, len(turns) - 1  # turns to drop; the last turn always stays
    while lo <= hi:  # fewer dropped turns never make the prompt shorter, so the first fit is a boundary
        mid = (lo + hi) // 2
        candidate = render(head + [m for turn in turns[mid:] for m in turn])
        if fits(len(candidate), max_tokens, limit):
            best, hi = (candidate, mid), mid - 1
        else:
            lo = mid + 1
    return best if best is not None else (ids, 0)


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest, raw: Request) -> Response:
    model = ctx.resolve_model(request.model)
    reject_unsupported(request, {"tools": request.tools, "functions": request.functions,
                                 "function_call": request.function_call}, max_n=ctx.core.config.max_num_seqs)
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
    ids, dropped = render_prompt(ctx, request, max_tokens)
    ctx.core.validate_prompt(ids)
    check_fits(len(ids), max_tokens, ctx.max_model_len)
    params = build_sampling_params(request, ctx.core.model_config.generation_defaults, max_tokens=max_tokens,
                                   logprobs=(request.top_logprobs or 0) if request.logprobs else None)
    params.validate_against(ctx.core.config.max_logprobs, ctx.core.model_config.vocab_size)
    headers = {TRUNCATED_TURNS_HEADER: str(dropped)} if dropped else None
    chat_id, created = ctx.new_id("chatcmpl"), int(time.time())
    streams = submit(ctx, chat_id, [ids], params, request.cache_salt)
    if request.stream:
        frames = _stream(ctx, request, chat_id, created, model, ids, merged(ctx, streams))
        return StreamingResponse(sse_with_errors(frames), media_type="text/event-stream", headers=headers)
    try:
        (output,) = await unless_disconnected(raw, final_outputs(ctx, streams))
    except ClientDisconnected:
        return Response(status_code=499)
    choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                          logprobs=_logprobs(ctx, request, ids, c, 0, len(c.token_ids)),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in output.outputs]
    body = ChatCompletionResponse(id=chat_id, created=created, model=model, choices=choices, usage=_usage(output))
    return JSONResponse(body.model_dump(), headers=headers)


def _logprobs(
    ctx: ServerContext, request: ChatCompletionRequest, prompt: list[int], c: CompletionOutput, start: int, end: int
) -> ChatChoiceLogprobs | None:
    if not request.logprobs:
        return None
    ids = list(c.token_ids[:end])
    entries = (c.logprobs or [])[start:end]
    content = chat_logprobs(ctx.texts, prompt + ids[:start], ids[start:], entries, request.top_logprobs or 0)
    return ChatChoiceLogprobs(content=content)


def _usage(output: RequestOutput) -> UsageInfo:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens))


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

    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    final: RequestOutput | None = None
    async for _, output in outputs:
        if not sent_chars:
            for c in output.outputs:
                sent_chars[c.index], sent_tokens[c.index] = 0, 0
                yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
        for c in output.outputs:
            if c.index in done:
                continue
            text = c.text[sent_chars[c.index]:]
            n_tokens = len(c.token_ids)
            logprobs = _logprobs(ctx, request, prompt, c, sent_tokens[c.index], n_tokens)
            sent_tokens[c.index] = n_tokens
            if c.finish_reason is not None:
                done.add(c.index)
                delta = DeltaMessage(content=text) if text else DeltaMessage()
                yield chunk([ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
            elif text or (logprobs is not None and logprobs.content):
                sent_chars[c.index] += len(text)
                yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=text), logprobs=logprobs)])
        if output.finished:
            final = output
    if final is not None and request.stream_options is not None and request.stream_options.include_usage:
        yield chunk([], _usage(final))
    yield SSE_DONE
