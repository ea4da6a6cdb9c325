"""The engine requests behind one HTTP request: submitting them, merging their outputs, and making sure
that a client who goes away (or an error) aborts them at once, so their KV blocks are freed.

Why here and not in the routes: completions (several prompts, n samples) and chat share all of it, and
the two disconnect paths differ: a streaming response is cancelled by Starlette when the client leaves,
which ends the stream iteration (and so aborts); a non-streaming handler is not, so it races the work
against the connection's `http.disconnect` message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from kvserve.engine.async_engine import ServerShuttingDownError
from kvserve.sampling_params import RequestOutputKind
from kvserve.server.errors import from_exception
from kvserve.server.tracker import DeltaTracker

if TYPE_CHECKING:
    from kvserve.engine.async_engine import RequestStream
    from kvserve.outputs import RequestOutput
    from kvserve.sampling_params import SamplingParams
    from kvserve.server.context import ServerContext

logger = logging.getLogger(__name__)
T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event frame (plain `data:` lines, no comments)."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=False)
    else:
        text = json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


async def sse_with_errors(frames: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass frames through; an error after the stream has started becomes an error frame, then [DONE]
    (also when the server aborts the stream at the end of its shutdown grace period)."""
    try:
        async for frame in frames:
            yield frame
    except Exception as exc:  # noqa: BLE001 -- the status line is gone; the error must travel in-band
        error = from_exception(exc)
        if error.status >= 500 and not isinstance(exc, ServerShuttingDownError):
            logger.error("stream failed: %s", exc)
        yield sse(error.body())
        yield SSE_DONE


SSE_KEEPALIVE = ": keepalive\n\n"  # an SSE comment: every client's parser skips it, every byte counter sees it


async def keepalive(frames: AsyncIterable[Any], interval_s: float, ping: str) -> AsyncIterator[Any]:
    """`frames`, with `ping` sent whenever `interval_s` seconds pass without one (0: never).

    Why: nothing else is sent while a long prompt is computed, and a 25k-token prompt takes minutes on a CPU; clients
    and proxies that drop a connection idle for N seconds then drop the reply the server is about to send. The source
    is never cancelled by a ping (its next frame is awaited as one task across pings); closing this stream (the client
    went away) cancels that task, so the source's own cleanup (aborting its engine requests) runs."""
    if interval_s <= 0:
        async for frame in frames:
            yield frame
        return
    source = aiter(frames)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield ping
                continue
            finished, pending = pending, None
            try:
                frame = finished.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()


async def chat_chunks(body: AsyncIterable[Any]) -> AsyncIterator[dict[str, Any]]:
    """A streamed chat reply's JSON chunks (the SSE frames' data), [DONE] excluded: what the Responses and Messages
    APIs rewrite into their own events."""
    async for frame in body:
        text = frame.decode() if isinstance(frame, bytes) else str(frame)
        for line in text.splitlines():
            if line.startswith("data: ") and line != SSE_DONE.strip():
                yield json.loads(line[len("data: ") :])


def submit(
    ctx: ServerContext,
    request_id: str,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    cache_salt: str | None,
) -> list[RequestStream]:
    """Queue one engine request per prompt, all or none: the whole HTTP request (prompts x n sequences)
    fits in the queue or is refused (503 when full, 400 when it could never fit). The server asks for
    DELTA outputs: each carries only what is new, and a DeltaTracker puts them together."""
    params = params.clone(output_kind=RequestOutputKind.DELTA)
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    return ctx.engine.add_requests(list(zip(ids, prompts)), params, cache_salt)


async def merged(ctx: ServerContext, streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, DELTA output) from all streams as they come, with metrics; ends when all have finished.
    Leaving early aborts every stream that is still running."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        tracker = ctx.metrics.tracker(stream.state.params)
        try:
            async for output in stream:
                tracker.observe(output)
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


async def collect(
    ctx: ServerContext, streams: Sequence[RequestStream], prompts: Sequence[list[int]]
) -> list[DeltaTracker]:
    """Every stream's outputs put together, one tracker per prompt (in prompt order), once all have finished."""
    trackers = [DeltaTracker(ids) for ids in prompts]
    async for index, output in merged(ctx, streams):
        trackers[index].add(output)
    return trackers


async def compile_for(ctx: ServerContext, raw: Request, job: Callable[[Future[T]], T]) -> T:
    """A request's compiles (`job`, given its own future to pass to GrammarCompiler.compile) on the compile pool,
    never the preparation thread, so that prompts and /tokenize never wait behind a compile; what the job returns.
    A client that leaves meanwhile abandons them: the compile it is in is killed and its slot freed
    (ClientDisconnected is raised)."""
    future = ctx.engine.grammar.run_async(job)  # GrammarBusy (a 503) when the compile queue is full
    try:
        return await unless_disconnected(raw, asyncio.wrap_future(future))
    finally:
        future.cancel()  # done already, or abandoned: a running compile sees it and stops


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
