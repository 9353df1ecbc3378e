"""Continuous batching under a token budget; no prefill or decode phase.

Each step the scheduler walks the running requests (oldest first), then admits waiting
ones (FCFS), giving each ``min(num_tokens - num_computed_tokens, budget left)`` new
tokens: a whole prompt, a chunk of it, the recompute of a preempted request or one
decode token are the same thing. When the KV-cache manager cannot provide a block, the
most recently arrived running request is preempted by recompute (its blocks are freed,
it goes back to the front of the waiting queue; nothing it generated is lost).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from paged_backend.kv_cache_manager import KVCacheManager
from paged_backend.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """What the model runner needs to compute for one request this step."""

    request: Request
    start_pos: int  # == num_computed_tokens before this step
    num_new_tokens: int
    block_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start_pos : self.start_pos + self.num_new_tokens]

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last known token: its logits are sampled."""
        return self.start_pos + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose KV is already in place (a fork of an n > 1 parent)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished (stopped, length or aborted) and free its blocks now."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        self.kv.free(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            if num_new == 0:
                i += 1
                continue
            while True:
                if self.kv.allocate_slots(req, num_new) is not None:
                    break
                victim = max(self.running, key=lambda r: (r.arrival_time, r.request_id))
                if victim.request_id in scheduled_ids:
                    # never preempt what this step already computes: preempt req instead
                    victim = req
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; the list shifted, i stays
            out.scheduled.append(self._record(req, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
            i += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                computed, num_cached = [], 0
                if req.sampling_params.prompt_logprobs is None:
                    computed, num_cached = self.kv.get_computed_blocks(req)
                num_new = self._num_new_tokens(req, budget, num_cached)
                if num_new == 0:
                    break
                if self.kv.allocate_slots(req, num_new, computed) is None:
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_cached
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(self._record(req, num_new))
                budget -= num_new

        out.blocks_to_copy = self.kv.take_pending_copies()
        return out

    def _num_new_tokens(self, req: Request, budget: int, num_cached: int | None = None) -> int:
        computed = req.num_computed_tokens if num_cached is None else num_cached
        num_new = req.num_tokens - computed
        if num_new > budget:
            if not self.chunked:
                return 0
            num_new = budget
        return max(0, num_new)

    def _record(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        return ScheduledRequest(req, start, num_new, self.kv.get_block_ids(req.request_id))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
