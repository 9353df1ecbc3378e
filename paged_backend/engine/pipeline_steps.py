"""Pipeline parallelism's micro-batches: up to ``pipeline_parallel_size`` steps in flight.

    step():  while fewer than depth steps are in flight and the scheduler has work:
                 schedule a micro-batch of requests not in flight (at most ceil(live / depth) of them)
                 runner.submit(sched)     rank 0 runs stage 0, the later stages follow on their own
             wait for the oldest step's logits, sample on the host, process its outputs

A request whose sampled token is in flight has ``num_pending = 1`` and the scheduler skips it
(``Scheduler.skip_in_flight``) until the token lands, so micro-batches hold disjoint decoding
requests; a prompt's next chunk may follow its previous one (each stage runs the steps in order).
A request preempted or aborted while in flight keeps its row; its token is dropped or appended
as under async scheduling (section 2.4 of docs/ARCHITECTURE.md). vLLM v1 keeps the same number
of batches in flight.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_backend.engine.step_sampling import LaunchedStep
from paged_backend.outputs import RequestOutput

if TYPE_CHECKING:
    from paged_backend.core.scheduler import SchedulerOutput
    from paged_backend.engine.request_state import RequestGroup, Row


@dataclass(eq=False)
class _InFlight:
    sched: SchedulerOutput
    pending: Any  # worker/pipeline_parallel.py PendingStep
    rows: list[Row]
    index: list[int] | None
    forking: list[RequestGroup]


class PipelinedSteps:
    """The engine's step under pipeline parallelism (``LLMEngine.step`` hands over to ``step``)."""

    def __init__(self, engine: Any, depth: int) -> None:  # the LLMEngine (not imported: it imports this)
        self.engine = engine
        self.depth = depth
        self.in_flight: deque[_InFlight] = deque()
        self.max_in_flight = 0  # the most micro-batches in flight at once, as the engine saw them

    def step(self) -> list[RequestOutput]:
        e = self.engine
        sched_ = e.scheduler
        while len(self.in_flight) < self.depth:
            live = sched_.num_running + sched_.num_waiting
            sched = sched_.schedule(max_seqs=max(1, -(-live // self.depth)))
            if sched.preempted:
                e.stats.on_preemptions(len(sched.preempted))
            if sched.is_empty:
                break
            pending = e.runner.submit(sched)
            ids = pending.out.sample_request_ids
            if e.parallel.forking:
                rows, index, forking = e.parallel.rows(ids, e.samples)
            else:
                rows, index, forking = [e.samples[rid] for rid in ids], None, []
            for _, sample in rows:
                sample.request.num_pending = 1
            self.in_flight.append(_InFlight(sched, pending, rows, index, forking))
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        if not self.in_flight:
            return []
        f = self.in_flight.popleft()
        out = e.runner.wait(f.pending)
        for _, sample in f.rows:
            sample.request.num_pending = 0
        return e._finish(e._launch_sampling(LaunchedStep(f.sched, out, f.rows, f.forking), f.index))
