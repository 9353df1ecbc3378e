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
        dist.gather(x, parts, dst=0, group=self.device_group)
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
        except Exception:  # a group broken by a dead peer: nothing left to release cleanly
            logger.debug("destroy_process_group failed", exc_info=True)


def abort_tp_group() -> None:
    """Best effort: unblock collectives stuck on a dead peer (NCCL waits, sockets do not tell it)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:
            logger.debug("abort_process_group failed", exc_info=True)
