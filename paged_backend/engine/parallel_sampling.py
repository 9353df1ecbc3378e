"""Parallel sampling (``n > 1``): one prompt computed once, n samples forked from it.

A request of n samples enters the scheduler as sample 0 alone. The step that completes its
prompt samples n tokens from the same logits row (the other samples' rows repeat it), then
samples 1..n-1 fork sample 0's blocks (shared by reference; the partial last block is
copied on write) and join the running queue with their first token already sampled.
"""

from __future__ import annotations

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.scheduler import Scheduler
from paged_backend.engine.request_state import RequestGroup, Row, SampleState


class ParallelSampling:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.forking: set[str] = set()  # n > 1 requests whose samples have not forked yet

    def add(self, group: RequestGroup) -> None:
        if group.pending_forks:
            self.forking.add(group.prep.request_id)

    def drop(self, group: RequestGroup) -> None:
        """An aborted request forks nothing more."""
        group.pending_forks = []
        self.forking.discard(group.prep.request_id)

    def rows(self, request_ids: list[str], samples: dict[str, Row]
             ) -> tuple[list[Row], list[int] | None, list[RequestGroup]]:
        """A step's rows when some request still has to fork: its children get rows repeating the
        parent's logits row (``index``: the logits row of each row; None when nothing repeats)."""
        rows: list[Row] = []
        forking: list[RequestGroup] = []
        index: list[int] | None = None
        for i, rid in enumerate(request_ids):
            entry = samples[rid]
            rows.append(entry)
            group, sample = entry
            if index is not None:
                index.append(i)
            if group.pending_forks and sample is group.samples[0]:
                forking.append(group)
                if index is None:
                    index = list(range(i + 1))
                for child in group.pending_forks:
                    rows.append((group, child))
                    index.append(i)
        return rows, index, forking

    def fork(self, groups: list[RequestGroup]) -> None:
        """The children of these groups take their parent's blocks (before the parent can finish)."""
        for group in groups:
            for child in group.pending_forks:
                self._fork(group, child)
            group.pending_forks = []
            self.forking.discard(group.prep.request_id)

    def _fork(self, group: RequestGroup, child: SampleState) -> None:
        parent = group.samples[0].request
        req = child.request
        self.kv.fork(parent, req)
        req.num_computed_tokens = parent.num_computed_tokens
        req.num_cached_tokens = parent.num_cached_tokens
        self.scheduler.add_running(req)
