"""The engine core process: ``LLMEngine`` stepped in a process of its own, serving one or several front ends.

Two ways to reach it (``EngineCoreClient``, ``core_client.py``):

- private (``engine_core_process``): the front end spawns ``run_engine_core`` (``multiprocessing``) and
  talks to it over one duplex pipe; the core serves that front end alone and exits with it.
- shared (``engine_core_shared``): the first front end of a configuration starts ``serve_engine_core``
  (``python -m paged_backend.engine.core_process``, the spec on stdin) and every front end of that
  configuration (itself included: BentoML workers, Triton model instances) attaches to its Unix socket
  (a ``multiprocessing`` Listener, an authentication key shared through the run directory). The core
  exits when its last front end detaches (``core_client.py`` has the run directory and its lock).

Each connection is one client with an id; the core keys its requests ``"<client id>:<request id>"`` (two
front ends may use the same request id) and sends each client its own requests' outputs. Messages:

    front end -> core   a list of commands per send (the client's sender thread batches them):
                        ("add", PreparedRequest) | ("abort", request_id, ack) | ("state", ack)
                        | ("shutdown", ack)   (private: stop; shared: detach this client)
    core -> front end   CoreStarted once (or the start-up exception), then one CoreOutputs per loop
                        iteration that did anything: the client's requests' deltas of that engine step
                        (without the prompt and its token ids, which the front end adds back; a
                        plain delta as a tuple of builtins: ``pack_output``), the stats snapshot, the step token counts, acknowledgements, refusals

An abort frees the request's blocks before its acknowledgement is sent. A client whose connection
closes (its process is gone) or that detaches has every request it still had aborted at once, blocks
freed. An exception in the loop is reported to every client in a last CoreOutputs (``dead``) before the
core exits. It ignores SIGINT and SIGTERM: those reach it with its front end (a terminal's process group,
a server stopping a worker's process tree), which drains its requests first.
"""

from __future__ import annotations

import faulthandler
import fcntl
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from paged_backend.config import EngineConfig
from paged_backend.engine.gc_heap import frozen_heap
from paged_backend.engine.llm_engine import LLMEngine, PreparedRequest
from paged_backend.outputs import CompletionOutput, RequestOutput, Usage
from paged_backend.sample.grammar import SerializedGrammar

logger = logging.getLogger(__name__)

EXIT_RETRY_S = 0.05  # shared core without clients: how often it retries the run directory's lock to exit
# a shared core's front end whose messages wait this long in a send (it stopped reading) is dropped
STALL_ENV = "PAGED_BACKEND_FRONT_END_STALL_S"
DEFAULT_STALL_S = 60.0
# a loop iteration with requests to serve that lasts this long (a step that never returns, a send that never
# ends; a quarter of it, up to a second, less is enough) has every thread's stack written to the core's
# stderr, once per stall; 0: never
STALL_DUMP_ENV = "PAGED_BACKEND_CORE_STALL_DUMP_S"
DEFAULT_STALL_DUMP_S = 120.0


@dataclass
class CoreStarted:
    """The core's first message to a client: what the front end needs to validate requests and answer
    introspection, and who it is to the core."""

    model_info: dict
    stats: dict
    pid: int = 0
    client_id: int = 0


@dataclass
class CoreOutputs:
    """One loop iteration of the core for one client: ``outputs`` of its requests for the step (at most one)."""

    outputs: list[WireOutput] = field(default_factory=list)  # in step order (pack_output)
    stats: dict = field(default_factory=dict)
    step_tokens: list[int] = field(default_factory=list)
    acks: list[tuple[int, Any]] = field(default_factory=list)  # (ack id, value) of aborts and state queries
    errors: list[tuple[str, BaseException]] = field(default_factory=list)  # (request id, why it was refused)
    dead: str | None = None  # the loop died: why


# A step's plain delta (one sequence, no logprobs, not finished) crosses the pipe as a tuple of builtins:
# (request id, index, text, token ids, num output tokens, prompt tokens, completion tokens, cached tokens,
# step times). At 256 streams a step's 256 dataclass deltas take milliseconds to pickle and as long again to
# unpickle; the tuples take a twentieth of that. Any other output crosses as it is.
WireOutput = RequestOutput | tuple


def pack_output(out: RequestOutput) -> WireOutput:
    """``out`` as it crosses the pipe: a plain delta as a tuple (``unpack_output`` rebuilds it), else itself.
    The prompt and its token ids are left out (the front end adds them back)."""
    outs = out.outputs
    if (out.finished or len(outs) != 1 or out.prompt_logprobs is not None or out.metrics is not None
            or out.prompt_logprob_ranks is not None):
        return out
    c = outs[0]
    if c.logprobs is not None or c.finish_reason is not None or c.stop_reason is not None \
            or c.cumulative_logprob is not None:
        return out
    u = out.usage
    return (out.request_id, c.index, c.text, c.token_ids, c.num_output_tokens, u.prompt_tokens,
            u.completion_tokens, u.cached_tokens, out.step_times)


def unpack_output(item: WireOutput) -> RequestOutput:
    """A ``pack_output`` result as the ``RequestOutput`` it was (prompt None, prompt token ids [])."""
    if not isinstance(item, tuple):
        return item
    rid, index, text, token_ids, num_output_tokens, prompt_tokens, completion_tokens, cached_tokens, times = item
    # positional (every delta of every step): CompletionOutput(index, text, token_ids, logprobs, finish_reason,
    # stop_reason, cumulative_logprob, num_output_tokens), RequestOutput(.., usage, prompt_logprobs, step_times)
    return RequestOutput(rid, None, [], [CompletionOutput(index, text, token_ids, None, None, None, None,
                                                          num_output_tokens)],
                         False, Usage(prompt_tokens, completion_tokens, cached_tokens), None, times)


def merge_outputs(into: CoreOutputs, later: CoreOutputs) -> None:
    """``later`` appended to ``into`` (not sent yet): deltas, step tokens, acks and errors in order, the
    later stats."""
    into.outputs += later.outputs
    into.step_tokens += later.step_tokens
    into.acks += later.acks
    into.errors += later.errors
    into.stats = later.stats or into.stats
    into.dead = later.dead or into.dead


class ClientWriter:
    """A shared core's sends to one front end, on a thread of its own: a front end that stops reading (a
    stopped process: its socket buffer fills) then blocks only this thread. The core's loop queues each
    message (``put``, merged into the one still queued while a send is under way) and keeps stepping for
    the others; it drops the front end once a send has waited ``stall_s`` (``stalled``)."""

    def __init__(self, conn: Connection, stall_s: float) -> None:
        self.conn = conn
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._queued: CoreOutputs | None = None
        self._wake = threading.Event()
        self._closing = False
        self.sending_since: float | None = None  # monotonic start of the send under way
        self.broken = False  # a send failed: the front end is gone
        self._thread = threading.Thread(target=self._loop, name="paged-backend-core-send", daemon=True)
        self._thread.start()

    def put(self, msg: CoreOutputs) -> None:
        with self._lock:
            if self._queued is None:
                self._queued = msg
            else:
                merge_outputs(self._queued, msg)
        self._wake.set()

    def stalled(self, now: float) -> bool:
        since = self.sending_since
        return since is not None and now - since > self.stall_s

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                msg, self._queued = self._queued, None
            if msg is not None:
                self.sending_since = time.monotonic()
                try:
                    self.conn.send(msg)
                except (OSError, ValueError):
                    self.broken = True
                    return
                self.sending_since = None
            if self._closing and self._queued is None:
                return

    def close(self, flush_s: float) -> None:
        """Send what is queued (up to ``flush_s``; a stalled front end gets nothing more), then shut the
        socket down, which also ends a send blocked on it."""
        self._closing = True
        self._wake.set()
        self._thread.join(flush_s)
        try:  # a dup of the descriptor: shutting it down acts on the socket the blocked send writes to
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(1.0)


@dataclass(eq=False)
class CoreClient:
    """The core's side of one front end: its connection, its requests (core ids), what it is owed, and (a
    shared core's) the thread that sends to it."""

    cid: int
    conn: Connection
    requests: set[str] = field(default_factory=set)
    pending: CoreOutputs = field(default_factory=CoreOutputs)
    writer: ClientWriter | None = None

    def send(self, msg: CoreOutputs) -> None:
        """To the front end: queued on its writer (shared core), else sent now (raises when it is gone)."""
        if self.writer is None:
            self.conn.send(msg)
        elif self.writer.broken:
            raise BrokenPipeError("the front end's connection broke")
        else:
            self.writer.put(msg)


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError with its repr (an unpicklable error must not stop the pipe)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(repr(exc))


def _core_process_setup() -> None:
    # Ctrl-C in a terminal and a server's SIGTERM to its worker's whole process tree (BentoML's circus
    # does that) are the front ends' to act on: they drain, then detach or stop the core.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s [engine core] %(message)s")
    logging.getLogger("paged_backend").setLevel(logging.INFO)  # its start-up and throughput lines


def run_engine_core(config: EngineConfig, conn: Connection) -> None:
    """Entry point of a private core process (spawned by its one front end, fed over ``conn``)."""
    _core_process_setup()
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        logger.exception("the engine core failed to start")
        conn.send(portable(exc))
        return
    try:
        core = EngineCore(engine)
        core.adopt(conn)
        with frozen_heap():  # the loop runs for the engine's life: collections skip the start-up heap
            core.run()
    finally:
        engine.shutdown()  # tensor-parallel workers


def serve_engine_core(config: EngineConfig, address: str, authkey: bytes, lock_path: str) -> None:
    """Entry point of a shared core: listen on ``address`` (a Unix socket) before loading the model, serve
    every front end that attaches, exit once the last one has gone (under the run directory's lock, so a
    front end attaching then starts a new core instead of reaching a closing one)."""
    _core_process_setup()
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    acceptor = Acceptor(listener)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        logger.exception("the engine core failed to start")
        acceptor.close()
        for conn in acceptor.take():  # the front end that started it waits for this answer
            conn.send(portable(exc))
        return
    try:
        core = EngineCore(engine, acceptor=acceptor, lock_path=lock_path)
        logger.info("engine core %d serving front ends at %s", os.getpid(), address)
        with frozen_heap():
            core.run()
    finally:
        acceptor.close()
        engine.shutdown()


class Acceptor:
    """Accepts front ends' connections on a thread; the core's loop adopts them (``take``), woken through a pipe."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.closed = False
        self.accepted: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        threading.Thread(target=self._accept_loop, name="paged-backend-core-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn = self.listener.accept()
            except Exception as exc:  # closed (the core is exiting), or a peer that failed the handshake
                if not self.closed:
                    logger.warning("refused a connection to the engine core: %r", exc)
                    time.sleep(0.01)  # not a busy loop when accepting itself fails (out of descriptors)
                continue
            self.accepted.put(conn)
            os.write(self.wake_w, b"\0")

    def close(self) -> None:
        """Stop listening (the socket file goes)."""
        self.closed = True
        self.listener.close()

    def take(self) -> list[Connection]:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self.accepted.get_nowait())
            except queue.Empty:
                return out


class EngineCore:
    """The core's loop: read every client's commands, step, send each client its part of the step."""

    def __init__(self, engine: LLMEngine, *, acceptor: Acceptor | None = None, lock_path: str | None = None) -> None:
        self.engine = engine
        self.acceptor = acceptor
        self.lock_path = lock_path
        self.clients: dict[int, CoreClient] = {}
        self._by_conn: dict[Connection, CoreClient] = {}
        self._ids = itertools.count()
        self._changed = False  # a front end attached or left, a request was aborted: every client gets the stats
        self.stopped = False
        self.stall_s = float(os.environ.get(STALL_ENV, DEFAULT_STALL_S))
        self.stall_dump_s = float(os.environ.get(STALL_DUMP_ENV, DEFAULT_STALL_DUMP_S))
        self._armed_at: float | None = None  # when the stall dump was last armed (None: disarmed)

    def adopt(self, conn: Connection) -> None:
        """A new front end: tell it who it is and what the engine is; from now on its commands are read."""
        client = CoreClient(next(self._ids), conn)
        info = {**self.engine.model_info(), "engine_core_pid": os.getpid()}
        try:
            conn.send(CoreStarted(info, self._stats(client.cid), os.getpid(), client.cid))
        except OSError:  # gone already
            conn.close()
            return
        self.clients[client.cid] = client
        self._by_conn[conn] = client
        self._changed = True
        if self.acceptor is not None:  # one front end that stops reading must not hold up the others
            client.writer = ClientWriter(conn, self.stall_s)
            logger.info("front end %d attached (%d attached)", client.cid, len(self.clients))

    def run(self) -> None:
        engine = self.engine
        try:
            while not self.stopped:
                if not self.clients and not self._wait_for_clients():
                    break
                busy = engine.has_unfinished_requests()
                self._watch(busy)
                waitables: list[Any] = list(self._by_conn)
                if self.acceptor is not None:
                    waitables.append(self.acceptor.wake_r)
                for ready in wait(waitables, 0 if busy else None):
                    if isinstance(ready, int):
                        for conn in self.acceptor.take():  # type: ignore[union-attr]
                            self.adopt(conn)
                    elif (client := self._by_conn.get(ready)) is not None:
                        self._read(client)
                if self.stopped:
                    break
                if engine.has_unfinished_requests():
                    if not busy:  # requests that just came: this iteration is watched too
                        self._watch(True)
                    self._route(engine.step())
                    self._send(everyone=True)
                else:
                    self._send(everyone=self._changed)
                if self.acceptor is not None:
                    self._drop_stalled()
        except BaseException as exc:  # report, then exit: the front ends fail every request
            logger.exception("engine core loop died")
            for client in list(self.clients.values()):
                try:
                    client.send(CoreOutputs(outputs=client.pending.outputs, dead=f"the engine core loop died: {exc!r}"))
                except (OSError, ValueError):
                    pass
                if client.writer is not None:
                    client.writer.close(flush_s=1.0)
        self._watch(False)

    def _watch(self, busy: bool) -> None:
        """Keep the stall dump armed while there are requests to serve (re-armed at most every quarter of its
        limit, up to a second: re-arming costs a thread start), disarmed while the loop only waits for commands."""
        if self.stall_dump_s <= 0:
            return
        if busy:
            now = time.monotonic()
            if self._armed_at is None or now - self._armed_at >= min(1.0, self.stall_dump_s / 4):
                faulthandler.dump_traceback_later(self.stall_dump_s, repeat=False, file=sys.stderr)
                self._armed_at = now
        elif self._armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = None

    def _wait_for_clients(self) -> bool:
        """No client: a private core is done; a shared one exits under the run directory's lock, unless a
        front end attached meanwhile. True when there is a client to serve."""
        if self.acceptor is None:
            return False
        with open(self.lock_path, "a+") as lock:  # type: ignore[arg-type]
            while True:
                for conn in self.acceptor.take():
                    self.adopt(conn)
                if self.clients:
                    return True
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a front end is starting or attaching: let it (it waits for us)
                    wait([self.acceptor.wake_r], EXIT_RETRY_S)
                    continue
                for conn in self.acceptor.take():  # attached before we held the lock
                    self.adopt(conn)
                if self.clients:
                    fcntl.flock(lock, fcntl.LOCK_UN)
                    return True
                self.acceptor.close()  # the socket file goes: the next front end starts a new core
                logger.info("the last front end detached: the engine core exits")
                return False  # the lock goes with the file

    def _read(self, client: CoreClient) -> None:
        conn = client.conn
        try:
            while conn.poll(0):
                self._handle(client, conn.recv())
                if client.cid not in self.clients:
                    return
        except (EOFError, OSError):  # the front end is gone
            self._drop(client, "its connection closed")

    def _drop_stalled(self) -> None:
        now = time.monotonic()
        for client in list(self.clients.values()):
            if client.writer is not None and client.writer.stalled(now):
                self._drop(client, f"it read nothing for {self.stall_s:g} s")

    def _drop(self, client: CoreClient, why: str) -> None:
        """A front end is gone, detached or stopped reading: every request it had is aborted, blocks freed now."""
        if self.clients.pop(client.cid, None) is None:
            return
        self._by_conn.pop(client.conn, None)
        self._changed = True
        for rid in list(client.requests):
            self.engine.abort_request(rid)
        if self.acceptor is not None or client.requests:
            logger.info("front end %d detached (%s): %d request(s) aborted, %d front end(s) left", client.cid,
                        why, len(client.requests), len(self.clients))
        client.requests.clear()
        if client.writer is not None:  # a detaching front end gets its acknowledgement first
            client.writer.close(flush_s=0.0 if client.writer.stalled(time.monotonic()) else 1.0)
        client.conn.close()
        if self.acceptor is None:
            self.stopped = True  # a private core serves its one front end

    def _route(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their clients, under the front end's request ids."""
        clients = self.clients
        seen: dict[str, CoreClient | None] = {}  # "<client id>" -> its client (None: gone), looked up once a step
        for out in outputs:
            cid, _, rid = out.request_id.partition(":")
            if cid not in seen:
                seen[cid] = clients.get(int(cid))
            client = seen[cid]
            if client is None:
                continue
            if out.finished:
                client.requests.discard(out.request_id)
            out.request_id = rid
            # the front end has them (it prepared the request): not pickled every step
            out.prompt, out.prompt_token_ids = None, []
            client.pending.outputs.append(pack_output(out))

    def _stats(self, joining: int | None = None) -> dict:
        """The engine's stats, the number of front ends (with ``joining``, one being adopted), and which one
        publishes the engine-wide metrics where front ends share one metrics registry (Triton's model
        instances): the first still attached."""
        ids = set(self.clients) if joining is None else {*self.clients, joining}
        stats = self.engine.get_stats()
        stats["engine_core_clients"] = len(ids)
        stats["engine_core_publisher"] = min(ids, default=None)
        return stats

    def _send(self, *, everyone: bool) -> None:
        """Each client's pending part (``everyone``: also those with nothing but the stats of a step)."""
        stats, tokens = None, None
        self._changed = False
        for client in list(self.clients.values()):
            msg = client.pending
            if not (everyone or msg.outputs or msg.acks or msg.errors):
                continue
            if stats is None:  # with the outputs: a caller that sees its end sees its counts
                stats, tokens = self._stats(), self.engine.stats.take_step_tokens()
            client.pending = CoreOutputs()
            msg.stats, msg.step_tokens = stats, list(tokens)  # type: ignore[arg-type]  # a list each: merged per client
            try:
                client.send(msg)
            except (OSError, ValueError):
                self._drop(client, "its connection broke")

    def _handle(self, client: CoreClient, commands: list[tuple]) -> None:
        for cmd in commands:
            kind = cmd[0]
            if kind == "add":
                self._add(client, cmd[1])
            elif kind == "abort":
                rid = f"{client.cid}:{cmd[1]}"
                final = self.engine.abort_request(rid)  # its blocks are free now
                client.requests.discard(rid)
                if final is not None:
                    self._route([final])
                    self._changed = True  # no step may follow: every front end's stats must say so
                if cmd[2] is not None:
                    client.pending.acks.append((cmd[2], None))
            elif kind == "state":
                client.pending.acks.append((cmd[1], self.state()))
            elif kind == "shutdown":
                ack = cmd[1] if len(cmd) > 1 else None
                remaining = len(self.clients) - 1
                if ack is not None:
                    client.pending.acks.append((ack, {"num_clients": remaining}))
                    self._send_one(client)
                self._drop(client, "it detached")
                return

    def _send_one(self, client: CoreClient) -> None:
        msg, client.pending = client.pending, CoreOutputs()
        msg.stats = self._stats()
        try:
            client.send(msg)
        except (OSError, ValueError):
            pass

    def _add(self, client: CoreClient, prep: PreparedRequest) -> None:
        rid = prep.request_id
        try:
            if isinstance(prep.grammar, SerializedGrammar):
                prep.grammar = self.engine.inputs.load_grammar(prep.grammar)
            prep.request_id = f"{client.cid}:{rid}"
            self.engine.add_prepared(prep)
            client.requests.add(prep.request_id)
        except Exception as exc:  # e.g. an id reused between validation and now
            client.pending.errors.append((rid, portable(exc)))

    def state(self) -> dict:
        """The block pool, queues and clients as they are now (tests and debugging)."""
        engine = self.engine
        return {
            "num_free_blocks": engine.kv.num_free_blocks,
            "num_total_usable": engine.kv.block_pool.num_total_usable,
            "num_running": engine.scheduler.num_running,
            "num_waiting": engine.scheduler.num_waiting,
            "num_unfinished": len(engine.groups),
            "num_clients": len(self.clients),
        }


def main() -> None:
    """``python -m paged_backend.engine.core_process``: a shared core; its spec (config, address, authkey,
    lock path) is pickled on stdin by the front end that starts it."""
    config, address, authkey, lock_path = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    serve_engine_core(config, address, authkey, lock_path)


if __name__ == "__main__":  # run from the module's own name, so its messages unpickle in the front ends
    from paged_backend.engine.core_process import main as _main

    _main()
