"""A scheduler over a real KVCacheManager and a host SwapSpace, stepped without a model (no torch): each
scheduled request that samples gets the next output token, and finishes at its max_tokens. Shared by
the swap and host-prefix-tier tests of tests/core."""

from __future__ import annotations

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.scheduler import Scheduler, SchedulerOutput
from paged_backend.core.swap import SWAP_MIN_TOKENS, SwapSpace
from paged_backend.sampling_params import SamplingParams


class SwapSim:
    def __init__(self, *, device_blocks: int = 7, host_blocks: int = 9, mode: str | None = "swap",
                 min_tokens: int = SWAP_MIN_TOKENS, max_num_seqs: int = 8, block_size: int = 4,
                 caching: bool = True) -> None:
        self.kv = KVCacheManager(device_blocks, block_size, caching)
        self.swap = SwapSpace(host_blocks, block_size, mode, min_tokens)
        self.sched = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                               swap=self.swap)
        self.reqs: dict[str, Request] = {}

    def add(self, req_id: str, tokens: list[int], max_tokens: int, arrival: float | None = None) -> Request:
        arrival = float(len(self.reqs)) if arrival is None else arrival
        req = Request(req_id, tokens, SamplingParams(), max_tokens=max_tokens, arrival_time=arrival)
        self.reqs[req_id] = req
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        for s in out.scheduled:
            if s.samples:
                req = self.reqs[s.request_id]
                req.append_output_token(900 + req.num_output_tokens)
                if req.num_output_tokens >= req.max_tokens:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
        return out

    def assert_all_free(self) -> None:
        """Nothing left to run, every block of both pools free."""
        assert not self.sched.has_work()
        assert self.kv.num_free_blocks == self.kv.block_pool.num_total_usable
        assert self.swap.num_free_blocks == self.swap.num_total_usable
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks + self.swap.pool.blocks)


def rows(out: SchedulerOutput) -> list[tuple[str, int, int, list[int]]]:
    return [(s.request_id, s.start_pos, s.num_new_tokens, list(s.block_ids)) for s in out.scheduled]
