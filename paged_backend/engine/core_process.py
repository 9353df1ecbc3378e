"""The engine core process: ``LLMEngine`` stepped in a process of its own, fed over a pipe.

``EngineCoreClient`` (``core_client.py``) spawns ``run_engine_core`` and talks to it over one
duplex ``multiprocessing`` pipe (pickled messages):

    front end -> core   a list of commands per send (the client's sender thread batches them):
                        ("add", PreparedRequest) | ("abort", request_id, ack) | ("state", ack)
                        | ("shutdown",)
    core -> front end   CoreStarted once (or the start-up exception), then one CoreOutputs per loop
                        iteration that did anything: every request's deltas of that engine step
                        (without the prompt and its token ids, which the front end adds back),
                        the stats snapshot, the step token counts, acknowledgements, refusals

An abort frees the request's blocks before its acknowledgement is sent. The core exits on
"shutdown", or when the front end's end of the pipe closes (the front-end process is gone);
an exception in the loop is reported in a last CoreOutputs (``dead``) before it exits. It
ignores SIGINT and SIGTERM: those reach it with its front end (a terminal's process group,
a server stopping a worker's process tree), which drains its requests first.
"""

from __future__ import annotations

import logging
import pickle
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from paged_backend.config import EngineConfig
from paged_backend.engine.gc_heap import frozen_heap
from paged_backend.engine.llm_engine import LLMEngine, PreparedRequest
from paged_backend.outputs import RequestOutput
from paged_backend.sample.grammar import SerializedGrammar

logger = logging.getLogger(__name__)


@dataclass
class CoreStarted:
    """The core's first message: what the front end needs to validate requests and answer introspection."""

    model_info: dict
    stats: dict


@dataclass
class CoreOutputs:
    """One loop iteration of the core: ``outputs`` of every request for the step (at most one step)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    step_tokens: list[int] = field(default_factory=list)
    acks: list[tuple[int, Any]] = field(default_factory=list)  # (ack id, value) of aborts and state queries
    errors: list[tuple[str, BaseException]] = field(default_factory=list)  # (request id, why it was refused)
    dead: str | None = None  # the loop died: why


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError with its repr (an unpicklable error must not stop the pipe)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(repr(exc))


def run_engine_core(config: EngineConfig, conn: Connection) -> None:
    """Entry point of the spawned core process."""
    # Ctrl-C in a terminal and a server's SIGTERM to its worker's whole process tree (BentoML's circus
    # does that) are the front end's to act on: it drains, then stops the core through the pipe.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s [engine core] %(message)s")
    logging.getLogger("paged_backend").setLevel(logging.INFO)  # its start-up and throughput lines
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        logger.exception("the engine core failed to start")
        conn.send(portable(exc))
        return
    try:
        conn.send(CoreStarted(engine.model_info(), engine.get_stats()))
        with frozen_heap():  # the loop runs for the engine's life: collections skip the start-up heap
            EngineCore(engine, conn).run()
    except (EOFError, OSError):  # the front end is gone
        pass
    finally:
        engine.shutdown()  # tensor-parallel workers


class EngineCore:
    """The core's loop: read commands, step, send the step's outputs."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.pending = CoreOutputs()
        self.stopped = False

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        try:
            while not self.stopped:
                busy = engine.has_unfinished_requests()
                if busy:
                    while conn.poll(0):
                        self._handle(conn.recv())
                else:
                    self._handle(conn.recv())  # idle: wait for a command
                if self.stopped:
                    break
                if engine.has_unfinished_requests():
                    self.pending.outputs += engine.step()
                    self._send()
                elif self.pending.acks or self.pending.errors or self.pending.outputs:
                    self._send()
        except (EOFError, OSError):  # the pipe: the front end is gone
            raise
        except BaseException as exc:  # report, then exit: the front end fails every request
            logger.exception("engine core loop died")
            self.pending.dead = f"the engine core loop died: {exc!r}"
            self._send()

    def _send(self) -> None:
        msg, self.pending = self.pending, CoreOutputs()
        for out in msg.outputs:  # the front end has them (it prepared the request): not pickled every step
            out.prompt, out.prompt_token_ids = None, []
        msg.stats = self.engine.get_stats()  # with the outputs: a caller that sees its end sees its counts
        msg.step_tokens = self.engine.stats.take_step_tokens()
        self.conn.send(msg)

    def _handle(self, commands: list[tuple]) -> None:
        for cmd in commands:
            kind = cmd[0]
            if kind == "add":
                self._add(cmd[1])
            elif kind == "abort":
                final = self.engine.abort_request(cmd[1])  # its blocks are free now
                if final is not None:
                    self.pending.outputs.append(final)
                if cmd[2] is not None:
                    self.pending.acks.append((cmd[2], None))
            elif kind == "state":
                self.pending.acks.append((cmd[1], self.state()))
            elif kind == "shutdown":
                self.stopped = True

    def _add(self, prep: PreparedRequest) -> None:
        try:
            if isinstance(prep.grammar, SerializedGrammar):
                prep.grammar = self.engine.inputs.load_grammar(prep.grammar)
            self.engine.add_prepared(prep)
        except Exception as exc:  # e.g. an id reused between validation and now
            self.pending.errors.append((prep.request_id, portable(exc)))

    def state(self) -> dict:
        """The block pool and queues as they are now (tests and debugging)."""
        engine = self.engine
        return {
            "num_free_blocks": engine.kv.num_free_blocks,
            "num_total_usable": engine.kv.block_pool.num_total_usable,
            "num_running": engine.scheduler.num_running,
            "num_waiting": engine.scheduler.num_waiting,
            "num_unfinished": len(engine.groups),
        }
