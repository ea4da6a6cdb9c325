"""The app factory: `build_app(async_engine, settings)` wires the OpenAI-compatible routes to one engine.

Why a factory with the engine injected: everything an app needs is created here and closed over, so
tests can serve a tiny model, or a deliberately failing engine, without flags or global state; and the
app's lifespan owns the engine thread (started on startup, stopped with the remaining requests aborted
on shutdown, after uvicorn's graceful period has let running requests finish).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve import __version__
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.metrics import ServerMetrics
from kvserve.server.body_limit import BodyLimitMiddleware
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.context import ServerContext, ServerSettings
from kvserve.server.errors import APIError, bad_request, install_error_handlers
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

if TYPE_CHECKING:
    from kvserve.kv.cache import KVCacheSpec

__all__ = ["ServerSettings", "build_app"]

logger = logging.getLogger(__name__)


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("could not prepare the chat-template renderer: %s", future.exception())


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    core = engine.engine
    metrics = ServerMetrics(engine.stats, {
        "block_size": core.config.block_size,
        "num_blocks": engine.stats().num_blocks,
        "kv_cache_dtype": _kv_dtype_label(core.kv_spec),
        "enable_prefix_caching": core.config.enable_prefix_caching,
        "max_model_len": core.max_model_len,
    })
    ctx = ServerContext(engine, settings, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # In the background once serving: a chat request that comes first simply waits for the import.
        warm = asyncio.get_running_loop().run_in_executor(None, core.tokenizer.prepare_chat_template)
        warm.add_done_callback(_log_failure)
        try:
            yield
        finally:
            await engine.shutdown_async()

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    app.include_router(_open_routes(ctx))
    app.include_router(_api_routes(ctx), dependencies=[Depends(_api_key_check(settings.api_key))])
    return app


def _kv_dtype_label(spec: KVCacheSpec) -> str:
    """The --kv-cache-dtype name of the cache's storage (fp8/int8 specs name their format)."""
    name = getattr(spec, "dtype_name", None)  # KVCacheSpec.dtype_name, where quantized caches exist
    return str(name) if name else str(spec.dtype).removeprefix("torch.")


def _api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency that requires `Authorization: Bearer <api_key>` (constant-time compare)."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Invalid or missing API key: send it as `Authorization: Bearer <key>`.",
                           code="invalid_api_key")

    return check


def _open_routes(ctx: ServerContext) -> APIRouter:
    """Health, version and metrics: never behind the API key (probes and scrapers carry none)."""
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
    """The OpenAI API plus vLLM's /tokenize and /detokenize."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, root=ctx.settings.model_root or name, max_model_len=ctx.max_model_len)
                 for name in ctx.settings.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        ctx.engine.check_alive()
        return await create_completion(ctx, body, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        ctx.engine.check_alive()
        return await create_chat_completion(ctx, body, raw)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        ctx.resolve_model(body.model)
        tok = ctx.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            text = tok.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                           add_generation_prompt=body.add_generation_prompt)
            ctx.check_prompt_chars(text, param="messages")
            ids = tok.encode(text)
        else:
            ctx.check_prompt_chars(body.prompt or "")
            ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        strs = [tok.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                                             token_strs=strs).model_dump())

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        ctx.resolve_model(body.model)
        vocab = ctx.core.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of the vocabulary (0..{vocab - 1})", param="tokens")
        text = ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return router
