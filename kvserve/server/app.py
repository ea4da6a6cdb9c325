"""The app factory: `build_app(async_engine, settings)` wires the OpenAI-compatible routes to one engine.

Why a factory with the engine injected: everything an app needs is created here and closed over, so
tests can serve a tiny model, or a deliberately failing engine, without flags or global state; and the
app's lifespan owns the engine thread (started on startup, stopped with the remaining requests aborted
on shutdown, after uvicorn's graceful period has let running requests finish).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve import __version__
from kvserve.engine.client import EngineClient
from kvserve.metrics import GrammarCollector, ServerMetrics
from kvserve.server.auth import APIKeyMiddleware, check_api_key
from kvserve.server.body_limit import BodyLimitMiddleware
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.context import ServerContext, ServerSettings
from kvserve.server.errors import APIError, bad_request, install_error_handlers
from kvserve.server.json_limits import JSONLimits
from kvserve.server.kv_inspector import inspected_engines, kv_data_routes, ui_routes
from kvserve.server.logprobs import TokenTexts
from kvserve.server.messages import (
    ANTHROPIC_PING,
    CountTokensRequest,
    MessagesRequest,
    count_tokens,
    create_message,
)
from kvserve.server.prepare import ChatRender, PromptPreparer
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.server.responses import ResponsesRequest, create_response, delete_response, retrieve_response
from kvserve.server.streaming import SSE_KEEPALIVE, keepalive
from kvserve.server.transport import TransportLimits

__all__ = ["ServerSettings", "build_app"]

logger = logging.getLogger(__name__)


def build_app(engine: EngineClient, settings: ServerSettings, transport: TransportLimits | None = None) -> FastAPI:
    """The app serving `engine`; `transport` sets the body read timeout (the same limits go to ServerConfig)."""
    transport = transport or TransportLimits()
    for key in (settings.api_key, settings.admin_api_key):
        if key is not None:
            check_api_key(key)  # here, not when Starlette first builds the middleware stack
    facts = engine.facts
    metrics = ServerMetrics(
        engine.stats,
        {
            "block_size": facts.block_size,
            "num_blocks": facts.num_blocks,
            "kv_cache_dtype": facts.kv_cache_dtype,
            "enable_prefix_caching": facts.enable_prefix_caching,
            "max_model_len": facts.max_model_len,
            "kv_cache_groups": facts.kv_cache_groups,
            "hybrid_kv_cache_manager": facts.hybrid_kv_cache_manager,
            "sliding_window_layers": facts.sliding_window_layers,
            "max_concurrency": facts.max_concurrency,
        },
        model_name=settings.served_model_names[0],
        max_model_len=facts.max_model_len,
        operator=settings.admin_api_key is not None,  # then only the admin key reads /metrics (server/auth.py)
    )
    metrics.registry.register(GrammarCollector(lambda: engine.grammar.num_compiles_in_flight, metrics.model_name))
    for collector in engine.metric_collectors():
        metrics.registry.register(collector)
    # The front end's tokenizer serves the loop (the streams' text, logprob windows); the preparation thread builds
    # its own from a snapshot (prompts, chat templates), so no tokenizer object is used by two threads.
    preparer = PromptPreparer(engine.tokenizer.snapshot(), facts)
    ctx = ServerContext(engine, settings, metrics, facts, preparer, TokenTexts(engine.tokenizer))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # Before serving, not beside it: transformers imported by two threads at once (this one, and the compile
        # thread importing xgrammar for the first grammar request) failed with "cannot import name
        # 'PreTrainedTokenizerBase' from 'transformers'", a 500 on a request that came within the first second.
        try:
            await preparer.run(preparer.warm)
        except Exception as e:  # noqa: BLE001 - a failed warm-up is only a slower first chat request
            logger.warning("could not prepare the chat-template renderer: %s", e)
        try:
            yield
        finally:
            preparer.close()
            await engine.shutdown_async()

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    # The last added runs first: the key is checked before a byte of the body is read, then the body's size,
    # arrival time and JSON shape before FastAPI parses it.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_body_bytes,
        read_timeout_s=transport.timeout_body_read,
        json_limits=JSONLimits.for_context(facts.max_model_len),
    )
    if settings.api_key is not None or settings.admin_api_key is not None:
        app.add_middleware(
            APIKeyMiddleware,
            api_key=settings.api_key,
            admin_key=settings.admin_api_key,
            max_body_bytes=settings.max_request_body_bytes,
        )
    app.include_router(_open_routes(ctx))
    app.include_router(_api_routes(ctx))
    app.state.shutting_down = asyncio.Event()  # set by GracefulServer: the KV inspector's streams end
    inspected = inspected_engines(engine, include_tokens=not settings.redacts_ui_text)  # one, or each replica
    if inspected:
        app.include_router(kv_data_routes(ctx, inspected, app.state.shutting_down))
        if not settings.disable_ui:
            app.include_router(ui_routes(ctx))
    else:
        logger.info(
            "the KV inspector (/, /ui, /v1/kv/*) is not served: %s shows no engine's KV cache", type(engine).__name__
        )
    return app


def _kept_alive(response: Response, interval_s: float, ping: str) -> Response:
    """A streamed reply with a keepalive every `interval_s` seconds it sends nothing (streaming.keepalive), from the
    moment the request is accepted: the outermost API's own (the Messages and Responses APIs wrap chat's stream)."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = keepalive(response.body_iterator, interval_s, ping)
    return response


def _open_routes(ctx: ServerContext) -> APIRouter:
    """Health, version and metrics: never behind the clients' API key (probes and scrapers carry none); /metrics is
    behind the admin key where there is one (server/auth.py)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_running:
            error = ctx.engine.error
            reason = f"the engine loop has failed: {error!r}" if error else "the engine is not running"
            return APIError(503, reason, code="engine_dead").response()
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics")
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    return router


def _api_routes(ctx: ServerContext) -> APIRouter:
    """The OpenAI API, Anthropic's Messages API, and vLLM's /tokenize and /detokenize."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [
            ModelCard(id=name, root=ctx.settings.model_root or name, max_model_len=ctx.max_model_len)
            for name in ctx.settings.served_model_names
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    interval = ctx.settings.stream_keepalive_s

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        ctx.engine.check_alive()
        return _kept_alive(await create_completion(ctx, body, raw), interval, SSE_KEEPALIVE)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        ctx.engine.check_alive()
        return _kept_alive(await create_chat_completion(ctx, body, raw), interval, SSE_KEEPALIVE)

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        ctx.engine.check_alive()
        return _kept_alive(await create_response(ctx, body, raw), interval, SSE_KEEPALIVE)

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        ctx.engine.check_alive()
        return _kept_alive(await create_message(ctx, body, raw), interval, ANTHROPIC_PING)

    @router.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> JSONResponse:
        return await count_tokens(ctx, body)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        return retrieve_response(ctx, response_id)

    @router.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str) -> JSONResponse:
        return delete_response(ctx, response_id)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        ctx.resolve_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        prep = ctx.preparer
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            render = ChatRender(body.add_generation_prompt, tools=body.tools, tool_style=ctx.settings.tool_style)
            ids = await prep.run(prep.tokenize_messages, messages, render)
        else:
            ids = await prep.run(prep.encode, body.prompt or "", body.add_special_tokens)
        strs = await prep.run(prep.token_strs, ids) if body.return_token_strs else None
        return JSONResponse(
            TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs).model_dump()
        )

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        ctx.resolve_model(body.model)
        text = await ctx.preparer.run(ctx.preparer.detokenize, body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return router
