"""The engine loop in a background thread, behind an asyncio API (the adapter API's core).

Callers' coroutines never touch engine state: requests are validated in the caller's
thread (``process_input`` is pure), then handed to the loop thread through a queue.
Outputs come back through one slot per request (vLLM's ``RequestOutputCollector``): when
the consumer has not taken the last delta yet, the next one is merged into it, so a slow
consumer (an HTTP writer under load) gets fewer, bigger deltas instead of a growing queue,
and the loop thread wakes each event loop once per step, not once per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from paged_backend.config import EngineConfig
from paged_backend.engine.beam_search import BeamState
from paged_backend.engine.gc_heap import frozen_heap
from paged_backend.engine.llm_engine import LLMEngine, PreparedRequest
from paged_backend.errors import EngineDeadError, InvalidRequestError
from paged_backend.outputs import RequestOutput, merge_delta
from paged_backend.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class _Stream:
    """One request's undelivered output: put by the loop thread, taken by the consumer.

    A DELTA request's new delta is merged into the undelivered one (texts, ids, logprobs
    appended; finish, usage and totals from the newer); any other kind's output replaces it
    (each holds everything so far). An error is delivered after the pending output.
    """

    __slots__ = ("loop", "merge", "lock", "pending", "error", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, merge: bool) -> None:
        self.loop = loop
        self.merge = merge
        self.lock = threading.Lock()
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None  # set while the consumer waits (event loop thread only)

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Loop thread. True when the slot was empty: the consumer may be waiting, wake it."""
        with self.lock:
            was_empty = self.pending is None and self.error is None
            if isinstance(item, BaseException):
                if self.error is None:
                    self.error = item
            elif self.pending is None or not self.merge:
                self.pending = item
            else:  # the consumer is behind: one bigger delta (the pending one is ours to extend)
                merge_delta(self.pending, item)
            return was_empty

    def take(self) -> RequestOutput | BaseException | None:
        """Event loop thread: the pending output (or then the error); None when there is nothing yet."""
        with self.lock:
            item = self.pending
            if item is not None:
                self.pending = None
                return item
            return self.error

    async def get(self) -> RequestOutput | BaseException:
        while True:
            item = self.take()
            if item is not None:
                return item
            waiter = self.waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                self.waiter = None


async def gather_all(coros: Sequence[Any]) -> list[Any]:
    """``asyncio.gather`` that cancels and awaits the others when one fails or it is cancelled,
    so no request keeps running (or holds its stream) behind an error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _wake(streams: list[_Stream]) -> None:
    """Event loop thread: resume the consumers among ``streams`` that wait for an output."""
    for s in streams:
        w = s.waiter
        if w is not None and not w.done():
            w.set_result(None)


def _notify(streams: list[_Stream]) -> None:
    """Loop thread: one wake-up call per event loop for all of ``streams``."""
    groups: dict[asyncio.AbstractEventLoop, list[_Stream]] = {}
    for s in streams:
        groups.setdefault(s.loop, []).append(s)
    for lp, group in groups.items():
        try:
            lp.call_soon_threadsafe(_wake, group)
        except RuntimeError:  # that event loop is closed: nobody is left to wake there
            pass


class AsyncEngine:
    """``async for delta in engine.generate(id, prompt, params)``; ``await engine.abort(id)``."""

    def __init__(self, config: EngineConfig | None = None, **engine_args: Any) -> None:
        self.config = config or EngineConfig(**engine_args)
        self.engine = LLMEngine(self.config)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._beams: dict[str, list[str]] = {}  # beam searches in flight: their current round's request ids
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self._stats: dict = self.engine.get_stats()
        self._input_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                                 thread_name_prefix="paged-backend-input")
        self._thread = threading.Thread(target=self._loop, name="paged-backend-engine", daemon=True)
        self._thread.start()

    # -- adapter API -------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopped.is_set()

    @property
    def is_dead(self) -> bool:
        """The loop thread ended by an error (not by ``shutdown``): nothing will be served again."""
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        """What ended the loop thread by an error, or None."""
        return None if self._dead is None else f"the engine loop died: {self._dead!r}"

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is in flight (submitted, its stream not yet closed)."""
        with self._lock:
            return request_id in self._streams or request_id in self._beams

    async def run_blocking(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run CPU-bound input work (tokenizing, chat templates) off the caller's event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._input_pool,
                                                                functools.partial(fn, *args, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def model_info(self) -> dict:
        return self.engine.model_info()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def take_step_tokens(self) -> list[int]:
        """Tokens of each engine step since the last call (vLLM's iteration_tokens_total)."""
        return self.engine.stats.take_step_tokens()

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
        if isinstance(prompt, str):  # tokenizing a long text must not hold up the caller's event loop
            prep = await self.run_blocking(self.engine.process_input, request_id, prompt, sampling_params,
                                           cache_salt=cache_salt)
        else:
            prep = self.engine.process_input(request_id, prompt, sampling_params, cache_salt=cache_salt)
        stream = _Stream(asyncio.get_running_loop(), prep.params.output_kind is RequestOutputKind.DELTA)
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
            self._streams[request_id] = stream
        self._send("add", prep)
        finished = False
        try:
            while True:
                item = await stream.get()
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

    async def beam_search(
        self,
        request_id: str | None,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Beam search (``use_beam_search``): ONE finished output, after the last round (as vLLM's OpenAI
        server answers it, streamed or not). Each round is a one-token request per beam
        (``<request_id>#beam-<round>-<beam>``, ``engine/beam_search.py``), all submitted at once; leaving
        early aborts them. Raises InvalidRequestError before the first output."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        request_id = request_id or uuid.uuid4().hex
        if isinstance(prompt, str):
            prep = await self.run_blocking(self.engine.process_input, request_id, prompt, sampling_params,
                                           cache_salt=cache_salt)
        else:
            prep = self.engine.process_input(request_id, prompt, sampling_params, cache_salt=cache_salt)
        with self._lock:
            if request_id in self._streams or request_id in self._beams:
                raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
            self._beams[request_id] = []
        try:
            state = BeamState.start(prompt, prep.prompt_token_ids, prep.params, self.engine.eos_token_ids,
                                    self.engine.max_model_len)
            one = state.round_params()
            for r in itertools.count():
                if state.done:
                    break
                ids = [f"{request_id}#beam-{r}-{b}" for b in range(len(state.beams))]
                with self._lock:
                    self._beams[request_id] = ids
                outs = await gather_all([self._final(rid, p, one, cache_salt) for rid, p in
                                      zip(ids, state.round_requests(), strict=True)])
                if any(o is None or not o.outputs or o.outputs[0].finish_reason == "abort"
                       or not o.outputs[0].logprobs for o in outs):
                    state.abort()
                else:
                    state.select([o.outputs[0].logprobs[0] for o in outs])
            yield state.output(request_id, self.engine.tokenizer)
        finally:
            with self._lock:
                self._beams.pop(request_id, None)

    async def _final(self, request_id: str, prompt: list[int], params: SamplingParams,
                     cache_salt: str | None) -> RequestOutput | None:
        acc = None
        async for delta in self.generate(request_id, prompt, params, cache_salt=cache_salt):
            acc = merge_delta(acc, delta)
        return acc

    async def abort(self, request_id: str) -> None:
        """Abort a request (a beam search: its current round); its blocks are back in the pool when this returns."""
        with self._lock:
            ids = self._beams.get(request_id) or [request_id]
        events = []
        for rid in ids:
            done = threading.Event()
            self._send("abort", rid, done)
            events.append(done)
        loop = asyncio.get_running_loop()
        for done in events:
            await loop.run_in_executor(None, done.wait, 5.0)

    def abort_all(self, timeout: float = 5.0) -> int:
        """Abort every request in flight (each ends with finish_reason "abort"); returns how many."""
        with self._lock:
            ids = list(self._streams)
        events = []
        for rid in ids:
            done = threading.Event()
            self._send("abort", rid, done)
            events.append(done)
        deadline = time.monotonic() + timeout
        for done in events:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                break
        return len(ids)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; pending requests finish with an error."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)
        self._input_pool.shutdown(wait=False, cancel_futures=True)
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
                if final is not None:
                    self._publish_stats()  # counters current when the abort returns
                stream = self._streams.get(payload)
                if stream is not None and final is not None and stream.put(final):
                    _notify([stream])
            if done is not None:
                done.set()

    def _add(self, prep: PreparedRequest) -> None:
        try:
            self.engine.add_prepared(prep)
        except Exception as exc:  # e.g. an id reused between validation and now
            stream = self._streams.get(prep.request_id)
            if stream is not None and stream.put(exc):
                _notify([stream])

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
                streams = self._streams
                woken = []
                for out in outs:
                    stream = streams.get(out.request_id)
                    if stream is not None and stream.put(out):
                        woken.append(stream)
                _notify(woken)
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop died")
            self._dead = exc
            with self._lock:
                streams = list(self._streams.values())
            _notify([s for s in streams if s.put(EngineDeadError(f"the engine loop died: {exc!r}"))])
        finally:
            self._stopped.set()
            with self._lock:
                streams = list(self._streams.values())
            _notify([s for s in streams if s.put(EngineDeadError("the engine was shut down"))])

    def _publish_stats(self) -> None:
        stats = self.engine.get_stats()
        with self._lock:
            self._stats = stats
