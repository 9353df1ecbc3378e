"""The engine loop in a background thread, behind an asyncio API (the adapter API's core).

Callers' coroutines never touch engine state: requests are validated in the caller's
thread (``process_input`` is pure), then handed to the loop thread through a queue;
deltas come back through per-request ``asyncio.Queue``s via ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from paged_backend.config import EngineConfig
from paged_backend.engine import LLMEngine, PreparedRequest
from paged_backend.errors import EngineDeadError, InvalidRequestError
from paged_backend.gc_heap import frozen_heap
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """``async for delta in engine.generate(id, prompt, params)``; ``await engine.abort(id)``."""

    def __init__(self, config: EngineConfig | None = None, **engine_args: Any) -> None:
        self.config = config or EngineConfig(**engine_args)
        self.engine = LLMEngine(self.config)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self._stats: dict = self.engine.get_stats()
        self._thread = threading.Thread(target=self._loop, name="paged-backend-engine", daemon=True)
        self._thread.start()

    # -- adapter API -------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopped.is_set()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def model_info(self) -> dict:
        return self.engine.model_info()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    async def generate(
        self,
        request_id: str | None,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the final one; raises InvalidRequestError before the first."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        request_id = request_id or uuid.uuid4().hex
        prep = self.engine.process_input(request_id, prompt, sampling_params, cache_salt=cache_salt)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
            self._streams[request_id] = stream
        self._send("add", prep)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send("abort", request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are back in the pool when this returns."""
        done = threading.Event()
        self._send("abort", request_id, done)
        await asyncio.get_running_loop().run_in_executor(None, done.wait, 5.0)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; pending requests finish with an error."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.shutdown()  # tensor-parallel workers

    # -- the loop thread ---------------------------------------------------------------

    def _send(self, kind: str, payload: Any, done: threading.Event | None = None) -> None:
        self._inbox.put((kind, payload, done))
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload, done = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                final = self.engine.abort_request(payload)
                stream = self._streams.get(payload)
                if stream is not None and final is not None:
                    stream.put(final)
            if done is not None:
                done.set()

    def _add(self, prep: PreparedRequest) -> None:
        try:
            self.engine.add_prepared(prep)
        except Exception as exc:  # e.g. an id reused between validation and now
            stream = self._streams.get(prep.request_id)
            if stream is not None:
                stream.put(exc)

    def _loop(self) -> None:
        with frozen_heap():  # the loop runs for the engine's life: collections skip the start-up heap
            self._run_loop()

    def _run_loop(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._publish_stats()
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outs = self.engine.step()
                self._publish_stats()  # first: a caller that sees its final output sees its counts
                for out in outs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop died")
            self._dead = exc
            with self._lock:
                streams = list(self._streams.values())
            for s in streams:
                s.put(EngineDeadError(f"the engine loop died: {exc!r}"))
        finally:
            self._stopped.set()
            with self._lock:
                streams = list(self._streams.values())
            for s in streams:
                s.put(EngineDeadError("the engine was shut down"))

    def _publish_stats(self) -> None:
        stats = self.engine.get_stats()
        with self._lock:
            self._stats = stats
