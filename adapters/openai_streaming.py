"""The engine's delta streams as the OpenAI handlers consume them, and their SSE events.

A request runs up to its first delta before any response is chosen (a refusal is then an
HTTP error, not a broken stream); work on behalf of a client is cancelled, and so its
requests aborted, when the client goes away; several prompts' streams are interleaved as
their deltas come. ``sse`` / ``TextEvent`` / ``sse_error`` write the ``data:`` events.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic
import pydantic_core
from fastapi import Request

from paged_backend.outputs import RequestOutput, merge_delta

from .adapter_errors import AdapterError
from .openai_errors import error_body

DISCONNECT_POLL_S = 0.5
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- delta streams -----------------------------------------------------------------------

async def first_delta(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Run a request up to its first delta, so a refusal is an HTTP error, not a broken stream."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def chain(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
        if first.finished:
            return
    async for delta in rest:
        yield delta


async def until_disconnect(request: Request, work: asyncio.Future) -> Any:
    """Await ``work``, cancelling it (and so aborting its request) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise AdapterError("The client disconnected.", kind="invalid_request")
    finally:
        if not task.done():  # cancelled (its requests aborted) and awaited: nothing runs on behind us
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def collect(stream: AsyncIterator[RequestOutput], first: RequestOutput | None) -> RequestOutput | None:
    acc = None
    async for delta in chain(first, stream):
        acc = merge_delta(acc, delta)
    return acc


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' deltas as they come, tagged with the prompt index."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for d in s:
                await queue.put((i, d))
        except BaseException as exc:  # forwarded to the consumer
            await queue.put((i, exc))
            return
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- SSE events --------------------------------------------------------------------------

def sse(model: pydantic.BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_unset=True)}\n\n"


class TextEvent:
    """The SSE event of one text chunk, serialized once: per chunk only the text is encoded.

    ``make(text)`` builds the chunk's model; the event is that model's JSON with the text
    put in by the same serializer (``pydantic_core.to_json``), so the bytes equal
    ``sse(make(text))``. Falls back to that when the sentinel is not found exactly once.
    """

    def __init__(self, make: Callable[[str], pydantic.BaseModel]) -> None:
        self.make = make
        sentinel = f"@@text-{uuid.uuid4().hex}@@"
        parts = sse(make(sentinel)).split(f'"{sentinel}"')
        self.parts = (parts[0], parts[1]) if len(parts) == 2 else None

    def __call__(self, text: str) -> str:
        if self.parts is None:
            return sse(self.make(text))
        return self.parts[0] + pydantic_core.to_json(text).decode() + self.parts[1]


def sse_error(err: AdapterError) -> str:
    body = error_body(err.message, err.status, param=err.param, code=err.code)
    return f"data: {pydantic_core.to_json(body).decode()}\n\n"
