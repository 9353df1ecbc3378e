"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with new inputs.

A decode-only step (every request has one new token) of ``S`` requests is padded to the
smallest captured size ``B >= S`` (padding rows: see ``step_inputs.py``) and runs as one
graph replay instead of hundreds of kernel launches. Graphs are captured over slices of
the step-input builder's device buffers, which never move, so filling those buffers is
all a replay needs. Attention is captured with ``max_seq_len = max_model_len`` (an upper
bound: the kernel reads each row's real length from ``seq_lens``), so one graph serves
every context length. Sizes: 1, 2, 4, multiples of 8 to 256, of 16 to 512, of 32 beyond
(as many graphs as vLLM's 1..512 list, but reaching 1024 rows: a W2-sized decode batch of
~1000 requests launched eagerly spends more host time launching than the GPU spends running).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from paged_backend.worker.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, min(max_size, 256) + 1, 8))
    sizes += list(range(272, min(max_size, 512) + 1, 16)) + list(range(544, max_size + 1, 32))
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


class DecodeGraphs:
    """Captured forward passes (embedding .. final norm) of decode batches of fixed sizes."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor],
                 inputs: StepInputBuilder, max_size: int, max_model_len: int) -> None:
        self.forward = forward
        self.inputs = inputs
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_seqs: int) -> int | None:
        """The captured size a decode batch of ``num_seqs`` pads to (None: run eagerly)."""
        if num_seqs > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    @torch.inference_mode()
    def capture(self, sliding_window: int | None) -> None:
        """Largest first, all in one memory pool (smaller graphs reuse the big one's blocks)."""
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            step = self._dummy_inputs(size, sliding_window)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile / autotune every kernel outside the capture
                    self.forward(step.input_ids, step.positions, step.meta)
            torch.cuda.current_stream().wait_stream(stream)
            step.meta.step_cache.clear()  # device scratch made per step (latent attention's row positions)
            graph = torch.cuda.CUDAGraph()  # must be made inside the graph, not read from the warm-up's
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.forward(step.input_ids, step.positions, step.meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size], self.outputs[size] = graph, out
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batches of 1..%d in %.1f s",
                    len(self.sizes), self.max_size, time.perf_counter() - t0)

    def _dummy_inputs(self, size: int, sliding_window: int | None) -> StepInputs:
        """A batch of ``size`` padding rows (no slot written, null-block reads)."""
        sched = _EmptySchedule()
        return self.inputs.build(sched, pad_to=size, max_seq_len_bound=self.max_model_len,
                                 sliding_window=sliding_window)

    def replay(self, size: int) -> torch.Tensor:
        """Runs the graph of ``size`` on the buffers' current contents; [size, hidden]."""
        self.graphs[size].replay()
        return self.outputs[size]


class _EmptySchedule:
    scheduled: list = []
