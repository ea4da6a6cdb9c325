"""The KV inspector's routes: the page (at / and /ui, with its static assets), a JSON snapshot and a live stream.

- GET /v1/kv/snapshot: one snapshot, built on the engine thread between steps (schema: engine/inspector.py and
  docs/UI.md), plus the recent KV events under "events".
- GET /v1/kv/blocks/{id}: one block in full: holders with token ranges, token ids and text (none with
  --ui-redact-text); the page asks for it on a click, so that streamed snapshots carry no token ids.
- GET /v1/kv/stream: Server-Sent Events: `event: snapshot` (the whole snapshot without token ids, at most 10 per
  second and at most ~2% of the engine thread's time, coalesced, and only while a stream is open) and `event: kv`
  (one KV or engine event each). The page reads it with fetch streaming,
  so the API key travels in the Authorization header, never in the URL (EventSource cannot send headers).
Both are read-only and, with --api-key, need the key (the API-key middleware guards every path but the page's).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.inspector import KVSnapshot, block_detail
from kvserve.server.context import ServerContext
from kvserve.server.errors import APIError

STREAM_POLL_S = 0.1  # how often a stream looks for a newer publication (the engine publishes at most this often)
KEEPALIVE_S = 15.0  # an SSE comment after this long without data keeps proxies from closing the stream
UI_ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class _EncodedSnapshot:
    """The SSE frame of the latest snapshot, encoded once for all open streams (a large pool's JSON is megabytes)."""

    seq: int = 0
    frame: str = ""

    def frame_of(self, snapshot: KVSnapshot) -> str:
        if snapshot.seq != self.seq:
            self.frame = _sse("snapshot", {"seq": snapshot.seq, "time": snapshot.taken_at, **snapshot.data})
            self.seq = snapshot.seq
        return self.frame


async def _stream(engine: AsyncLLMEngine, closing: asyncio.Event, encoded: _EncodedSnapshot) -> AsyncIterator[str]:
    """Publications as SSE, each snapshot once and each event once, while the client reads and until the server
    shuts down (`closing`) or the engine stops."""
    last_snapshot, last_event, idle = 0, -1, 0.0
    with engine.kv.watch():
        yield ": kvserve kv stream\n\n"
        while not closing.is_set() and engine.is_running:
            published = engine.kv.published
            sent = False
            for event in published.events:
                if event["seq"] > last_event:
                    last_event = event["seq"]
                    sent = True
                    yield _sse("kv", event)
            snapshot = published.snapshot
            if snapshot is not None and snapshot.seq > last_snapshot:
                last_snapshot = snapshot.seq
                sent = True
                yield encoded.frame_of(snapshot)
            idle = 0.0 if sent else idle + STREAM_POLL_S
            if idle >= KEEPALIVE_S:
                idle = 0.0
                yield ": keepalive\n\n"
            await asyncio.sleep(STREAM_POLL_S)


def kv_data_routes(ctx: ServerContext, closing: asyncio.Event) -> APIRouter:
    """The read-only data routes (behind the API key when one is set)."""
    router = APIRouter()
    include_tokens = not ctx.settings.ui_redact_text
    encoded = _EncodedSnapshot()  # shared by this app's streams, all on its event loop

    @router.get("/v1/kv/snapshot")
    async def snapshot() -> JSONResponse:
        ctx.engine.check_alive()
        data = await asyncio.wrap_future(ctx.engine.call(lambda e: e.kv_snapshot(include_tokens)))
        return JSONResponse({**data, "events": list(ctx.engine.kv.published.events)})

    @router.get("/v1/kv/blocks/{block_id}")
    async def block(block_id: int) -> JSONResponse:
        ctx.engine.check_alive()
        future = ctx.engine.call(lambda e: block_detail(e, block_id, include_tokens))
        try:
            return JSONResponse(await asyncio.wrap_future(future))
        except ValueError as e:
            raise APIError(404, str(e), param="block_id", code="not_found") from None

    @router.get("/v1/kv/stream")
    async def stream() -> StreamingResponse:
        ctx.engine.check_alive()
        return StreamingResponse(_stream(ctx.engine, closing, encoded), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router


def _asset(name: str) -> str:
    return resources.files("kvserve.ui").joinpath(name).read_text(encoding="utf-8")


def ui_routes(ctx: ServerContext) -> APIRouter:
    """The page and its assets (open: the page asks for the key and sends it with each data request)."""
    router = APIRouter()
    auth = "true" if ctx.settings.api_key is not None else "false"

    async def page() -> HTMLResponse:
        html = _asset("index.html").replace("{{REQUIRES_KEY}}", auth)
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    router.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    router.add_api_route("/ui", page, methods=["GET"], include_in_schema=False)

    @router.get("/ui/assets/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        media_type = UI_ASSETS.get(name)
        if media_type is None:
            return APIError(404, f"no UI asset {name!r}", code="not_found").response()
        return Response(_asset(name), media_type=media_type, headers={"Cache-Control": "no-cache"})

    return router
