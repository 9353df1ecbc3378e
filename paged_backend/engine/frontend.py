"""What the adapters see of an engine, whichever side of a process boundary steps it.

``EngineFrontEnd`` holds the per-request output streams and the request API (``generate``,
``beam_search``, ``abort``, ``abort_all``, ``has_request``, ``run_blocking``); a subclass
supplies how a validated request reaches the engine loop and how an abort is acknowledged:
``AsyncEngine`` (``async_engine.py``: a loop thread in this process) or ``EngineCoreClient``
(``core_client.py``: an engine core process behind a pipe).

Outputs come back through one slot per request (vLLM's ``RequestOutputCollector``): when
the consumer has not taken the last delta yet, the next one is merged into it, so a slow
consumer (an HTTP writer under load) gets fewer, bigger deltas instead of a growing queue,
and the thread that delivers them wakes each event loop once per step, not once per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from paged_backend.engine.beam_search import BeamState
from paged_backend.engine.request_state import PreparedRequest
from paged_backend.errors import EngineDeadError, InvalidRequestError
from paged_backend.outputs import RequestOutput, merge_delta
from paged_backend.sampling_params import RequestOutputKind, SamplingParams

ABORT_WAIT_S = 5.0  # how long ``abort`` waits for the engine to confirm the blocks are freed


class OutputStream:
    """One request's undelivered output: put by the delivering thread, taken by the consumer.

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
        """Delivering thread. True when the slot was empty: the consumer may be waiting, wake it."""
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


def _wake(streams: list[OutputStream]) -> None:
    """Event loop thread: resume the consumers among ``streams`` that wait for an output."""
    for s in streams:
        w = s.waiter
        if w is not None and not w.done():
            w.set_result(None)


def notify(streams: list[OutputStream]) -> None:
    """Delivering thread: one wake-up call per event loop for all of ``streams``."""
    groups: dict[asyncio.AbstractEventLoop, list[OutputStream]] = {}
    for s in streams:
        groups.setdefault(s.loop, []).append(s)
    for lp, group in groups.items():
        try:
            lp.call_soon_threadsafe(_wake, group)
        except RuntimeError:  # that event loop is closed: nobody is left to wake there
            pass


class EngineFrontEnd:
    """The request API over per-request streams; subclasses connect it to an engine loop.

    Subclasses set ``tokenizer``, ``eos_token_ids`` and ``max_model_len`` and implement
    ``_process_input`` (tokenize + validate, no engine state), ``_submit`` (hand a prepared
    request to the loop), ``_request_abort`` (an event set once the request's blocks are free)
    and ``dead_reason``.
    """

    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    def __init__(self) -> None:
        self._streams: dict[str, OutputStream] = {}
        self._beams: dict[str, list[str]] = {}  # beam searches in flight: their current round's request ids
        self._lock = threading.Lock()
        self._input_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                                 thread_name_prefix="paged-backend-input")

    # -- subclass hooks ----------------------------------------------------------------

    def _process_input(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                       cache_salt: str | None) -> PreparedRequest:
        raise NotImplementedError

    def _submit(self, prep: PreparedRequest) -> None:
        raise NotImplementedError

    def _request_abort(self, request_id: str) -> threading.Event:
        raise NotImplementedError

    @property
    def dead_reason(self) -> str | None:
        raise NotImplementedError

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    # -- delivery (the loop's side) ------------------------------------------------------

    def _deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Put a step's outputs into their streams; one wake-up per event loop."""
        streams = self._streams
        woken = []
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None and stream.put(out):
                woken.append(stream)
        notify(woken)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.put(exc):
            notify([stream])

    def _fail_all(self, exc: BaseException) -> None:
        """Every open stream ends with ``exc`` (after what it has pending)."""
        with self._lock:
            streams = list(self._streams.values())
        notify([s for s in streams if s.put(exc)])

    # -- the request API ---------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is in flight (submitted, its stream not yet closed)."""
        with self._lock:
            return request_id in self._streams or request_id in self._beams

    async def run_blocking(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run CPU-bound input work (tokenizing, chat templates) off the caller's event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._input_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def _prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                       cache_salt: str | None) -> PreparedRequest:
        reason = self.dead_reason
        if reason is not None:
            raise EngineDeadError(reason)
        if isinstance(prompt, str):  # tokenizing a long text must not hold up the caller's event loop
            return await self.run_blocking(self._process_input, request_id, prompt, params, cache_salt)
        return self._process_input(request_id, prompt, params, cache_salt)

    async def generate(
        self,
        request_id: str | None,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the final one; raises InvalidRequestError before the first."""
        request_id = request_id or uuid.uuid4().hex
        prep = await self._prepare(request_id, prompt, sampling_params, cache_salt)
        stream = OutputStream(asyncio.get_running_loop(), prep.params.output_kind is RequestOutputKind.DELTA)
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
            self._streams[request_id] = stream
        finished = False
        try:
            self._submit(prep)
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
                self._request_abort(request_id)
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
        request_id = request_id or uuid.uuid4().hex
        prep = await self._prepare(request_id, prompt, sampling_params, cache_salt)
        with self._lock:
            if request_id in self._streams or request_id in self._beams:
                raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
            self._beams[request_id] = []
        try:
            state = BeamState.start(prompt, prep.prompt_token_ids, prep.params, self.eos_token_ids,
                                    self.max_model_len)
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
            yield state.output(request_id, self.tokenizer)
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
        events = [self._request_abort(rid) for rid in ids]
        loop = asyncio.get_running_loop()
        for done in events:
            await loop.run_in_executor(None, done.wait, ABORT_WAIT_S)

    def abort_all(self, timeout: float = ABORT_WAIT_S) -> int:
        """Abort every request in flight (each ends with finish_reason "abort"); returns how many."""
        with self._lock:
            ids = list(self._streams)
        events = [self._request_abort(rid) for rid in ids]
        deadline = time.monotonic() + timeout
        for done in events:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                break
        return len(ids)
