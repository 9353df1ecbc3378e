"""torch.distributed plumbing of tensor parallelism: one process per rank, two process groups.

    device group    NCCL on CUDA, gloo on the CPU: the model's all-reduces and logits gather;
                    a collective that waits longer than ``timeout_s`` fails
    control group   gloo (CPU objects): rank 0 broadcasts each step's plan; workers wait on it
                    while the engine idles, so its timeout is very long (a dead peer closes
                    its sockets, which fails the wait at once)

Under ``torchrun`` the default group from the environment is used; the engine's own spawned
workers rendezvous through a ``TCPStore`` that rank 0 hosts.

``TPGroup.expert_parallel`` (``enable_expert_parallel``) says how the model's routed experts split
over the same ranks: whole experts per rank instead of every expert's features (models/moe.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEVICE_TIMEOUT_S = 300.0
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(eq=False)
class TPGroup:
    """This process's place in the tensor-parallel group and the collectives the model uses."""

    rank: int
    world_size: int
    device: torch.device
    device_group: Any = None  # dist.ProcessGroup
    control_group: Any = None  # dist.ProcessGroup (gloo)
    expert_parallel: bool = False  # MoE layers: whole experts per rank (models/parallel.py expert_range)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max of ``x`` over the ranks, in place; returns it."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
        return x

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Rank 0: the ranks' ``x`` concatenated along ``dim`` (rank order); others: None."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, group=self.device_group, group_dst=0)  # the group's first rank (a stage's, under PP)
        return torch.cat(parts, dim) if parts is not None else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (picklable); every rank returns it."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Rank 0: every rank's ``obj`` in rank order; others: None."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control_group)
        return out

    def barrier(self) -> None:
        """Every rank waits here for the others (the control group): the last step before leaving, so no
        rank tears its sockets down while a peer still has a collective in flight."""
        dist.barrier(group=self.control_group)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. KV blocks that fit on every rank)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())


def init_tp_group(
    rank: int,
    world_size: int,
    device: torch.device,
    store: dist.Store | None = None,
    timeout_s: float = DEVICE_TIMEOUT_S,
    expert_parallel: bool = False,
) -> TPGroup:
    """Joins (or, under torchrun, reuses) the default process group and adds the control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
                                **kwargs)
    if dist.get_world_size() != world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but tensor_parallel_size is "
                         f"{world_size} (run torchrun with --nproc-per-node {world_size})")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(dist.get_rank(), world_size, device, dist.group.WORLD, control, expert_parallel)


def destroy_tp_group() -> None:
    """Leaves the process group (so a later engine in this process can form a new one)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group broken by a dead peer: nothing left to release cleanly
            # said aloud: a group left behind can abort the process at exit (gloo threads at teardown)
            logger.warning("leaving the process group failed: %r", exc)


def abort_tp_group() -> None:
    """Best effort: unblock collectives stuck on a dead peer (NCCL waits, sockets do not tell it)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:
            logger.debug("abort_process_group failed", exc_info=True)


# -- pipeline parallelism ------------------------------------------------------------------------


@dataclass(frozen=True)
class PPStage:
    """This process's pipeline stage: decoder layers ``[start, end)`` of ``num_layers``; the first stage
    also embeds the tokens, the last one holds the final norm and the LM head.

    Ranks: ``rank = pp_rank * tp_size + tp_rank``; stage ``i``'s TP rank ``j`` sends its activations to
    stage ``i + 1``'s TP rank ``j`` (``next_rank``), and the last stage's TP rank 0 sends the logits to
    global rank 0 (the engine)."""

    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    start: int
    end: int
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def logits_rank(self) -> int:
        """The rank that sends each step's logits to rank 0: the last stage's TP rank 0."""
        return (self.pp_size - 1) * self.tp_size


def partition_layers(num_layers: int, pp_size: int, partition: str | None = None) -> list[tuple[int, int]]:
    """Each stage's ``[start, end)`` of the decoder layers: contiguous, at least one layer per stage.

    ``partition`` (``pp_layer_partition``, e.g. ``"3,1"``): the layers of each stage in order, summing
    to ``num_layers``; default: as even as possible, the first ``num_layers % pp_size`` stages one more."""
    if partition is None:
        if num_layers < pp_size:
            raise ValueError(f"pipeline_parallel_size ({pp_size}) is larger than the model's {num_layers} layers")
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + int(i < extra) for i in range(pp_size)]
    else:
        try:
            sizes = [int(x) for x in partition.split(",")]
        except ValueError:
            raise ValueError(f"pp_layer_partition {partition!r}: expected comma-separated layer counts") from None
        if len(sizes) != pp_size or min(sizes) < 1 or sum(sizes) != num_layers:
            raise ValueError(f"pp_layer_partition {partition!r}: needs {pp_size} positive layer counts (one per "
                             f"pipeline stage) summing to the model's {num_layers} layers")
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


@dataclass(eq=False)
class PipelineGroups:
    """The groups of a TP x PP world: ``world`` (every rank: the control group's collectives and the
    point-to-point sends), ``tp`` (this stage's tensor-parallel group, None at tensor_parallel_size 1)."""

    world: TPGroup
    tp: TPGroup | None
    stage: PPStage


def init_pipeline_groups(rank: int, tp_size: int, pp_size: int, bounds: list[tuple[int, int]], num_layers: int,
                         device: torch.device, store: dist.Store | None = None,
                         expert_parallel: bool = False) -> PipelineGroups:
    """Joins the default group of ``tp_size * pp_size`` ranks, adds the control group, then one
    device subgroup per stage (every rank creates every group, in the same order)."""
    world_size = tp_size * pp_size
    world = init_tp_group(rank, world_size, device, store, expert_parallel=expert_parallel)
    backend = "nccl" if device.type == "cuda" else "gloo"
    subgroups = [dist.new_group(list(range(p * tp_size, (p + 1) * tp_size)), backend=backend,
                                timeout=timedelta(seconds=DEVICE_TIMEOUT_S)) for p in range(pp_size)]
    pp_rank, tp_rank = divmod(rank, tp_size)
    start, end = bounds[pp_rank]
    stage = PPStage(pp_rank, pp_size, tp_rank, tp_size, start, end, num_layers)
    tp = TPGroup(tp_rank, tp_size, device, subgroups[pp_rank], None, expert_parallel) if tp_size > 1 else None
    return PipelineGroups(world, tp, stage)


_TAG_MOD = 1 << 24  # gloo tags stay small: message counters wrap


def pipeline_tag(seq: int) -> int:
    """The point-to-point tag of step ``seq``'s activations and logits (both ends count the steps)."""
    return seq % _TAG_MOD


class ObjectChannel:
    """Picklable objects from rank 0 to one peer, point to point on the control group: a send never
    waits for the receiver (it is queued; ``prune`` waits for the oldest ones), so rank 0 runs stage 0
    of the next micro-batch while later stages still work. Each message is a length then the bytes,
    tagged by a counter both ends keep."""

    def __init__(self, group: Any, peer: int, keep: int = 16) -> None:
        self.group, self.peer = group, peer
        self.keep = keep  # sends left unwaited (messages; a command is two): more than the steps in flight
        self.count = 0
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def _tags(self) -> tuple[int, int]:
        n = self.count
        self.count += 1
        return (2 * n) % _TAG_MOD, (2 * n + 1) % _TAG_MOD

    def send(self, obj: Any) -> None:
        import pickle

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        t_size, t_data = self._tags()
        self.pending.append((dist.isend(size, self.peer, group=self.group, tag=t_size), size))
        self.pending.append((dist.isend(data, self.peer, group=self.group, tag=t_data), data))
        self.prune(self.keep)

    def recv(self) -> Any:
        import pickle

        t_size, t_data = self._tags()
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, self.peer, group=self.group, tag=t_size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, self.peer, group=self.group, tag=t_data)
        return pickle.loads(data.numpy().tobytes())

    def prune(self, keep: int = 0) -> None:
        """Waits for all but the ``keep`` most recent sends (their buffers must live until then)."""
        while len(self.pending) > keep:
            work, _ = self.pending.pop(0)
            work.wait()
