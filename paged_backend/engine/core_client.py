"""The front end of an engine core process (``EngineConfig.engine_core_process``).

``EngineCoreClient`` offers the adapters what ``AsyncEngine`` offers (the request API of
``EngineFrontEnd``, readiness, death, stats, shutdown) while ``LLMEngine`` steps in a spawned
process (``core_process.py``), so the serving process's event loop, OpenAI layer and the
engine loop no longer share one GIL. Requests are tokenized and validated here, as in-process
(an ``InputProcessor`` over this process's tokenizer); a sender thread batches the commands
onto the pipe, and a reader thread puts each step's outputs into the request streams, adding
back the prompt and its token ids the core leaves out of them.

A private core (``engine_core_process``) is this front end's child, fed over a pipe. A shared core
(``engine_core_shared``: BentoML ``workers`` > 1, Triton ``instance_group`` count > 1) serves every front
end of one configuration and GPU set: ``attach_shared_core`` takes the run directory's lock
(``CorePaths``: ``core-<key>.lock``, ``.sock``, ``.key`` under ``run_dir()``), connects to the core's
socket, or starts the core (``python -m paged_backend.engine.core_process``) when none answers and
connects once it has loaded the model; the lock makes the others wait and then attach. The core keys
requests by (front end, request id) and exits after its last front end has detached.

A core process that dies (killed, crashed, or its loop raised) fails every open request with
``EngineDeadError`` as soon as the connection closes, and every later one; ``is_dead`` turns true
(in every front end of a shared core). ``shutdown`` (also at interpreter exit) stops a private core:
asked through the pipe, killed if it has not stopped in ``STOP_WAIT_S``; from a shared core it detaches
(the core aborts this front end's requests, frees their blocks, and exits if no front end is left).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import fcntl
import hashlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from paged_backend.config import EngineConfig
from paged_backend.engine.core_process import CoreOutputs, CoreStarted, run_engine_core, unpack_output
from paged_backend.engine.frontend import EngineFrontEnd
from paged_backend.engine.gc_heap import frozen_heap
from paged_backend.engine.input_processor import InputProcessor, load_tokenizer
from paged_backend.engine.request_state import PreparedRequest
from paged_backend.engine.stats import STEP_TOKENS_KEPT, take_all
from paged_backend.errors import EngineDeadError
from paged_backend.sample.grammar import SerializedGrammar
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # shutdown: how long the core gets to stop by itself before it is killed
ATTACH_WAIT_S = 60.0  # attaching to a running shared core: how long it may take to adopt us
RUN_DIR_ENV = "PAGED_BACKEND_RUN_DIR"


def run_dir() -> Path:
    """Where shared cores keep their socket, key and lock: ``$PAGED_BACKEND_RUN_DIR``, else
    ``$XDG_RUNTIME_DIR/paged-backend``, else ``<tmp>/paged-backend-<uid>`` (made private to this user)."""
    path = os.environ.get(RUN_DIR_ENV)
    if not path:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        path = os.path.join(xdg, "paged-backend") if xdg else os.path.join(tempfile.gettempdir(),
                                                                            f"paged-backend-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:  # the key file must not be readable by others
        raise PermissionError(f"the engine core run directory {path} must belong to this user (uid {os.getuid()}) "
                              f"and be private (mode 0700), it is uid {st.st_uid}, mode {st.st_mode & 0o777:o}; set "
                              f"{RUN_DIR_ENV} to another directory")
    return Path(path)


@dataclasses.dataclass(frozen=True)
class CorePaths:
    """A shared core's files in the run directory, named by the key of its configuration."""

    lock: Path  # held while a front end starts or attaches, and by the core when it exits
    socket: Path  # the core's Unix socket (present while it serves)
    authkey: Path  # the connection key (mode 0600)

    @classmethod
    def of(cls, config: EngineConfig) -> CorePaths:
        """One core per configuration and GPU set: front ends whose engine options and visible devices are
        the same share it."""
        text = config.model_dump_json(exclude_defaults=True) + "|" + os.environ.get("CUDA_VISIBLE_DEVICES", "*")
        base = run_dir() / f"core-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        return cls(base.with_suffix(".lock"), base.with_suffix(".sock"), base.with_suffix(".key"))


def attach_shared_core(config: EngineConfig) -> tuple[Connection, subprocess.Popen | None, CoreStarted]:
    """Connect to the shared core of ``config``, starting it first when none serves (the Popen is returned
    then). Under the run directory's lock: one front end starts the core, the others wait and attach."""
    paths = CorePaths.of(config)
    with open(paths.lock, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            conn = Client(str(paths.socket), family="AF_UNIX", authkey=paths.authkey.read_bytes())
        except (FileNotFoundError, ConnectionRefusedError):  # none, or a stale socket of a core that died
            conn = None
        if conn is not None:
            try:  # it adopts us between two engine steps
                if not conn.poll(ATTACH_WAIT_S):
                    raise EngineDeadError(f"the engine core at {paths.socket} did not answer in {ATTACH_WAIT_S:.0f}s")
                started = conn.recv()
                if isinstance(started, CoreStarted):
                    logger.info("attached to engine core %d (%s) as front end %d", started.pid, paths.socket,
                                started.client_id)
                    return conn, None, started
            except (EOFError, OSError):  # it died just now: start another
                pass
            conn.close()
        return _start_shared_core(config, paths)


def _start_shared_core(config: EngineConfig, paths: CorePaths) -> tuple[Connection, subprocess.Popen, CoreStarted]:
    authkey = os.urandom(32)
    fd = os.open(paths.authkey, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(authkey)
    paths.socket.unlink(missing_ok=True)
    # its own session: a terminal's signals stay with the front ends, which drain and then detach
    proc = subprocess.Popen([sys.executable, "-m", "paged_backend.engine.core_process"], stdin=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((config, str(paths.socket), authkey, str(paths.lock))))
    proc.stdin.close()
    logger.info("started engine core %d (%s)", proc.pid, paths.socket)
    try:
        conn = None
        while conn is None:  # it listens before it loads the model
            if proc.poll() is not None:
                raise EngineDeadError(f"the engine core process {_exit_text(proc.returncode)} while starting")
            try:
                conn = Client(str(paths.socket), family="AF_UNIX", authkey=authkey)
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.05)
        try:
            msg = conn.recv()  # after the model has loaded
        except (EOFError, OSError):
            msg = None
        if isinstance(msg, CoreStarted):
            return conn, proc, msg
        conn.close()
        if isinstance(msg, BaseException):
            raise msg
        proc.wait(5.0)
        raise EngineDeadError(f"the engine core process {_exit_text(proc.poll())} while starting")
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise


def _pid_gone(pid: int) -> bool:
    """No such process, or only its zombie (exited, its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _exit_text(code: int | None) -> str:
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class KVCapacity:
    """The size of the core's block pool, as ``InputProcessor`` checks requests against it."""

    def __init__(self, num_usable_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = self  # InputProcessor reads ``kv.block_pool.num_total_usable``
        self.num_total_usable = num_usable_blocks

    def can_fit(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self.num_total_usable


class EngineCoreClient(EngineFrontEnd):
    """``AsyncEngine``'s interface over an engine core process."""

    def __init__(self, config: EngineConfig | None = None, **engine_args: Any) -> None:
        super().__init__()
        self.config = config or EngineConfig(**engine_args)
        self._closing = False
        self._dead: str | None = None
        self._acks: dict[int, threading.Event] = {}  # abort / state query id -> set when the core answered
        self._ack_values: dict[int, Any] = {}
        self._ack_ids = itertools.count()
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # requests in the core: what outputs carry
        self._conn: Connection | None = None
        # the core process when this front end started it: a multiprocessing child (private) or a Popen (shared)
        self._proc: BaseProcess | subprocess.Popen | None = None
        atexit.register(self.shutdown)
        try:
            if self.config.engine_core_shared:
                self._conn, self._proc, started = attach_shared_core(self.config)
            else:
                started = self._spawn_private_core()
            self._core_pid = started.pid
            self._client_id = started.client_id
            self._start_front_end(started)
        except BaseException:
            self.shutdown()
            raise

    def _spawn_private_core(self) -> CoreStarted:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # not a daemon: a tensor-parallel core spawns its own workers (shutdown / atexit stop it)
        self._proc = ctx.Process(target=run_engine_core, args=(self.config, child), name="paged-backend-core")
        self._proc.start()
        child.close()  # ours closed: the pipe reads EOF once the core is gone
        return self._wait_started()

    def _start_front_end(self, started: CoreStarted) -> None:
        """Once the core is up: this process's tokenizer and input checks, then the pipe's threads."""
        self._info = started.model_info
        self._stats = started.stats
        self._step_tokens: collections.deque[int] = collections.deque(maxlen=STEP_TOKENS_KEPT)
        info = self._info
        self.max_model_len = info["max_model_len"]
        self.eos_token_ids = tuple(info["eos_token_ids"])
        self.tokenizer = None if self.config.skip_tokenizer_init else load_tokenizer(
            self.config.tokenizer or info["model_dir"], required=self.config.load_format != "dummy")
        self._inputs = InputProcessor(self.tokenizer, info["vocab_size"], self.eos_token_ids, self.max_model_len,
                                      KVCapacity(info["num_gpu_blocks"], info["block_size"]),  # type: ignore[arg-type]
                                      info["block_size"], torch.device("cpu"))
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="paged-backend-core-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="paged-backend-core-read", daemon=True)
        self._sender.start()
        self._reader.start()

    # -- adapter API -------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The core process's id."""
        return self._core_pid

    @property
    def client_id(self) -> int:
        """This front end's id in the core (its request ids are namespaced by it there)."""
        return self._client_id

    @property
    def is_ready(self) -> bool:
        return not self._closing and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        """Why the core process stopped serving (not by ``shutdown``), or None."""
        return self._dead

    def check_text_size(self, num_bytes: int, param: str = "prompt") -> None:
        """InvalidRequestError when a text of this many UTF-8 bytes cannot fit the context."""
        self._inputs.check_text_size(num_bytes, param)

    def model_info(self) -> dict:
        return dict(self._info)

    def stats(self) -> dict:
        """The core's last stats, with this front end's id there (``engine_core_client``)."""
        with self._lock:
            return {**self._stats, "engine_core_client": self._client_id}

    def take_step_tokens(self) -> list[int]:
        """Tokens of each engine step since the last call (vLLM's iteration_tokens_total)."""
        return take_all(self._step_tokens)

    def core_state(self, timeout: float = 5.0) -> dict:
        """The core's block pool and queues now (``num_free_blocks``, ``num_total_usable``, ``num_running``,
        ``num_waiting``, ``num_unfinished``), asked through the pipe after every command sent before."""
        ack, done = self._new_ack()
        self._outbox.put(("state", ack))
        if not done.wait(timeout) or ack not in self._ack_values:
            raise EngineDeadError(self._dead or "the engine core did not answer")
        return self._ack_values.pop(ack)

    def shutdown(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop a private core (asked, then killed) or detach from a shared one (it stops after its last
        front end); this front end's pending requests end with an error."""
        if self._closing:
            return
        ack, done = self._new_ack()
        self._closing = True
        atexit.unregister(self.shutdown)
        sender = getattr(self, "_sender", None)
        running = sender is not None and sender.is_alive()
        remaining = 0
        if running:
            self._outbox.put(("shutdown", ack))
            self._outbox.put(None)
            sender.join(timeout)
            if done.wait(timeout):  # answered before the core closed our connection
                remaining = self._ack_values.pop(ack, {}).get("num_clients", 0)
            self._reader.join(timeout)  # it reads the end of the connection: closed after that
        proc = self._proc
        if isinstance(proc, BaseProcess):  # private: it stops now
            proc.join(timeout if running else 1.0)
            if proc.exitcode is None:  # it ignores SIGTERM (see core_process.py)
                proc.kill()
                proc.join(5.0)
        elif proc is not None and remaining == 0:  # shared, started here, and we were its last front end
            try:
                proc.wait(timeout if running else 1.0)
            except subprocess.TimeoutExpired:  # not killed: a front end may have attached to it meanwhile
                logger.warning("the engine core process %d has not exited %.0fs after its last front end "
                               "detached", proc.pid, timeout)
        # (shared, others still attached: it exits after the last of them)
        if self._conn is not None:
            self._conn.close()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._release_acks()
        self._input_pool.shutdown(wait=False, cancel_futures=True)

    # -- EngineFrontEnd hooks ------------------------------------------------------------

    def _process_input(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                       cache_salt: str | None) -> PreparedRequest:
        prep = self._inputs.process(request_id, prompt, params, cache_salt=cache_salt)
        if prep.grammar is not None:  # compiled grammars do not pickle: the core loads xgrammar's JSON
            prep = dataclasses.replace(prep, grammar=SerializedGrammar.of(prep.grammar))
        return prep

    def _submit(self, prep: PreparedRequest) -> None:
        if self._dead is not None or self._closing:
            raise EngineDeadError(self._dead or "the engine was shut down")
        self._prompts[prep.request_id] = (prep.prompt, prep.prompt_token_ids)
        self._outbox.put(("add", prep))

    def _request_abort(self, request_id: str) -> threading.Event:
        ack, done = self._new_ack()
        self._outbox.put(("abort", request_id, ack))
        return done

    def _new_ack(self) -> tuple[int, threading.Event]:
        ack, done = next(self._ack_ids), threading.Event()
        with self._lock:
            self._acks[ack] = done
            if self._dead is not None or self._closing:
                done.set()  # nobody will answer: nothing is left to wait for
        return ack, done

    def _release_acks(self) -> None:
        with self._lock:
            acks, self._acks = self._acks, {}
        for done in acks.values():
            done.set()

    # -- the pipe ----------------------------------------------------------------------

    def _wait_started(self) -> CoreStarted:
        """The core's first message; its start-up exception is raised here, as in-process."""
        ready = wait([self._conn, self._proc.sentinel])
        if self._conn in ready:
            try:
                msg = self._conn.recv()
            except EOFError:
                msg = None
            if isinstance(msg, CoreStarted):
                return msg
            if isinstance(msg, BaseException):
                raise msg
        self._join_core(5.0)
        raise EngineDeadError(f"the engine core process {self._exit_text()} while starting")

    def _exit_text(self) -> str:
        proc = self._proc
        if proc is None:  # attached to a core another front end started: its exit status is not ours to read
            deadline = time.monotonic() + 1.0
            while not _pid_gone(self._core_pid):
                if time.monotonic() > deadline:
                    return f"(pid {self._core_pid}) closed its connection"
                time.sleep(0.02)
            return f"(pid {self._core_pid}) is gone"
        code = proc.exitcode if isinstance(proc, BaseProcess) else proc.poll()
        return "closed its pipe" if code is None else _exit_text(code)

    def _join_core(self, timeout: float) -> None:
        """Wait (briefly) for a core this front end started to exit, so its exit status can be told."""
        proc = self._proc
        if isinstance(proc, BaseProcess):
            proc.join(timeout)
        elif proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def _send_loop(self) -> None:
        """Sender thread: every command queued since the last send goes in one message."""
        outbox, conn = self._outbox, self._conn
        while True:
            batch = [outbox.get()]
            while True:
                try:
                    batch.append(outbox.get_nowait())
                except queue.Empty:
                    break
            last = None in batch
            commands = [c for c in batch if c is not None]
            try:
                if commands:
                    conn.send(commands)
            except (OSError, ValueError):  # the core is gone: the reader reports it
                return
            if last:
                return

    def _read_loop(self) -> None:
        """Reader thread: each message is one engine step's outputs for every request.

        While it reads, the serving process's start-up heap (the server, torch, the tokenizer) is frozen
        (``frozen_heap``), as the in-process engine's loop thread freezes it: each step's deltas, chunks and
        futures trigger collections, and a full one over that heap stalls every stream for hundreds of ms."""
        conn = self._conn
        reason = None
        try:
            with frozen_heap():
                while True:
                    try:
                        msg: CoreOutputs = conn.recv()
                    except (EOFError, OSError):
                        break
                    self._on_outputs(msg)
                    if msg.dead is not None:
                        reason = msg.dead
                        break
        except BaseException as exc:  # a bug here must not leave the streams hanging
            logger.exception("engine core reader died")
            reason = f"the engine core reader died: {exc!r}"
        if self._closing:
            return
        if reason is None:
            self._join_core(2.0)
            reason = f"the engine core process {self._exit_text()}"
        logger.error("%s: failing every request", reason)
        self._dead = reason
        self._prompts.clear()
        self._fail_all(EngineDeadError(reason))
        self._release_acks()

    def _on_outputs(self, msg: CoreOutputs) -> None:
        if msg.stats:  # a dying core's last message has none
            with self._lock:
                self._stats = msg.stats  # first: a caller that sees its final output sees its counts
        self._step_tokens.extend(msg.step_tokens)
        prompts = self._prompts
        for rid, exc in msg.errors:
            prompts.pop(rid, None)
            self._deliver_error(rid, exc)
        if msg.outputs:
            outputs = []
            for item in msg.outputs:
                out = unpack_output(item)
                prompt = prompts.pop(out.request_id, None) if out.finished else prompts.get(out.request_id)
                if prompt is not None:
                    out.prompt, out.prompt_token_ids = prompt
                outputs.append(out)
            self._deliver(outputs)
        for ack, value in msg.acks:
            with self._lock:
                done = self._acks.pop(ack, None)
                if value is not None:
                    self._ack_values[ack] = value
            if done is not None:
                done.set()
