"""POST /v1/completions: prompts as text or token ids (one or many), n samples each, echo and logprobs.

Why echo with max_tokens=0 works the way it does: lm-evaluation-harness scores a continuation by asking
for the prompt's own logprobs (echo=True, logprobs=N, max_tokens=0 or 1). The engine always generates at
least one token, so max_tokens=0 runs one step for the prompt logprobs and drops the token it sampled.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.context import ServerContext
from kvserve.server.errors import bad_request
from kvserve.server.logprobs import completion_logprobs
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from kvserve.server.sampling import (
    build_sampling_params,
    check_fits,
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


@dataclass(slots=True)
class _Prompt:
    text: str  # what echo shows
    token_ids: list[int]


@dataclass(slots=True)
class _Plan:
    """One validated completion request, ready to run and to format."""

    id: str
    model: str
    request: CompletionRequest
    prompts: list[_Prompt]
    max_tokens: int  # as asked; 0 = prompt only
    created: int = field(default_factory=lambda: int(time.time()))  # one value for every chunk of a stream

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.request.n + sample_index


def _prompts(ctx: ServerContext, request: CompletionRequest) -> list[_Prompt]:
    raw = request.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ctx.check_prompt_chars(item)
        ids = ctx.tokenizer.encode(item) if isinstance(item, str) else list(item)
        ctx.core.validate_prompt(ids)  # empty, out-of-vocabulary ids (before decoding them), too long
        text = item if isinstance(item, str) else ctx.tokenizer.decode(ids, request.skip_special_tokens)
        prompts.append(_Prompt(text, ids))
    return prompts


def _plan(ctx: ServerContext, request: CompletionRequest) -> _Plan:
    model = ctx.resolve_model(request.model)
    reject_unsupported(request, {"suffix": request.suffix}, max_n=ctx.core.config.max_num_seqs)
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    prompts = _prompts(ctx, request)
    max_tokens = request.max_tokens if request.max_tokens is not None else ctx.max_model_len
    for p in prompts:
        check_fits(len(p.token_ids), request.max_tokens, ctx.max_model_len)
    return _Plan(ctx.new_id("cmpl"), model, request, prompts, max_tokens)


def _params(ctx: ServerContext, plan: _Plan) -> SamplingParams:
    request = plan.request
    prompt_only = plan.max_tokens == 0
    params = build_sampling_params(
        request, ctx.core.model_config.generation_defaults,
        max_tokens=1 if prompt_only else request.max_tokens,
        logprobs=None if prompt_only else request.logprobs,
        prompt_logprobs=request.logprobs if request.echo else None,
    )
    params.validate_against(ctx.core.config.max_logprobs, ctx.core.model_config.vocab_size)
    return params


async def create_completion(ctx: ServerContext, request: CompletionRequest, raw: Request) -> Response:
    plan = _plan(ctx, request)
    params = _params(ctx, plan)
    streams = submit(ctx, plan.id, [p.token_ids for p in plan.prompts], params, request.cache_salt)
    if request.stream:
        frames = _stream(ctx, plan, merged(ctx, streams))
        return StreamingResponse(sse_with_errors(frames), media_type="text/event-stream")
    try:
        outputs = await unless_disconnected(raw, final_outputs(ctx, streams))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, plan, outputs).model_dump())


# ---- formatting ---------------------------------------------------------------------------------


def _generated(plan: _Plan, c: CompletionOutput) -> tuple[str, list[int]]:
    """The text and tokens the client asked for (none when max_tokens=0)."""
    if plan.max_tokens == 0:
        return "", []
    return c.text, list(c.token_ids)


def _prompt_logprobs(ctx: ServerContext, plan: _Plan, prompt: _Prompt, output: RequestOutput) -> CompletionLogprobs:
    entries = (output.prompt_logprobs or [])[:len(prompt.token_ids)]
    entries = entries + [None] * (len(prompt.token_ids) - len(entries))
    return completion_logprobs(ctx.texts, [], prompt.token_ids, entries, 0, plan.request.skip_special_tokens)


def _token_logprobs(
    ctx: ServerContext, plan: _Plan, prompt: _Prompt, c: CompletionOutput, start: int, end: int, offset: int
) -> CompletionLogprobs:
    """Logprobs of generated tokens start..end, whose text begins at character `offset`."""
    ids = list(c.token_ids[:end])
    entries = (c.logprobs or [])[start:end]
    return completion_logprobs(ctx.texts, prompt.token_ids + ids[:start], ids[start:], entries, offset,
                               plan.request.skip_special_tokens)


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def _finish_reason(plan: _Plan, c: CompletionOutput) -> str | None:
    if c.finish_reason is not None and plan.max_tokens == 0:
        return "length"
    return c.finish_reason


def _usage(plan: _Plan, outputs: list[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in plan.prompts)
    completion_tokens = sum(len(_generated(plan, c)[1]) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _response(ctx: ServerContext, plan: _Plan, outputs: list[RequestOutput]) -> CompletionResponse:
    request = plan.request
    choices = []
    for i, (prompt, output) in enumerate(zip(plan.prompts, outputs)):
        for c in output.outputs:
            text, ids = _generated(plan, c)
            prefix = prompt.text if request.echo else ""
            logprobs = None
            if request.logprobs is not None:
                logprobs = _token_logprobs(ctx, plan, prompt, c, 0, len(ids), len(prompt.text))
                if request.echo:
                    logprobs = _concat(_prompt_logprobs(ctx, plan, prompt, output), logprobs)
            choices.append(CompletionChoice(index=plan.choice_index(i, c.index), text=prefix + text,
                                            logprobs=logprobs, finish_reason=_finish_reason(plan, c),
                                            stop_reason=c.stop_reason))
    choices.sort(key=lambda ch: ch.index)
    return CompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=choices, usage=_usage(plan, outputs))


@dataclass(slots=True)
class _Sent:
    """How much of one choice a stream has sent so far."""

    chars: int = 0
    tokens: int = 0
    started: bool = False
    done: bool = False


async def _stream(
    ctx: ServerContext, plan: _Plan, outputs: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[str]:
    request = plan.request
    sent: dict[int, _Sent] = {}
    finals: dict[int, RequestOutput] = {}
    async for i, output in outputs:
        prompt = plan.prompts[i]
        for c in output.outputs:
            index = plan.choice_index(i, c.index)
            state = sent.setdefault(index, _Sent())
            choice = _delta(ctx, plan, prompt, output, c, state, index)
            if choice is not None:
                yield sse(CompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=[choice]).model_dump(
                    exclude={"usage"}))
        if output.finished:
            finals[i] = output
    if request.stream_options is not None and request.stream_options.include_usage:
        usage = _usage(plan, [finals[i] for i in sorted(finals)])
        yield sse(CompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=[], usage=usage))
    yield SSE_DONE


def _delta(
    ctx: ServerContext, plan: _Plan, prompt: _Prompt, output: RequestOutput, c: CompletionOutput, state: _Sent,
    index: int,
) -> CompletionChoice | None:
    """The next chunk of one choice, or None when there is nothing new to send."""
    if state.done:
        return None
    request = plan.request
    text, ids = _generated(plan, c)
    prefix = ""
    logprobs = CompletionLogprobs() if request.logprobs is not None else None
    if not state.started:
        state.started = True
        if request.echo:
            prefix = prompt.text
            if logprobs is not None:
                logprobs = _prompt_logprobs(ctx, plan, prompt, output)
    new_text = text[state.chars:]
    if logprobs is not None and len(ids) > state.tokens:
        offset = len(prompt.text) + state.chars
        logprobs = _concat(logprobs, _token_logprobs(ctx, plan, prompt, c, state.tokens, len(ids), offset))
    finish = _finish_reason(plan, c)
    state.chars, state.tokens, state.done = len(text), len(ids), finish is not None
    if not (prefix or new_text or finish or (logprobs is not None and logprobs.tokens)):
        return None
    return CompletionChoice(index=index, text=prefix + new_text, logprobs=logprobs, finish_reason=finish,
                            stop_reason=c.stop_reason)
