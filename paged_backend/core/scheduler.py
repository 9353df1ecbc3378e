"""Continuous batching under a token budget; no prefill or decode phase.

Each step the scheduler walks the running requests (oldest first), then admits waiting
ones (FCFS), giving each ``min(num_tokens - num_computed_tokens, budget left)`` new
tokens: a whole prompt, a chunk of it, the recompute of a preempted request or one
decode token are the same thing. A decoding request with draft tokens (speculative decoding,
``request.spec_token_ids``) gets 1 + k tokens: its last token and the k drafts, verified by the
step; ``rollback_drafts`` then forgets the rejected positions. When the KV-cache manager cannot provide a block, the
most recently arrived running request is preempted: by recompute (its blocks are freed,
it goes back to the front of the waiting queue; nothing it generated is lost), or, with a host
tier (``SwapSpace``, core/swap.py) whose rule says so, by swap (its computed blocks are copied to
host blocks, its device blocks freed; it waits in the swapped queue and resumes, before any waiting
request is admitted, by copying them back into new device blocks, without recomputing). With prefix
caching the host tier is also the prefix cache's second tier: a waiting request's prefix continues
there past its device hit, and the step copies those blocks back (``KVCacheManager.attach_host_tier``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.swap import SwapSpace

_new_tokens_of = attrgetter("num_new_tokens")


class ScheduledRequest:
    """What the model runner computes for one request this step: plain data, no live request.

    A snapshot taken when scheduled: ``token_ids`` (the tokens to compute), ``samples`` (this
    step reaches the request's last token: its logits are sampled) and ``num_prompt_logits``
    (prompt positions whose logits are wanted: ``num_prompt_tokens - 1`` when the request asks
    for prompt logprobs, else 0). Slots keep the runner's per-request reads plain attribute
    reads, and the snapshot pickles as is (tensor parallelism broadcasts the whole
    ``SchedulerOutput``). Under async scheduling the last token may still be on the device
    (``request.num_pending``): it shows as -1 in ``token_ids`` and the runner copies it from
    the previous step's sampled ids. ``num_draft``: the last ``num_draft`` of ``token_ids`` are
    draft tokens (speculative decoding); the runner returns ``num_draft + 1`` logits rows for the
    request, the positions of its last known token and of each draft.
    """

    __slots__ = ("request_id", "start_pos", "num_new_tokens", "block_ids", "token_ids", "samples",
                 "num_prompt_logits", "num_draft")

    def __init__(self, request: Request, start_pos: int, num_new_tokens: int, block_ids: list[int],
                 samples: bool | None = None, draft_ids: list[int] | None = None) -> None:
        self.request_id: str = request.request_id
        self.start_pos = start_pos  # == num_computed_tokens before this step
        self.num_new_tokens = num_new_tokens
        self.block_ids = block_ids
        self.num_prompt_logits: int = request.num_prompt_logits
        end = start_pos + num_new_tokens
        all_ids = request.all_token_ids
        known = len(all_ids)
        if end <= known:
            self.token_ids: list[int] = all_ids[start_pos:end]
        else:  # tokens sampled by the step in flight: placeholders
            self.token_ids = all_ids[start_pos:] + [-1] * (end - known)
        self.samples: bool = end == known + request.num_pending if samples is None else samples
        self.num_draft = 0
        if draft_ids:  # the last known token, then the drafts
            self.token_ids = all_ids[start_pos:known] + draft_ids
            self.num_draft = len(draft_ids)

    @classmethod
    def lookahead(cls, request_id: str, pos: int, token: int, block_ids: list[int]) -> ScheduledRequest:
        """One token at ``pos`` whose logits are sampled, outside the scheduler's plan: a draft
        model's autoregressive pass over blocks the request already holds."""
        s = cls.__new__(cls)
        s.request_id, s.start_pos, s.num_new_tokens, s.block_ids = request_id, pos, 1, block_ids
        s.token_ids, s.samples, s.num_prompt_logits, s.num_draft = [token], True, 0, 0
        return s

    def __repr__(self) -> str:
        drafts = f", drafts={self.num_draft}" if self.num_draft else ""
        return (f"ScheduledRequest({self.request_id!r}, start_pos={self.start_pos}, "
                f"num_new_tokens={self.num_new_tokens}{drafts}, blocks={self.block_ids})")


@dataclass
class SchedulerOutput:
    """One step's plan, plain data: what every rank's model runner executes."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[str] = field(default_factory=list)
    # the host tier: (device, host) copies of requests swapped out this step and of evicted cached
    # blocks written back, then (host, device) copies of requests swapped back in and of prefix hits
    # in the host tier; the runner applies them in that order, before blocks_to_copy
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(map(_new_tokens_of, self.scheduled))

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_draft for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        swap: SwapSpace | None = None,
        skip_in_flight: bool = False,
    ) -> None:
        self.kv = kv_manager
        # pipeline parallelism and speculative decoding under async scheduling: a request whose sampled tokens
        # are in flight (num_pending) is not scheduled until they land (how many a verification keeps is not
        # known before; plain async scheduling instead schedules it with a placeholder)
        self.skip_in_flight = skip_in_flight
        self.swap = swap  # the host tier (None: preemption always recomputes)
        if swap is not None:
            kv_manager.attach_host_tier(swap)  # with prefix caching, the prefix cache's second tier
        # swap-out copies of a step that scheduled nothing (so ran nothing): the next step's run does them first
        self._unrun_swap_out: list[tuple[int, int]] = []
        self.swapped: deque[Request] = deque()  # swapped out, resumed from the front before any waiting request
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self._step = 0  # counts schedule() calls; marks which requests this step already took

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
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.swap.free(request.request_id)
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

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_requests(self) -> int:
        """Every request held: running, waiting and swapped."""
        return len(self.running) + len(self.waiting) + len(self.swapped)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    # -- one step ---------------------------------------------------------------------

    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """``max_seqs``: at most that many requests in this step (pipeline parallelism's micro-batches)."""
        out = SchedulerOutput()
        if max_seqs is None:
            max_seqs = 1 << 62
        budget = self.max_num_batched_tokens
        self._step = step = self._step + 1
        # the running loop is the per-step cost of every decode: plain attributes, no helpers
        running, kv, chunked = self.running, self.kv, self.chunked
        scheduled, block_ids, quiet_end = out.scheduled, kv.req_block_ids, kv.quiet_end

        i = 0
        max_len = self.max_model_len
        while i < len(running) and budget > 0:
            req = running[i]
            start = req.num_computed_tokens
            pending = req.num_pending
            num_new = len(req.all_token_ids) + pending - start
            if pending and (self.skip_in_flight or len(req.output_token_ids) + pending >= req.max_tokens
                            or len(req.all_token_ids) + pending >= max_len):
                i += 1  # the token in flight is its last: nothing more to compute
                continue
            samples = True  # this step reaches the last token
            if num_new > budget:
                if not chunked:
                    i += 1
                    continue
                num_new, samples = budget, False
            if num_new <= 0:
                i += 1
                continue
            drafts = req.spec_token_ids
            if drafts:
                drafts = self._fit_drafts(req, num_new, budget)
                num_new += len(drafts)
            # most decode steps write into the current block without filling it: no KV call
            allocate = start + num_new >= quiet_end.get(req.request_id, 0)
            if drafts and allocate:
                allocate = kv.allocate_slots(req, num_new) is None
                if allocate:  # no room for the drafts: the step without them
                    num_new -= len(drafts)
                    drafts = req.spec_token_ids = []
            if allocate and kv.allocate_slots(req, num_new) is None:
                while True:
                    victim = max(running, key=lambda r: (r.arrival_time, r.request_id))
                    if victim.scheduled_step == step:
                        # never preempt what this step already computes: preempt req instead
                        victim = req
                    elif running.index(victim) < i:  # one this loop passed over: req's index shifts
                        i -= 1
                    self._preempt(victim, out)
                    if victim is req or kv.allocate_slots(req, num_new) is not None:
                        break
                if victim is req:
                    continue  # req itself was preempted; the list shifted, i stays
            req.num_computed_tokens = start + num_new
            req.scheduled_step = step
            # the manager's list itself: it is never changed in place (a new list when the blocks
            # change), so it is a snapshot, and the step-input builder skips rows it already holds
            scheduled.append(ScheduledRequest(req, start, num_new, block_ids[req.request_id], samples, drafts))
            budget -= num_new
            i += 1
            if len(scheduled) >= max_seqs:
                break

        if not out.preempted and self.swapped:
            budget = self._swap_in(out, budget)
        if not out.preempted and not self.swapped:
            while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
                   and len(out.scheduled) < max_seqs):
                req = self.waiting[0]
                if req.num_pending:  # preempted while its last token was in flight: next step
                    break
                computed, num_cached, host = [], 0, []
                if req.sampling_params.prompt_logprobs is None:
                    computed, num_cached = self.kv.get_computed_blocks(req)
                    host = self.kv.get_host_computed_blocks(req, len(computed))
                    num_cached += len(host) * self.kv.block_size
                num_new = self._num_new_tokens(req, budget, num_cached)
                if num_new == 0:
                    break
                if self.kv.allocate_slots(req, num_new, computed, host) is None:
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_cached
                    req.first_scheduled_time = time.monotonic()
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                req.scheduled_step = step
                self.running.append(req)
                out.scheduled.append(self._record(req, num_new))
                budget -= num_new

        out.blocks_to_copy = self.kv.take_pending_copies()
        if self.swap is not None:
            # the prefix tier's copies, and the host blocks this step's swap-ins read given back (from the
            # tier itself: without prefix caching it is not attached to the KV manager)
            write_backs, loads = self.swap.take_copies()
            out.blocks_to_swap_out = self._unrun_swap_out + out.blocks_to_swap_out + write_backs
            out.blocks_to_swap_in += loads
            self._unrun_swap_out = []
            if not out.scheduled:  # the engine runs no step without a request: keep the copies for the next
                self._unrun_swap_out, out.blocks_to_swap_out = out.blocks_to_swap_out, []
        return out

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Resume swapped-out requests, oldest first: new device blocks for their computed tokens and
        this step's new ones, the host copies queued in ``blocks_to_swap_in``; they compute at once."""
        swap, kv = self.swap, self.kv
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            if req.num_pending:  # swapped out while its last token was in flight: next step
                break
            num_new = min(len(req.all_token_ids) - req.num_computed_tokens, budget)
            if num_new <= 0 or (num_new < len(req.all_token_ids) - req.num_computed_tokens and not self.chunked):
                break
            # its leading full blocks still cached on the device (freed at swap out, not reused since) are
            # taken back in place; only the others are copied from the host
            computed = req.num_computed_tokens
            run = kv.get_cached_run(req, min(computed // kv.block_size, len(swap.host_block_ids(req.request_id))))
            req.num_computed_tokens = computed - len(run) * kv.block_size  # allocate_slots counts the run back
            allocated = kv.allocate_slots(req, num_new, run)
            req.num_computed_tokens = computed
            if allocated is None:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += swap.swap_in(req.request_id, kv.req_block_ids[req.request_id], len(run))
            req.status = RequestStatus.RUNNING
            req.scheduled_step = self._step
            self.running.append(req)
            out.scheduled.append(self._record(req, num_new))
            budget -= num_new
        return budget

    def _fit_drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts that this step can verify: only with its last token alone to compute,
        within the token budget, max_tokens and max_model_len (a draft past them is never kept)."""
        drafts = req.spec_token_ids
        k = 0
        if num_new == 1:
            k = min(len(drafts), budget - 1, req.max_tokens - len(req.output_token_ids) - 1,
                    self.max_model_len - len(req.all_token_ids) - 1)
        if k < len(drafts):
            drafts = req.spec_token_ids = drafts[:max(k, 0)]
        return drafts

    def rollback_drafts(self, req: Request, num_rejected: int) -> None:
        """A verification step kept all but ``num_rejected`` of the request's scheduled drafts: its
        computed tokens stop before them and the blocks only they reached are freed."""
        req.spec_token_ids = []
        # a request preempted (by recompute: see _preempt) or finished while its step was in flight has no
        # computed positions to give back
        if num_rejected and req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= num_rejected
            self.kv.trim(req)

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
        # drafts still being verified (async scheduling): how many positions the request keeps is unknown
        # until they land, so it is recomputed rather than swapped (its blocks' count would not be known)
        verifying = bool(req.num_pending and req.spec_token_ids)
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        swap = self.swap
        if swap is not None and not verifying and swap.should_swap(req.num_computed_tokens):
            # the blocks holding computed tokens go to the host; the copies run before this step's
            # forward (which may reuse the freed device blocks), and the request keeps its progress
            held = self.kv.req_block_ids.get(req.request_id, [])
            full = req.block_hashes[:req.num_computed_tokens // self.kv.block_size]  # cached there too
            out.blocks_to_swap_out += swap.swap_out(req.request_id, held[:swap.blocks_needed(req.num_computed_tokens)],
                                                    full)
            self.kv.free(req)
            req.status = RequestStatus.SWAPPED
            self.swapped.appendleft(req)  # a later victim arrived earlier: it resumes first
            self.num_swap_preemptions += 1
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
