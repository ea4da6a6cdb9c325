"""POST /v1/completions: prompts as text or token ids (one or many), n samples each, echo and logprobs.

Why echo with max_tokens=0 works the way it does: lm-evaluation-harness scores a continuation by asking
for the prompt's own logprobs (echo=True, logprobs=N, max_tokens=0 or 1). The engine always generates at
least one token, so max_tokens=0 runs one step for the prompt logprobs and drops the token it sampled.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.constraints import Constraint, compile_constraint, request_constraint
from kvserve.server.context import ServerContext
from kvserve.server.errors import bad_request
from kvserve.server.kv_report import check_include_kv_cache, kv_cache_report
from kvserve.server.logprobs import LogprobEntry, completion_logprobs, context_tail
from kvserve.server.prepare import Prompt
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
    check_num_prompts,
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
from kvserve.server.tracker import ChoiceDelta, DeltaTracker


@dataclass(slots=True)
class _Plan:
    """One validated completion request, ready to run and to format."""

    id: str
    model: str
    request: CompletionRequest
    prompts: list[Prompt]
    params: SamplingParams
    max_tokens: int  # as asked; 0 = prompt only
    created: int = field(default_factory=lambda: int(time.time()))  # one value for every chunk of a stream

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.request.n + sample_index


def _prompt_items(request: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts as a list: one string, one token-id list, or a list of either."""
    raw = request.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    return items


def _params(
    ctx: ServerContext, request: CompletionRequest, max_tokens: int, constraint: Constraint | None
) -> SamplingParams:
    prompt_only = max_tokens == 0
    return build_sampling_params(
        request,
        ctx.facts.generation_defaults,
        max_tokens=1 if prompt_only else request.max_tokens,
        logprobs=None if prompt_only else request.logprobs,
        prompt_logprobs=request.logprobs if request.echo else None,
        structured_outputs=constraint.params if constraint is not None else None,
    )


async def _plan(ctx: ServerContext, request: CompletionRequest, raw: Request) -> _Plan:
    """Cheap checks on the event loop; the constraint on the compile pool; tokenizing and the prompt checks on the
    preparation thread."""
    model = ctx.resolve_model(request.model)
    reject_unsupported(request, {"suffix": request.suffix}, max_n=ctx.facts.max_num_seqs)
    check_num_prompts(request.num_prompts(), ctx.settings.max_prompts_per_request)
    check_retention(request, ctx.facts)
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    check_include_kv_cache(request.include_kv_cache, ctx.settings.kv_cache_report)
    if request.include_kv_cache and request.stream:
        raise bad_request(
            "include_kv_cache is not supported on streamed completions (it is on chat, responses and messages)",
            param="include_kv_cache",
        )
    items = _prompt_items(request)
    max_tokens = request.max_tokens if request.max_tokens is not None else ctx.max_model_len
    constraint = request_constraint(request)
    params = _params(ctx, request, max_tokens, constraint)
    if constraint is not None:
        grammar = ctx.engine.grammar
        await compile_for(ctx, raw, lambda caller: compile_constraint(grammar, constraint, caller))
    prompts = await ctx.preparer.run(
        ctx.preparer.completion_prompts,
        items,
        params,
        None if ctx.settings.clamp_max_tokens else request.max_tokens,  # None: the prompt alone must fit
        request.skip_special_tokens,
    )
    return _Plan(ctx.new_id("cmpl"), model, request, prompts, params, max_tokens)


async def create_completion(ctx: ServerContext, request: CompletionRequest, raw: Request) -> Response:
    try:
        plan = await _plan(ctx, request, raw)
    except ClientDisconnected:
        return Response(status_code=499)
    prompt_ids = [p.token_ids for p in plan.prompts]
    streams = submit(ctx, plan.id, prompt_ids, plan.params, request.cache_salt)
    if request.stream:
        frames = _stream(ctx, plan, merged(ctx, streams))
        return StreamingResponse(sse_with_errors(frames), media_type="text/event-stream")
    try:
        trackers = await unless_disconnected(raw, collect(ctx, streams, prompt_ids))
    except ClientDisconnected:
        return Response(status_code=499)
    body = _response(ctx, plan, [t.result() for t in trackers], trackers).model_dump()
    if request.include_kv_cache:  # one report per prompt, in prompt order
        policy, salted = ctx.settings.kv_cache_report, request.cache_salt is not None
        body["kv_cache"] = [
            kv_cache_report(
                ctx.texts,
                t.prompt_token_ids,
                t.num_cached_tokens,
                t.num_restored_tokens,
                t.prefix_miss,
                policy=policy,
                salted=salted,
            )
            for t in trackers
        ]
    return JSONResponse(body)


# ---- formatting ---------------------------------------------------------------------------------


def _prompt_logprobs(
    ctx: ServerContext, plan: _Plan, prompt: Prompt, entries: Sequence[LogprobEntry | None] | None
) -> CompletionLogprobs:
    entries = list(entries or [])[: len(prompt.token_ids)]
    entries = entries + [None] * (len(prompt.token_ids) - len(entries))
    return completion_logprobs(ctx.texts, [], prompt.token_ids, entries, 0, plan.request.skip_special_tokens)


def _token_logprobs(
    ctx: ServerContext,
    plan: _Plan,
    prompt: Prompt,
    generated: Sequence[int],
    start: int,
    ids: Sequence[int],
    entries: Sequence[LogprobEntry],
    offset: int,
) -> CompletionLogprobs:
    """Logprobs of generated tokens `ids` (from position `start` of `generated`), whose text begins at
    character `offset`; each token's text is measured against the few tokens before it only."""
    context = context_tail(prompt.token_ids, generated, start)
    return completion_logprobs(ctx.texts, context, ids, entries, offset, plan.request.skip_special_tokens)


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def _finish_reason(plan: _Plan, finish_reason: str | None) -> str | None:
    if finish_reason is not None and plan.max_tokens == 0:
        return "length"
    return finish_reason


def _usage(plan: _Plan, trackers: Sequence[DeltaTracker]) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in plan.prompts)
    completion_tokens = 0 if plan.max_tokens == 0 else sum(t.num_generated_tokens for t in trackers)
    cached = sum(t.num_cached_tokens for t in trackers)
    restored = sum(t.num_restored_tokens for t in trackers)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, restored_tokens=restored),
    )


def _choice(
    ctx: ServerContext, plan: _Plan, prompt: Prompt, output: RequestOutput, c: CompletionOutput, index: int
) -> CompletionChoice:
    """One whole choice of a non-streamed response."""
    request = plan.request
    text, ids = ("", []) if plan.max_tokens == 0 else (c.text, c.token_ids)
    logprobs = None
    if request.logprobs is not None:
        logprobs = _token_logprobs(ctx, plan, prompt, ids, 0, ids, (c.logprobs or [])[: len(ids)], len(prompt.text))
        if request.echo:
            logprobs = _concat(_prompt_logprobs(ctx, plan, prompt, output.prompt_logprobs), logprobs)
    prefix = prompt.text if request.echo else ""
    return CompletionChoice(
        index=index,
        text=prefix + text,
        logprobs=logprobs,
        finish_reason=_finish_reason(plan, c.finish_reason),
        stop_reason=c.stop_reason,
    )


def _response(
    ctx: ServerContext, plan: _Plan, outputs: list[RequestOutput], trackers: Sequence[DeltaTracker]
) -> CompletionResponse:
    choices = [
        _choice(ctx, plan, prompt, output, c, plan.choice_index(i, c.index))
        for i, (prompt, output) in enumerate(zip(plan.prompts, outputs))
        for c in output.outputs
    ]
    choices.sort(key=lambda ch: ch.index)
    return CompletionResponse(
        id=plan.id, created=plan.created, model=plan.model, choices=choices, usage=_usage(plan, trackers)
    )


async def _stream(
    ctx: ServerContext, plan: _Plan, outputs: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[str]:
    """One chunk per choice per output that has something new, the usage chunk if asked for, [DONE]."""
    request = plan.request
    trackers = [DeltaTracker(p.token_ids) for p in plan.prompts]
    async for i, output in outputs:
        for delta in trackers[i].add(output):
            choice = _delta_choice(ctx, plan, plan.prompts[i], trackers[i], delta, plan.choice_index(i, delta.index))
            if choice is not None:
                body = CompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=[choice])
                yield sse(body.model_dump(exclude={"usage"}))
    if request.stream_options is not None and request.stream_options.include_usage:
        usage = _usage(plan, trackers)
        yield sse(CompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=[], usage=usage))
    yield SSE_DONE


def _delta_choice(
    ctx: ServerContext, plan: _Plan, prompt: Prompt, tracker: DeltaTracker, delta: ChoiceDelta, index: int
) -> CompletionChoice | None:
    """The chunk for one piece of one choice (the echoed prompt before its first), or None when empty."""
    request = plan.request
    text, ids = ("", []) if plan.max_tokens == 0 else (delta.text, delta.token_ids)
    prefix = ""
    logprobs = CompletionLogprobs() if request.logprobs is not None else None
    if delta.is_first and request.echo:
        prefix = prompt.text
        if logprobs is not None:
            logprobs = _prompt_logprobs(ctx, plan, prompt, tracker.prompt_logprobs)
    if logprobs is not None and ids:
        offset = len(prompt.text) + delta.first_char
        logprobs = _concat(
            logprobs,
            _token_logprobs(
                ctx, plan, prompt, tracker.generated(delta.index), delta.first_token, ids, delta.logprobs or [], offset
            ),
        )
    finish = _finish_reason(plan, delta.finish_reason)
    if not (prefix or text or finish or (logprobs is not None and logprobs.tokens)):
        return None
    return CompletionChoice(
        index=index, text=prefix + text, logprobs=logprobs, finish_reason=finish, stop_reason=delta.stop_reason
    )
