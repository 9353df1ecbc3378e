"""The engine loop in a background thread, behind an asyncio API (the adapter API's core).

Callers' coroutines never touch engine state: requests are validated in the caller's
thread (``process_input`` is pure), then handed to the loop thread through a queue.
Outputs come back through the per-request streams of ``EngineFrontEnd`` (``frontend.py``),
which also holds the request API this class shares with ``EngineCoreClient``
(``core_client.py``, the same engine stepped in a process of its own).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from paged_backend.config import EngineConfig
from paged_backend.engine.frontend import EngineFrontEnd, gather_all
from paged_backend.engine.gc_heap import frozen_heap
from paged_backend.engine.llm_engine import LLMEngine, PreparedRequest
from paged_backend.errors import EngineDeadError
from paged_backend.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "gather_all"]

logger = logging.getLogger(__name__)


class AsyncEngine(EngineFrontEnd):
    """``async for delta in engine.generate(id, prompt, params)``; ``await engine.abort(id)``."""

    def __init__(self, config: EngineConfig | None = None, **engine_args: Any) -> None:
        super().__init__()
        self.config = config or EngineConfig(**engine_args)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.eos_token_ids = self.engine.eos_token_ids
        self.max_model_len = self.engine.max_model_len
        self._inbox: queue.Queue[tuple[str, Any, threading.Event | None]] = queue.Queue()
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
    def dead_reason(self) -> str | None:
        """What ended the loop thread by an error (not by ``shutdown``), or None: nothing will be served again."""
        return None if self._dead is None else f"the engine loop died: {self._dead!r}"

    def check_text_size(self, num_bytes: int, param: str = "prompt") -> None:
        """InvalidRequestError when a text of this many UTF-8 bytes cannot fit the context."""
        self.engine.check_text_size(num_bytes, param)

    def model_info(self) -> dict:
        return self.engine.model_info()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def take_step_tokens(self) -> list[int]:
        """Tokens of each engine step since the last call (vLLM's iteration_tokens_total)."""
        return self.engine.stats.take_step_tokens()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; pending requests finish with an error."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)
        self._input_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()  # tensor-parallel workers

    # -- EngineFrontEnd hooks ------------------------------------------------------------

    def _process_input(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                       cache_salt: str | None) -> PreparedRequest:
        return self.engine.process_input(request_id, prompt, params, cache_salt=cache_salt)

    def _submit(self, prep: PreparedRequest) -> None:
        self._send("add", prep)

    def _request_abort(self, request_id: str) -> threading.Event:
        done = threading.Event()
        self._send("abort", request_id, done)
        return done

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
                    self._deliver([final])
            if done is not None:
                done.set()

    def _add(self, prep: PreparedRequest) -> None:
        try:
            self.engine.add_prepared(prep)
        except Exception as exc:  # e.g. an id reused between validation and now
            self._deliver_error(prep.request_id, exc)

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
                self._deliver(outs)
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop died")
            self._dead = exc
            self._fail_all(EngineDeadError(f"the engine loop died: {exc!r}"))
        finally:
            self._stopped.set()
            self._fail_all(EngineDeadError("the engine was shut down"))

    def _publish_stats(self) -> None:
        stats = self.engine.get_stats()
        with self._lock:
            self._stats = stats
