"""The KV inspector's routes: the page (at / and /ui, with its static assets), a JSON snapshot and a live stream.

- GET /v1/kv/snapshot: one snapshot, built on the engine thread between steps (schema: engine/inspector.py and
  docs/UI.md), plus the recent KV events under "events".
- GET /v1/kv/blocks/{id}: one block in full: holders with token ranges, token ids and text (none with
  --ui-redact-text); the page asks for it on a click, so that streamed snapshots carry no token ids.
- GET /v1/kv/stream: Server-Sent Events: one `event: snapshot` (the whole snapshot without token ids, plus the recent
  events) when it opens, then `event: delta` frames (what changed, plus the new events; server/kv_stream.py), at
  most 10 per second and at most ~2% of the engine thread's time, coalesced, and only while a stream is open; a
  client that falls behind gets a fresh snapshot. The page reads it with fetch streaming,
  so the API key travels in the Authorization header, never in the URL (EventSource cannot send headers).
- GET /v1/kv/replicas: the engines it can show, `[{name, up}]`: "replica-0" for one process, "replica-0" ..
  "replica-{N-1}" with --data-parallel-size N. The three routes above show one of them, `?replica=NAME` (default:
  the first that is up; an unknown name is a 404), and say which in the X-Kvserve-Replica header.
All are read-only and, with --api-key, need the key (the API-key middleware guards every path but the page's).
"""

from __future__ import annotations

import asyncio
import html
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.client import EngineClient
from kvserve.engine.inspected import InspectedEngine, InspectedReplicas
from kvserve.engine.inspector import block_detail
from kvserve.server.context import ServerContext
from kvserve.server.errors import APIError
from kvserve.server.kv_stream import LARGE_POOL, KVStreamHub, off_loop

UI_ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}
REPLICA_HEADER = "X-Kvserve-Replica"  # on every data response: the replica it shows
# One process is the first and only replica, named as the first of N: `?replica=replica-0` works for any N.
SINGLE_REPLICA = "replica-0"


def inspected_engines(engine: EngineClient, include_tokens: bool) -> dict[str, InspectedEngine]:
    """The engines the inspector can show, by name, first the default: one process's engine as SINGLE_REPLICA, or
    each replica of a replica set (`--data-parallel-size N`); none for any other engine client."""
    if isinstance(engine, AsyncLLMEngine):
        engine.kv_publisher.include_tokens = include_tokens
        return {SINGLE_REPLICA: engine}
    if isinstance(engine, InspectedReplicas):
        return engine.kv_views(include_tokens)
    return {}


def kv_data_routes(ctx: ServerContext, engines: Mapping[str, InspectedEngine], closing: asyncio.Event) -> APIRouter:
    """The read-only data routes (behind the API key when one is set) of `engines`, each of which is one engine whose
    pool they show, chosen by `?replica=NAME` (default: the first that is up)."""
    router = APIRouter()
    include_tokens = not ctx.settings.redacts_ui_text
    hubs = {name: KVStreamHub(engine, closing) for name, engine in engines.items()}  # shared by that engine's streams

    def chosen(replica: str | None) -> tuple[str, InspectedEngine]:
        if replica is None:
            replica = next((name for name, engine in engines.items() if engine.is_running), next(iter(engines)))
        elif replica not in engines:
            raise APIError(
                404, f"no replica {replica!r} (GET /v1/kv/replicas lists them)", param="replica", code="not_found"
            )
        engine = engines[replica]
        engine.check_alive()
        return replica, engine

    @router.get("/v1/kv/replicas")
    async def replicas() -> JSONResponse:
        return JSONResponse([{"name": name, "up": engine.is_running} for name, engine in engines.items()])

    @router.get("/v1/kv/snapshot")
    async def snapshot(replica: str | None = None) -> Response:
        name, engine = chosen(replica)
        data = await asyncio.wrap_future(engine.call(lambda e: e.kv_snapshot(include_tokens)))
        body = {**data, "replica": name, "events": list((await engine.kv_publisher.latest()).events)}
        large = len(data["block_states"]) >= LARGE_POOL  # with token ids: megabytes of JSON for a large pool
        return Response(
            await off_loop(large, _json_bytes, body), media_type="application/json", headers={REPLICA_HEADER: name}
        )

    @router.get("/v1/kv/blocks/{block_id}")
    async def block(block_id: int, replica: str | None = None) -> JSONResponse:
        name, engine = chosen(replica)
        future = engine.call(lambda e: block_detail(e, block_id, include_tokens))
        try:
            detail = await asyncio.wrap_future(future)
        except ValueError as e:
            raise APIError(404, str(e), param="block_id", code="not_found") from None
        token_ids = detail["token_ids"]
        detail["text"] = ctx.texts.decode(token_ids) if token_ids else None  # on the loop, not the engine thread
        return JSONResponse(detail, headers={REPLICA_HEADER: name})

    @router.get("/v1/kv/stream")
    async def stream(replica: str | None = None) -> StreamingResponse:
        name, _ = chosen(replica)
        return StreamingResponse(
            hubs[name].stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", REPLICA_HEADER: name},
        )

    return router


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _asset(name: str) -> str:
    return resources.files("kvserve.ui").joinpath(name).read_text(encoding="utf-8")


def model_note(model_name: str) -> str:
    """The playground's line on the loaded model (HTML): its name, and on the default base model, which cannot
    follow a chat (it echoes the system prompt back), the instruct model to serve instead."""
    from kvserve.model.packaged import INSTRUCT_EXTRA, INSTRUCT_MODEL_NAME
    from kvserve.model.source import DEFAULT_MODEL_NAME

    line = f"Model: <code>{html.escape(model_name)}</code>"
    if model_name != DEFAULT_MODEL_NAME:
        return line
    return (
        f"{line}, a base (pretrained) model: it continues text rather than answering a chat. For chat and tools, "
        f"serve the instruct model: <code>pip install -e '.[{INSTRUCT_EXTRA}]' &amp;&amp; kvserve serve --model "
        f"{INSTRUCT_MODEL_NAME} --enable-auto-tool-choice --tool-call-parser hermes</code>"
    )


def ui_routes(ctx: ServerContext) -> APIRouter:
    """The page and its assets (open: the page asks for the key and sends it with each data request)."""
    router = APIRouter()
    auth = "true" if ctx.settings.api_key is not None else "false"
    note = model_note(ctx.model_name)

    async def page() -> HTMLResponse:
        html = _asset("index.html").replace("{{REQUIRES_KEY}}", auth).replace("{{MODEL_NOTE}}", note)
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
