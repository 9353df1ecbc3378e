"""A serving worker's process life: a bounded drain on SIGTERM, and no life after its parent.

``drain_on_sigterm`` puts itself before the HTTP server's own SIGTERM handler (uvicorn's,
which would otherwise wait for every open stream, however long): at the signal the adapter
stops admitting requests (new ones and ``/readyz`` get a 503 at once, the server still
accepting connections), in-flight requests get up to ``drain_timeout`` seconds, those
still running then are aborted (finish_reason ``abort``, blocks freed), and only then is
the signal handed on, so the server closes with nothing left open.

``exit_with_parent`` ends the process when the process that started it is gone (a
``bentoml serve`` killed with SIGKILL would otherwise leave its worker serving, orphaned).
``stop_parent_on_load_error`` makes a model that cannot be served stop the whole server
(as ``vllm serve`` refuses to start), instead of a server that answers 503 forever.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from .api import EngineAdapter

logger = logging.getLogger(__name__)


def drain_on_sigterm(adapter: EngineAdapter, drain_timeout: float) -> None:
    """Install the bounded drain as the SIGTERM handler (main thread only; call after the server's)."""
    previous = signal.getsignal(signal.SIGTERM)
    state = {"signalled": False}

    def hand_on(sig: int, frame: Any) -> None:
        if callable(previous):
            previous(sig, frame)
        else:  # the default action: end the process as SIGTERM would have
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)

    def drain_then_hand_on(sig: int) -> None:
        try:
            finished = adapter.drain(drain_timeout)
            logger.info("drain %s; stopping the server", "complete" if finished else "timed out: requests aborted")
        except Exception:
            logger.exception("drain failed; stopping the server")
        hand_on(sig, None)

    def on_sigterm(sig: int, frame: Any) -> None:
        if state["signalled"]:  # a second SIGTERM: stop now
            hand_on(sig, frame)
            return
        state["signalled"] = True
        logger.info("SIGTERM: refusing new requests, draining in-flight ones for up to %.1fs", drain_timeout)
        adapter.begin_drain()
        threading.Thread(target=drain_then_hand_on, args=(sig,), name="paged-backend-drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_sigterm)


def exit_with_parent(on_exit: Callable[[], None] | None = None, *, poll_s: float = 1.0) -> threading.Thread:
    """Watch the parent pid; when the parent is gone run ``on_exit`` (briefly) and exit."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.error("parent process %d is gone: exiting", parent)
        try:
            if on_exit is not None:
                on_exit()
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="paged-backend-parent-watch", daemon=True)
    thread.start()
    return thread


def stop_parent_on_load_error(adapter: EngineAdapter) -> threading.Thread:
    """When the adapter's (background) load fails, log why and SIGTERM the parent server process."""

    def watch() -> None:
        try:
            adapter.wait_ready(None)
        except BaseException as exc:
            logger.error("the model cannot be served, stopping the server: %s", exc)
            os.kill(os.getppid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="paged-backend-load-watch", daemon=True)
    thread.start()
    return thread
