"""The model runner protocol: what the engine calls on the model, wherever it runs.

``ModelRunner`` (worker/model_runner.py) runs the whole model in this process;
``TensorParallelRunner`` (worker/tensor_parallel.py) runs rank 0's slice here and mirrors
every call on the other ranks. The engine holds one of them and uses nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from paged_backend.core.scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    """Logits rows to sample, in the order of ``sample_request_ids``."""

    sample_request_ids: list[str]  # one per row; a request with k draft tokens has k + 1 rows in a row
    logits: torch.Tensor  # [num_samples, vocab] float32
    # request id -> (logits [n, vocab] float32 for prompt positions start..start+n-1)
    prompt_logits: dict[str, tuple[int, torch.Tensor]]


class ModelRunnerProtocol(Protocol):
    """Sizes the KV cache, allocates it, then executes the scheduler's steps."""

    kv_dtype: torch.dtype
    num_blocks: int  # KV blocks allocated (incl. the null block 0); 0 before allocate_kv_cache
    num_host_blocks: int  # host-tier blocks (swap_space; incl. a null block 0); 0 without one
    num_kv_heads: int  # KV heads whose cache this process holds
    step_counts: dict[str, int]  # forward passes by path ("graph", "eager")

    @property
    def bytes_per_block(self) -> int:
        """KV-cache bytes one block takes in this process (every layer, K and V)."""
        ...

    def determine_num_blocks(self, shared_bytes_per_block: int = 0) -> int:
        """The KV blocks the memory budget allows (on every rank); ``shared_bytes_per_block``: what
        another cache on the same block ids (a draft model's) adds to each block's bytes."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocates the cache (then warms up kernels and captures CUDA graphs where they apply)."""
        ...

    def execute(self, sched: SchedulerOutput, prev: tuple[list[str], torch.Tensor] | None = None
                ) -> ModelOutput:
        """Queues the step's forward pass; ``prev``: the step in flight's sampled request ids and
        token ids (device), for this step's placeholder tokens (async scheduling). A runner whose
        ``takes_pending_tokens`` is true also takes ``step_inputs.PendingTokens`` there: it asks for them
        after building this step's inputs and before queueing its forward pass."""
        ...

    def shutdown(self) -> None:
        """Releases what the runner started (processes, process groups); idempotent."""
        ...
