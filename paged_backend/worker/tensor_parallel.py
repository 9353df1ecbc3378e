"""Tensor parallelism across processes: one scheduler on rank 0, the model on every rank.

    rank 0 (the engine)                                   rank r > 0 (a worker)
    Scheduler -> SchedulerOutput  --broadcast (gloo)-->  SchedulerOutput
    ModelRunner.execute(sched)  <--all-reduce / logits gather-->  ModelRunner.execute(sched)
    Sampler (rank 0 only: the logits are gathered there)

``create_model_runner`` gives the engine a plain ``ModelRunner`` at tensor_parallel_size 1,
and above it a ``TensorParallelRunner``; both implement ``ModelRunnerProtocol``
(worker/runner.py). The tensor-parallel one starts the workers
itself (torch.multiprocessing, spawn), or under ``torchrun`` turns ranks > 0 into workers in
place. A dead worker fails the engine with ``WorkerDiedError``; ``shutdown`` (also at
interpreter exit) stops and reaps every worker.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_backend.config import EngineConfig
from paged_backend.core.scheduler import SchedulerOutput
from paged_backend.distributed import (
    DEVICE_TIMEOUT_S,
    TPGroup,
    abort_tp_group,
    destroy_tp_group,
    init_tp_group,
)
from paged_backend.errors import EngineDeadError
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.parallel import check_tp_compatible
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.runner import ModelOutput, ModelRunnerProtocol

logger = logging.getLogger(__name__)

_READY_KEY = "paged_backend/tp_ready/{}"


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker died (or a collective failed): the engine cannot go on."""


# -- what each rank reports ------------------------------------------------------------------


@dataclass
class RankReport:
    """One rank's KV cache: its blocks and how many the requests still alive hold."""

    rank: int
    pid: int
    device: str
    num_blocks: int  # incl. the null block
    kv_cache_shape: tuple[int, ...]
    num_used_blocks: int
    num_free_blocks: int
    layers: tuple[int, int] = (0, 0)  # the decoder layers [start, end) whose KV cache this rank holds


class _BlockLedger:
    """Which blocks each request holds, as this rank learnt it from the plans it executed."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def record(self, sched: SchedulerOutput) -> None:
        for s in sched.scheduled:
            self.blocks[s.request_id] = s.block_ids

    def report(self, tp: TPGroup, runner: ModelRunner, live: set[str]) -> RankReport:
        self.blocks = {rid: b for rid, b in self.blocks.items() if rid in live}
        used = len({b for blocks in self.blocks.values() for b in blocks})
        shape = tuple(runner.kv_caches[0].shape) if runner.kv_caches else ()
        pp = runner.pp
        layers = (pp.start, pp.end) if pp is not None else (0, len(runner.kv_specs))
        return RankReport(tp.rank, os.getpid(), str(runner.device), runner.num_blocks, shape, used,
                          runner.num_blocks - 1 - used, layers)


# -- the factory -------------------------------------------------------------------------------


def create_model_runner(
    config: EngineConfig, model_dir: Path, info: ModelInfo, device: torch.device, dtype: torch.dtype
) -> ModelRunnerProtocol:
    """The engine's model runner: local at tensor_parallel_size 1, else over all ranks."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, model_dir, info, device, dtype)
    return TensorParallelRunner(config, model_dir, info, device, dtype)


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor parallel rank {local_rank} needs GPU {local_rank}, but only "
                         f"{torch.cuda.device_count()} are visible")
    return torch.device("cuda", local_rank)


def _torchrun_rank() -> int | None:
    """This process's rank when launched by torchrun (or any env:// launcher), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return None


# -- rank 0 --------------------------------------------------------------------------------


class TensorParallelRunner:
    """Rank 0's runner (``ModelRunnerProtocol``): rank 0's slice runs here, in ``self.local``, and
    every call is mirrored on the workers."""

    _kind = "tensor-parallel"  # how errors name the workers

    def __init__(self, config: EngineConfig, model_dir: Path, info: ModelInfo, device: torch.device,
                 dtype: torch.dtype) -> None:
        self._configure(config, info)
        self._procs: list[mp.Process] = []
        self._failure: WorkerDiedError | None = None
        self._closed = False
        self._ledger = _BlockLedger()
        self._lock = threading.Lock()  # one mirrored call at a time (the engine thread vs. reports)
        self.tp: TPGroup | None = None
        atexit.register(self.shutdown)
        try:
            rank = _torchrun_rank()
            if rank is None:
                dev = _rank_device(device, 0)
                self._start_workers(config, model_dir, info, device, dtype, dev)
            else:
                dev = _rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
                if rank != 0:  # torchrun: this process is a worker; it leaves when rank 0 shuts down
                    atexit.unregister(self.shutdown)
                    self._serve_fn()(rank, self.world_size, config, model_dir, info, dev, dtype, None)
                    raise SystemExit(0)
                self._join_groups(config, dev, None)
            if dev.type == "cuda":
                threading.Thread(target=self._watch_workers, name="paged-backend-tp-watch", daemon=True).start()
            self.local = self._local_runner(config, model_dir, info, dev, dtype)
        except BaseException:
            self.shutdown()
            raise
        self._log_start(info, config.enable_expert_parallel)

    # -- what a subclass (pipeline parallelism) replaces --------------------------------------

    def _configure(self, config: EngineConfig, info: ModelInfo) -> None:
        """The world size, and the model's split checked before any process starts."""
        self.world_size = config.tensor_parallel_size
        check_tp_compatible(info, self.world_size, config.enable_expert_parallel)

    def _serve_fn(self) -> Callable[..., None]:
        """A worker's life (module level: a spawned process is given it)."""
        return _serve_tp

    def _join_groups(self, config: EngineConfig, dev: torch.device, store: dist.Store | None) -> None:
        self.tp = init_tp_group(0, self.world_size, dev, store=store, expert_parallel=config.enable_expert_parallel)

    def _local_runner(self, config: EngineConfig, model_dir: Path, info: ModelInfo, dev: torch.device,
                      dtype: torch.dtype) -> ModelRunner:
        return ModelRunner(config, model_dir, info, dev, dtype, tp=self.tp)

    def _send_command(self, cmd: str, arg: Any) -> None:
        """Every worker gets ``(cmd, arg)``."""
        self.tp.broadcast_object((cmd, arg))

    def _log_start(self, info: ModelInfo, ep: bool) -> None:
        logger.info("tensor parallel: %d ranks (%s), %d q / %d KV heads per rank%s", self.world_size,
                    self.tp.backend, info.num_heads // self.world_size, self.local.num_kv_heads,
                    ", whole routed experts per rank (expert parallel)" if ep and info.is_moe else "")

    # -- ModelRunnerProtocol -------------------------------------------------------------

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.local.kv_dtype

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def num_host_blocks(self) -> int:  # every rank sizes its own host tier the same from swap_space
        return self.local.num_host_blocks

    @property
    def num_kv_heads(self) -> int:
        return self.local.num_kv_heads

    @property
    def step_counts(self) -> dict[str, int]:
        return self.local.step_counts

    @property
    def bytes_per_block(self) -> int:
        return self.local.bytes_per_block

    def determine_num_blocks(self, shared_bytes_per_block: int = 0) -> int:
        """The KV blocks that fit on every rank (all-reduce MIN of each rank's own budget)."""
        return self._mirrored("num_blocks", shared_bytes_per_block,
                              lambda: self.tp.min_int(self.local.determine_num_blocks(shared_bytes_per_block)))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._mirrored("allocate", num_blocks, lambda: self.local.allocate_kv_cache(num_blocks))

    def execute(self, sched: SchedulerOutput, prev: tuple[list[str], torch.Tensor] | None = None
                ) -> ModelOutput:
        if prev is not None:
            raise ValueError("tensor parallelism runs without async scheduling: no step is in flight")
        self._ledger.record(sched)
        return self._mirrored("step", sched, lambda: self.local.execute(sched))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write outside a step (the MTP proposer's lookahead blocks), every layer of every rank."""
        self._mirrored("copy", pairs, lambda: self.local.copy_blocks(pairs))

    def execute_mtp(self, sched: SchedulerOutput, rows: list[int], spec_step: int = 0) -> torch.Tensor:
        """An MTP pass (``ModelRunner.execute_mtp``) on every rank, each on its own hidden states; rank 0 gets
        the full-vocabulary logits."""
        self._ledger.record(sched)
        return self._mirrored("mtp", (sched, rows, spec_step),
                              lambda: self.local.execute_mtp(sched, rows, spec_step))

    def rank_reports(self, live_request_ids: set[str] | list[str]) -> list[RankReport]:
        """Every rank's KV-block accounting; ``live_request_ids``: the requests holding blocks now."""
        live = set(live_request_ids)
        return self._mirrored("report", live,
                              lambda: self.tp.gather_objects(self._ledger.report(self.tp, self.local, live)))

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- failure and shutdown ------------------------------------------------------------

    def _mirrored(self, cmd: str, arg: Any, local: Callable[[], Any]) -> Any:
        """Sends ``(cmd, arg)`` to the workers and runs ``local`` here; any failure is fatal."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise WorkerDiedError("the tensor-parallel engine was shut down")
        with self._lock:
            dead = self._dead_workers()
            if dead:
                raise self._fail(None, dead)
            try:
                self._send_command(cmd, arg)
                return local()
            except Exception as exc:
                raise self._fail(exc, self._dead_workers(wait_s=2.0)) from exc

    def _dead_workers(self, wait_s: float = 0.0) -> list[mp.Process]:
        deadline = time.monotonic() + wait_s
        while True:
            dead = [p for p in self._procs if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _fail(self, exc: BaseException | None, dead: list[mp.Process]) -> WorkerDiedError:
        if dead:
            rank = {p.pid: i + 1 for i, p in enumerate(self._procs)}
            what = ", ".join(f"rank {rank[p.pid]} (pid {p.pid}, exit code {p.exitcode})" for p in dead)
            msg = f"{self._kind} worker {what} died; the engine cannot continue"
        else:
            msg = f"a {self._kind} collective failed ({exc!r}); the engine cannot continue"
        logger.error(msg)
        self._failure = WorkerDiedError(msg)
        self._stop_workers(grace_s=0.0)
        return self._failure

    def _watch_workers(self) -> None:
        """CUDA: a collective with a dead peer waits on NCCL's timeout; abort it at once instead."""
        while not self._closed and self._failure is None:
            if self._dead_workers():
                abort_tp_group()
                return
            time.sleep(0.5)

    def _stop_workers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the workers (asked, then terminated, then killed) and leaves the process group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        # a step stuck in a collective holds the lock: then the workers are terminated instead
        if self._lock.acquire(timeout=timeout_s):
            try:
                if self.tp is not None and self._failure is None and not self._dead_workers():
                    self._send_command("shutdown", None)
                    self.tp.barrier()
            except Exception:
                logger.debug("shutdown broadcast failed", exc_info=True)
            finally:
                self._lock.release()
            self._stop_workers(grace_s=timeout_s)
        else:
            self._stop_workers(grace_s=0.0)
        if self.tp is not None:
            destroy_tp_group()

    # -- starting the workers ------------------------------------------------------------

    def _start_workers(self, config: EngineConfig, model_dir: Path, info: ModelInfo, device: torch.device,
                       dtype: torch.dtype, dev: torch.device) -> None:
        """Spawns ranks 1..N-1, waits until each is up (or dies), then forms the group."""
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group (another tensor-parallel "
                               "engine?): shut that engine down first")
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                              timeout=timedelta(seconds=DEVICE_TIMEOUT_S), wait_for_workers=False)
        threads = max(1, torch.get_num_threads() // self.world_size) if device.type == "cpu" else 0
        ctx = mp.get_context("spawn")
        for rank in range(1, self.world_size):
            p = ctx.Process(target=_worker_main, name=f"paged-backend-tp{rank}", daemon=True,
                            args=(rank, self.world_size, store.port, os.getpid(), config, str(model_dir), info,
                                  device.type, dtype, threads, self._serve_fn()))
            p.start()
            self._procs.append(p)
        keys = [_READY_KEY.format(r) for r in range(1, self.world_size)]
        deadline = time.monotonic() + DEVICE_TIMEOUT_S
        while not store.check(keys):
            dead = self._dead_workers()
            if dead:
                raise self._fail(None, dead)
            if time.monotonic() > deadline:
                raise self._fail(TimeoutError(f"workers not up after {DEVICE_TIMEOUT_S:.0f}s"), [])
            time.sleep(0.05)
        self._join_groups(config, dev, store)


# -- ranks > 0 -------------------------------------------------------------------------------


def run_worker(config: EngineConfig, model_dir: Path | str, info: ModelInfo, device: torch.device,
               dtype: torch.dtype, tp: TPGroup, runner: ModelRunner | None = None,
               recv: Callable[[], Any] | None = None) -> None:
    """A worker's life: load this rank's slice of the model, then run what rank 0 broadcasts.

    Pipeline parallelism passes its stage's ``runner`` and ``recv`` (rank 0's commands point to point);
    ``tp`` is then the group of every rank."""
    if runner is None:
        runner = ModelRunner(config, Path(model_dir), info, device, dtype, tp=tp)
    recv = recv or tp.broadcast_object
    ledger = _BlockLedger()
    while True:
        cmd, arg = recv()
        if cmd == "step":
            ledger.record(arg)
            runner.execute(arg)
        elif cmd == "mtp":  # speculative decoding's MTP pass: (plan, hidden-state rows, spec_step)
            ledger.record(arg[0])
            runner.execute_mtp(*arg)
        elif cmd == "copy":
            runner.copy_blocks(arg)
        elif cmd == "num_blocks":
            tp.min_int(runner.determine_num_blocks(arg or 0))
        elif cmd == "allocate":
            runner.allocate_kv_cache(arg)
        elif cmd == "report":
            tp.gather_objects(ledger.report(tp, runner, arg))
        elif cmd == "trace":  # pipeline parallelism: the stage's forward passes
            tp.gather_objects(runner.stage_trace())
        elif cmd == "shutdown":
            tp.barrier()
            return
        else:
            raise RuntimeError(f"unknown command from rank 0: {cmd!r}")


def _exit_when_orphaned(parent_pid: int) -> None:
    """A spawned worker must not outlive the engine process, however that one ends."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="paged-backend-parent-watch", daemon=True).start()


def _serve_tp(rank: int, world_size: int, config: EngineConfig, model_dir: Path | str, info: ModelInfo,
              dev: torch.device, dtype: torch.dtype, store: dist.Store | None) -> None:
    """A tensor-parallel worker: joins the group, serves rank 0's calls, leaves."""
    tp = init_tp_group(rank, world_size, dev, store=store, expert_parallel=config.enable_expert_parallel)
    run_worker(config, model_dir, info, dev, dtype, tp)
    destroy_tp_group()


def _worker_main(rank: int, world_size: int, port: int, parent_pid: int, config: EngineConfig, model_dir: str,
                 info: ModelInfo, device_type: str, dtype: torch.dtype, threads: int,
                 serve: Callable[..., None] = _serve_tp) -> None:
    """Entry point of a spawned worker process."""
    _exit_when_orphaned(parent_pid)
    if threads:
        torch.set_num_threads(threads)
    dev = _rank_device(torch.device(device_type), rank)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=timedelta(seconds=DEVICE_TIMEOUT_S))
    store.set(_READY_KEY.format(rank), "1")
    serve(rank, world_size, config, model_dir, info, dev, dtype, store)
