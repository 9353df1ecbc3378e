"""Pipeline parallelism: the decoder layers split into contiguous stages, each stage a
tensor-parallel group of its own, activations sent stage to stage point to point.

    rank = pp_rank * tp_size + tp_rank            (rank 0: the engine, stage 0's TP rank 0)

    rank 0      Scheduler -> SchedulerOutput --p2p (gloo control group)--> every other rank
    stage 0     embed, layers [0, b1)    --(hidden, residual)--> stage 1's same TP rank
    stage i     layers [b_i, b_i+1)      --(hidden, residual)--> stage i + 1
    last stage  layers, norm, LM head    --logits (TP rank 0)--> rank 0 (posted irecv)

A step's plan and its activations are sent without waiting for the receiver (``isend``; the
plan over ``ObjectChannel``), and rank 0 posts the receive of the logits when it submits the
step, so rank 0 runs stage 0 of micro-batch k + 1 while the later stages work on k: the engine
keeps up to ``pipeline_parallel_size`` steps in flight (``submit`` / ``wait``;
engine/pipeline_steps.py). Each stage processes the steps in submission order, so a block freed
and reused by a later step is written there only after the earlier step read it.

Each rank holds the weights and the KV cache of its stage's layers only; the KV block count is
the minimum over all ranks. The lifecycle, failure handling (a dead rank fails the engine with
the rank named) and torchrun are ``TensorParallelRunner``'s (worker/tensor_parallel.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paged_backend.attention import AttentionMetadata
from paged_backend.config import EngineConfig
from paged_backend.core.scheduler import SchedulerOutput
from paged_backend.distributed import (
    ObjectChannel,
    PipelineGroups,
    destroy_tp_group,
    init_pipeline_groups,
    partition_layers,
    pipeline_tag,
)
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.parallel import check_tp_compatible
from paged_backend.worker import tensor_parallel
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.runner import ModelOutput, ModelRunnerProtocol
from paged_backend.worker.step_inputs import StepInputs
from paged_backend.worker.tensor_parallel import TensorParallelRunner, run_worker

logger = logging.getLogger(__name__)

TRACE_LEN = 4096  # forward passes each stage remembers (stage_traces)


def create_model_runner(config: EngineConfig, model_dir: Path, info: ModelInfo, device: torch.device,
                        dtype: torch.dtype) -> ModelRunnerProtocol:
    """The engine's model runner: pipeline-parallel above pipeline_parallel_size 1, else
    ``tensor_parallel.create_model_runner``'s (local, or tensor-parallel)."""
    if config.pipeline_parallel_size == 1:
        return tensor_parallel.create_model_runner(config, model_dir, info, device, dtype)
    return PipelineParallelRunner(config, model_dir, info, device, dtype)


# -- one stage, on every rank ------------------------------------------------------------------


class PipelineStageRunner(ModelRunner):
    """One rank's stage: the weights and KV cache of its layers; the previous stage's activations in,
    its own out to the next stage; on the last stage, TP rank 0 sends the logits rows to rank 0."""

    def __init__(self, config: EngineConfig, model_dir: Path, info: ModelInfo, device: torch.device,
                 dtype: torch.dtype, groups: PipelineGroups) -> None:
        self.groups = groups
        self.stage = groups.stage
        super().__init__(config, model_dir, info, device, dtype, tp=groups.tp, pp=groups.stage)
        self._seq = 0  # steps executed: both ends of a send count them (the message tag)
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()  # isends in flight and their buffers
        self.trace: deque[tuple[int, float, float]] = deque(maxlen=TRACE_LEN)  # (step, start, end), time.time()
        self.busy_s = 0.0

    def _graphs_wanted(self) -> bool:
        return False  # CUDA graphs are not captured under pipeline parallelism

    def _profile_pass(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                      meta: AttentionMetadata) -> None:
        """The stage's part of the dummy prefill (CUDA's KV budget profiling, the prefill warm-up), on its
        own: zero activations in where another stage would send them, nothing sent; the LM head on the
        last stage (TP ranks of a stage profile together)."""
        n = input_ids.shape[0]
        intermediate = None
        if not self.stage.is_first:
            zeros = torch.zeros((n, self.info.hidden_size), dtype=self.dtype, device=self.device)
            intermediate = (zeros, zeros.clone())
        out = self.model(input_ids, positions, caches, meta, intermediate)
        if self.stage.is_last:
            self.model.compute_logits(out[: min(n, self.limits.max_num_seqs)])

    def execute(self, sched: SchedulerOutput, prev: tuple[list[str], torch.Tensor] | None = None) -> ModelOutput:
        if prev is not None:
            raise ValueError("pipeline parallelism runs without async scheduling")
        t0 = time.time()
        try:
            return super().execute(sched)
        finally:
            t1 = time.time()
            self.trace.append((self._seq, t0, t1))
            self.busy_s += t1 - t0
            self._seq += 1

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self._sends.append((dist.isend(t, dst, tag=pipeline_tag(self._seq)), t))
        while len(self._sends) > 2 * self.stage.pp_size:  # long received: the receiver runs steps in order
            self._sends.popleft()[0].wait()

    def _forward(self, step: StepInputs) -> torch.Tensor | None:
        stage = self.stage
        intermediate = None
        if not stage.is_first:
            buf = torch.empty((2, step.num_tokens, self.info.hidden_size), dtype=self.dtype, device=self.device)
            dist.recv(buf, stage.prev_rank, tag=pipeline_tag(self._seq))
            intermediate = (buf[0], buf[1])
        out = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, intermediate)
        if stage.is_last:
            return out
        self._send(torch.stack(out), stage.next_rank)
        return None

    def _outputs(self, step: StepInputs, hidden: torch.Tensor | None) -> ModelOutput:
        if hidden is None:  # not the last stage: the rows' layout only (rank 0 receives the logits)
            def empty(n: int) -> torch.Tensor:
                return torch.empty((n, 0), dtype=torch.float32)

            return ModelOutput(step.sample_request_ids, empty(len(step.sample_rows)),
                               {rid: (start, empty(count)) for rid, _, count, start in step.prompt_spans})
        out = super()._outputs(step, hidden)
        if self.stage.tp_rank == 0:
            packed = _pack(out)
            if packed.shape[0]:
                self._send(packed, 0)
        return out

    def stage_trace(self) -> dict[str, Any]:
        """This rank's forward passes: ``intervals`` (step, start, end) in ``time.time()`` seconds."""
        st = self.stage
        return {"rank": st.rank, "pp_rank": st.pp_rank, "tp_rank": st.tp_rank, "layers": (st.start, st.end),
                "steps": self._seq, "busy_s": self.busy_s, "intervals": list(self.trace)}

    def shutdown(self) -> None:
        self._sends.clear()


def _pack(out: ModelOutput) -> torch.Tensor:
    """The sampled rows' logits, then each prompt span's, in one [rows, vocab] tensor."""
    return torch.cat([out.logits, *(t for _, t in out.prompt_logits.values())]).contiguous()


# -- rank 0 --------------------------------------------------------------------------------------


@dataclass(eq=False)
class PendingStep:
    """A submitted step: its rows' layout (``out`` with empty logits) and the posted receive of the logits."""

    seq: int
    out: ModelOutput
    work: Any = None  # dist.Work of the logits irecv (None: the step has no logits rows)
    buf: torch.Tensor | None = None


class PipelineParallelRunner(TensorParallelRunner):
    """Rank 0's runner: stage 0's TP rank 0 runs here (``self.local``); every call goes to every
    rank; ``submit`` returns before the later stages are done, ``wait`` receives the logits.
    ``execute`` (the protocol) is the two at once."""

    _kind = "pipeline-parallel"

    def _configure(self, config: EngineConfig, info: ModelInfo) -> None:
        self.tp_size, self.pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        check_tp_compatible(info, self.tp_size, config.enable_expert_parallel)
        self.bounds = partition_layers(info.num_layers, self.pp_size, config.pp_layer_partition)
        self.vocab_size = info.vocab_size
        self._seq = 0
        self._in_flight: set[int] = set()
        self.max_in_flight = 0  # the most steps in flight at once (submitted, logits not yet received)

    def _serve_fn(self) -> Callable[..., None]:
        return _serve_pp

    def _join_groups(self, config: EngineConfig, dev: torch.device, store: dist.Store | None) -> None:
        self.groups = init_pipeline_groups(0, self.tp_size, self.pp_size, self.bounds, self.bounds[-1][1], dev,
                                           store, config.enable_expert_parallel)
        self.tp = self.groups.world  # the control collectives (num_blocks, reports) span every rank
        self._channels = [ObjectChannel(self.tp.control_group, r, keep=4 * self.pp_size)
                          for r in range(1, self.world_size)]

    def _local_runner(self, config: EngineConfig, model_dir: Path, info: ModelInfo, dev: torch.device,
                      dtype: torch.dtype) -> ModelRunner:
        return PipelineStageRunner(config, model_dir, info, dev, dtype, self.groups)

    def _send_command(self, cmd: str, arg: Any) -> None:
        for ch in self._channels:
            ch.send((cmd, arg))

    def _log_start(self, info: ModelInfo, ep: bool) -> None:
        logger.info("pipeline parallel: %d stages x %d tensor-parallel ranks (%s), layers %s%s", self.pp_size,
                    self.tp_size, self.tp.backend, ", ".join(f"{a}-{b - 1}" for a, b in self.bounds),
                    ", whole routed experts per rank (expert parallel)" if ep and info.is_moe and self.tp_size > 1
                    else "")

    # -- steps -------------------------------------------------------------------------------

    def execute(self, sched: SchedulerOutput, prev: tuple[list[str], torch.Tensor] | None = None
                ) -> ModelOutput:
        if prev is not None:
            raise ValueError("pipeline parallelism runs without async scheduling: no step is in flight")
        return self.wait(self.submit(sched))

    def submit(self, sched: SchedulerOutput) -> PendingStep:
        """Sends the step to every rank, runs stage 0 here and posts the receive of its logits; returns
        before the later stages are done."""
        self._ledger.record(sched)
        out = self._mirrored("step", sched, lambda: self.local.execute(sched))
        seq = self._seq
        self._seq += 1
        pending = PendingStep(seq, out)
        rows = _pack(out).shape[0]
        if rows:
            pending.buf = torch.empty((rows, self.vocab_size), dtype=torch.float32, device=self.local.device)
            try:
                pending.work = dist.irecv(pending.buf, self.groups.stage.logits_rank, tag=pipeline_tag(seq))
            except Exception as exc:
                raise self._fail(exc, self._dead_workers(wait_s=2.0)) from exc
        self._in_flight.add(seq)
        self.max_in_flight = max(self.max_in_flight, len(self._in_flight))
        return pending

    def wait(self, pending: PendingStep) -> ModelOutput:
        """The step's logits, from the last stage (waits for them)."""
        if self._failure is not None:
            raise self._failure
        self._in_flight.discard(pending.seq)
        if pending.work is not None:
            try:
                pending.work.wait()
            except Exception as exc:
                raise self._fail(exc, self._dead_workers(wait_s=2.0)) from exc
        out, buf = pending.out, pending.buf
        if buf is None:
            return ModelOutput(out.sample_request_ids, torch.empty((0, self.vocab_size)), {})
        n = out.logits.shape[0]
        logits, prompt_logits = buf[:n], {}
        for rid, (start, t) in out.prompt_logits.items():
            prompt_logits[rid] = (start, buf[n : n + t.shape[0]])
            n += t.shape[0]
        return ModelOutput(out.sample_request_ids, logits, prompt_logits)

    def stage_traces(self) -> list[dict[str, Any]]:
        """Every rank's forward passes (``PipelineStageRunner.stage_trace``), in rank order; each rank
        answers after the steps submitted before it."""
        return self._mirrored("trace", None, lambda: self.tp.gather_objects(self.local.stage_trace()))


# -- ranks > 0 -------------------------------------------------------------------------------------


def _serve_pp(rank: int, world_size: int, config: EngineConfig, model_dir: Path | str, info: ModelInfo,
              dev: torch.device, dtype: torch.dtype, store: dist.Store | None) -> None:
    """A pipeline-parallel worker: joins the groups, loads its stage, runs what rank 0 sends, leaves."""
    bounds = partition_layers(info.num_layers, config.pipeline_parallel_size, config.pp_layer_partition)
    groups = init_pipeline_groups(rank, config.tensor_parallel_size, config.pipeline_parallel_size, bounds,
                                  info.num_layers, dev, store, config.enable_expert_parallel)
    runner = PipelineStageRunner(config, Path(model_dir), info, dev, dtype, groups)
    channel = ObjectChannel(groups.world.control_group, 0)
    run_worker(config, model_dir, info, dev, dtype, groups.world, runner=runner, recv=channel.recv)
    runner.shutdown()
    destroy_tp_group()
