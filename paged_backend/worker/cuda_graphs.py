"""CUDA graphs for decode steps: one graph per (query length, batch-size bucket), replayed with new inputs.

A uniform step (every request has the same number ``q`` of new tokens: ``q`` = 1 for a plain decode
step, ``1 + k`` for speculative decoding's verification of ``k`` drafts) of ``S`` requests is padded
to the smallest captured size ``B >= S`` for that ``q`` (padding rows: see ``step_inputs.py``) and runs
as one graph replay instead of hundreds of kernel launches. A step whose requests have fewer than ``q``
new tokens (some verifications have fewer drafts) may replay the ``q`` graph with each request spread
over ``q`` rows (``StepInputBuilder.build``'s ``pad_query_len``; ``ModelRunner._graph_shape`` decides).

Graphs are captured over slices of the step-input builder's device buffers, which never move, so
filling those buffers is all a replay needs. Attention is captured with ``max_seq_len =
max_model_len`` (an upper bound: the kernel reads each row's real length from ``seq_lens``) and
``max_query_len = q`` (every row has q tokens, padding included; the causal mask within a row's
tokens comes from ``seq_lens`` and ``query_start_loc`` on the device), so one graph serves every
context length. Sizes: 1, 2, 4, multiples of 8 to 256, of 16 to 512, of 32 beyond (as many graphs
as vLLM's 1..512 list, but reaching 1024 rows: a W2-sized decode batch of ~1000 requests launched
eagerly spends more host time launching than the GPU spends running). A multi-token ``q`` gets the
sizes up to ``max_size`` whose ``B * q`` tokens fit the step buffers.
"""

from __future__ import annotations

import bisect
import collections
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
    """Captured forward passes (embedding .. final norm) of uniform batches of fixed shapes: ``query_lens``
    new tokens per request (1: decode; 1 + k: a verification of k drafts), batch-size buckets each."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor],
                 inputs: StepInputBuilder, max_size: int, max_model_len: int,
                 query_lens: tuple[int, ...] = (1,)) -> None:
        self.forward = forward
        self.inputs = inputs
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_size)  # the decode (q = 1) sizes
        self.sizes_by_q: dict[int, list[int]] = {1: self.sizes}
        for q in sorted(set(query_lens) - {1}):
            fit = min(max_size, inputs.max_tokens // q)
            if fit >= 1 and q <= max_model_len:
                self.sizes_by_q[q] = capture_sizes(fit)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (q, size) -> graph
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.prenorm: dict[tuple[int, int], torch.Tensor] = {}  # what a model with MTP layers also keeps, by shape
        self.replays: collections.Counter[int] = collections.Counter()  # replays by query length
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_seqs: int, q: int = 1) -> int | None:
        """The captured size a uniform batch of ``num_seqs`` requests of ``q`` new tokens pads to (None: run
        eagerly)."""
        sizes = self.sizes_by_q.get(q)
        if sizes is None or num_seqs > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, num_seqs)]

    def query_len_for(self, most: int) -> int | None:
        """The smallest captured query length of at least ``most`` new tokens (None: none)."""
        fit = [q for q in self.sizes_by_q if q >= most]
        return min(fit) if fit else None

    def describe(self) -> str:
        """The captured shapes, for the start-up log."""
        qs = sorted({q for q, _ in self.graphs})
        return ", ".join(f"{q} token{'s' if q > 1 else ''} x 1..{max(s for qq, s in self.graphs if qq == q)}"
                         for q in qs)

    @torch.inference_mode()
    def capture(self, sliding_window: int | None) -> None:
        """Most tokens first, all in one memory pool (smaller graphs reuse the big one's blocks). A query
        length whose capture fails (a layer that cannot be captured at that shape) is dropped with a
        warning: its steps run eagerly."""
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        shapes = sorted(((q, size) for q, sizes in self.sizes_by_q.items() for size in sizes),
                        key=lambda qs: (qs[0] * qs[1], qs[0]), reverse=True)
        failed: set[int] = set()
        for q, size in shapes:
            if q in failed:
                continue
            try:
                self._capture_one(q, size, sliding_window, stream)
            except Exception as exc:
                if q == 1:
                    raise
                torch.cuda.synchronize()
                logger.warning("CUDA graphs of %d-token steps not captured (they run eagerly): %s", q, exc)
                failed.add(q)
                for key in [k for k in self.graphs if k[0] == q]:
                    del self.graphs[key], self.outputs[key]
                    self.prenorm.pop(key, None)
        for q in failed:
            del self.sizes_by_q[q]
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (%s) in %.1f s", len(self.graphs), self.describe(),
                    time.perf_counter() - t0)

    def _capture_one(self, q: int, size: int, sliding_window: int | None, stream: torch.cuda.Stream) -> None:
        step = self._dummy_inputs(size, q, sliding_window)
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
        self.graphs[q, size], self.outputs[q, size] = graph, out

    def _dummy_inputs(self, size: int, q: int, sliding_window: int | None) -> StepInputs:
        """A batch of ``size`` padding rows of ``q`` tokens (no slot written, null-block reads)."""
        sched = _EmptySchedule()
        return self.inputs.build(sched, pad_to=size, max_seq_len_bound=self.max_model_len,
                                 sliding_window=sliding_window, pad_query_len=q)

    def replay(self, size: int, q: int = 1) -> torch.Tensor:
        """Runs the graph of (``q``, ``size``) on the buffers' current contents; [size * q, hidden]."""
        self.graphs[q, size].replay()
        self.replays[q] += 1
        return self.outputs[q, size]


class _EmptySchedule:
    scheduled: list = []
