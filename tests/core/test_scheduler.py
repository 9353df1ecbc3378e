"""Scheduler scenarios over a real KVCacheManager, with exact block ids (no torch).

Each test plays the engine between steps (``Sim.step``): every scheduled request that
``samples`` gets one token, and one that reaches max_tokens (or max_model_len) is finished.
Prompts use disjoint token ranges unless a test wants prefix hits.
"""

from __future__ import annotations

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.scheduler import Scheduler, SchedulerOutput
from paged_backend.sampling_params import SamplingParams


def rid(s) -> str:
    return getattr(s, "request_id", None) or s.request.request_id


def make(req_id: str, prompt_len: int, *, first: int, max_tokens: int = 4, arrival: float = 0.0,
         n: int = 1, **kwargs) -> Request:
    params = SamplingParams(n=n, prompt_logprobs=kwargs.pop("prompt_logprobs", None))
    return Request(req_id, list(range(first, first + prompt_len)), params, max_tokens=max_tokens,
                   arrival_time=arrival, **kwargs)


def rows(out: SchedulerOutput) -> list[tuple[str, int, int, list[int], bool]]:
    return [(rid(s), s.start_pos, s.num_new_tokens, list(s.block_ids), s.samples) for s in out.scheduled]


class Sim:
    """A Scheduler on a KVCacheManager, driven the way the synchronous engine drives it."""

    def __init__(self, num_blocks: int = 11, block_size: int = 4, *, max_num_seqs: int = 8,
                 budget: int = 64, max_model_len: int = 64, chunked: bool = True, caching: bool = True) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                               max_model_len=max_model_len, enable_chunked_prefill=chunked)
        self.reqs: dict[str, Request] = {}

    def add(self, *reqs: Request) -> None:
        for req in reqs:
            self.reqs[req.request_id] = req
            self.sched.add_request(req)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        for s in out.scheduled:
            if s.samples:
                req = self.reqs[rid(s)]
                req.append_output_token(900 + req.num_output_tokens)
                if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.sched.max_model_len:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
        return out

    def fork(self, parent: Request, child: Request) -> None:
        """What the engine's ``_fork`` does once the parent's prompt is computed."""
        self.reqs[child.request_id] = child
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.sched.add_running(child)

    @property
    def running(self) -> list[str]:
        return [r.request_id for r in self.sched.running]

    @property
    def waiting(self) -> list[str]:
        return [r.request_id for r in self.sched.waiting]

    def ref_counts(self) -> dict[int, int]:
        return {b.block_id: b.ref_cnt for b in self.kv.block_pool.blocks if b.ref_cnt}


def test_token_budget_split_fcfs_and_chunk_continues() -> None:
    """The budget goes FCFS; the prompt that does not fit is chunked (no sample) and continues next step."""
    sim = Sim(budget=10)
    sim.add(make("a", 3, first=100), make("b", 4, first=200), make("c", 14, first=300))
    out = sim.step()
    assert rows(out) == [("a", 0, 3, [1], True), ("b", 0, 4, [2], True), ("c", 0, 3, [3], False)]
    assert out.num_tokens == 10 and sim.running == ["a", "b", "c"] and sim.waiting == []
    assert sim.reqs["c"].num_output_tokens == 0
    # running first: two decodes, then c's next chunk from where it stopped (still partial)
    assert rows(sim.step()) == [("a", 3, 1, [1], True), ("b", 4, 1, [2, 4], True),
                                ("c", 3, 8, [3, 5, 6], False)]
    assert rows(sim.step()) == [("a", 4, 1, [1, 7], True), ("b", 5, 1, [2, 4], True),
                                ("c", 11, 3, [3, 5, 6, 8], True)]
    assert sim.reqs["c"].num_computed_tokens == 14 and sim.reqs["c"].output_token_ids == [900]


def test_chunked_prefill_off_prompt_waits_behind_decodes() -> None:
    """Without chunked prefill a prompt larger than the budget left waits whole, and blocks the queue."""
    sim = Sim(budget=8, chunked=False)
    sim.add(make("a", 5, first=100, max_tokens=3))
    assert rows(sim.step()) == [("a", 0, 5, [1, 2], True)]
    sim.add(make("b", 8, first=200), make("c", 2, first=300))
    # a's decode takes 1 of 8: b (8) does not fit, and c behind it is not admitted either
    assert rows(sim.step()) == [("a", 5, 1, [1, 2], True)]
    assert sim.waiting == ["b", "c"] and sim.reqs["b"].num_computed_tokens == 0
    assert rows(sim.step()) == [("a", 6, 1, [1, 2], True)]  # a's last token; finished
    assert sim.running == [] and sim.waiting == ["b", "c"]
    assert rows(sim.step()) == [("b", 0, 8, [3, 4], True)]  # the whole budget: c still waits
    assert sim.waiting == ["c"]
    assert rows(sim.step()) == [("b", 8, 1, [3, 4, 5], True), ("c", 0, 2, [6], True)]


def test_decodes_oldest_first_then_admission_and_block_boundaries() -> None:
    """Running requests get one token each in admission order, then waiting ones; a new block per 4 tokens."""
    sim = Sim(block_size=4)
    sim.add(make("a", 3, first=100, max_tokens=7), make("b", 2, first=200, arrival=1.0, max_tokens=8))
    assert rows(sim.step()) == [("a", 0, 3, [1], True), ("b", 0, 2, [2], True)]
    sim.add(make("c", 5, first=300, arrival=2.0))
    assert rows(sim.step()) == [("a", 3, 1, [1], True), ("b", 2, 1, [2], True), ("c", 0, 5, [3, 4], True)]
    assert sim.running == ["a", "b", "c"]
    a_blocks = []
    for _ in range(5):
        a_blocks.append(next(r for r in rows(sim.step()) if r[0] == "a")[1:4])
    # a computes positions 4..8: block 5 from position 4, block 7 from position 8 (b took 6)
    assert a_blocks == [(4, 1, [1, 5]), (5, 1, [1, 5]), (6, 1, [1, 5]), (7, 1, [1, 5]), (8, 1, [1, 5, 7])]
    assert sim.kv.get_block_ids("b") == [2, 6]
    assert sim.reqs["c"].is_finished and sim.kv.get_block_ids("c") == []


def test_max_num_seqs_caps_running_until_one_finishes() -> None:
    """Never more than max_num_seqs running; the next waiting one is admitted once one finishes."""
    sim = Sim(max_num_seqs=2)
    sim.add(make("a", 2, first=100, max_tokens=2), make("b", 2, first=200, max_tokens=4),
            make("c", 2, first=300))
    assert rows(sim.step()) == [("a", 0, 2, [1], True), ("b", 0, 2, [2], True)]
    assert sim.running == ["a", "b"] and sim.waiting == ["c"]
    assert rows(sim.step()) == [("a", 2, 1, [1], True), ("b", 2, 1, [2], True)]  # a finishes
    assert sim.running == ["b"] and sim.waiting == ["c"]
    assert rows(sim.step()) == [("b", 3, 1, [2], True), ("c", 0, 2, [3], True)]
    assert sim.running == ["b", "c"] and sim.waiting == []


def test_preemption_victim_is_latest_arrival_and_recomputes() -> None:
    """Out of blocks, the latest-arrived running request is preempted by recompute and resumed later."""
    sim = Sim(num_blocks=5)  # 4 usable blocks
    sim.add(make("a", 3, first=100, max_tokens=3), make("b", 3, first=200, arrival=1.0, max_tokens=6),
            make("c", 3, first=300, arrival=2.0))
    assert rows(sim.step()) == [("a", 0, 3, [1], True), ("b", 0, 3, [2], True), ("c", 0, 3, [3], True)]
    assert rows(sim.step()) == [("a", 3, 1, [1], True), ("b", 3, 1, [2], True), ("c", 3, 1, [3], True)]
    # a takes the last free block (4); b needs one: c goes, its block 3 is b's now
    out = sim.step()
    assert rows(out) == [("a", 4, 1, [1, 4], True), ("b", 4, 1, [2, 3], True)]
    assert out.preempted == ["c"] and sim.sched.num_preemptions == 1
    c = sim.reqs["c"]
    assert (c.num_computed_tokens, c.status, c.num_preemptions) == (0, RequestStatus.PREEMPTED, 1)
    assert c.output_token_ids == [900, 901] and sim.kv.get_block_ids("c") == []
    assert sim.running == ["b"] and sim.waiting == ["c"]  # a finished at its 3rd token
    # resumed: prompt and both outputs recomputed in a's freed blocks (freed tail first)
    assert rows(sim.step()) == [("b", 5, 1, [2, 3], True), ("c", 0, 5, [4, 1], True)]
    assert c.status == RequestStatus.RUNNING and c.num_cached_tokens == 0


def test_preempting_request_goes_itself_when_latest_already_scheduled() -> None:
    """A request scheduled earlier in the step is never the victim: the one needing a block is preempted."""
    sim = Sim(num_blocks=3)  # 2 usable blocks
    # x is listed first but arrived last: it is the victim by arrival time
    sim.add(make("x", 2, first=100, arrival=2.0, max_tokens=8), make("y", 3, first=200, arrival=1.0))
    assert rows(sim.step()) == [("x", 0, 2, [1], True), ("y", 0, 3, [2], True)]
    assert rows(sim.step()) == [("x", 2, 1, [1], True), ("y", 3, 1, [2], True)]
    out = sim.step()  # y needs a block for position 4; x already took its slot this step
    assert rows(out) == [("x", 3, 1, [1], True)]
    assert out.preempted == ["y"] and sim.running == ["x"] and sim.waiting == ["y"]
    assert sim.kv.num_free_blocks == 1 and sim.reqs["y"].num_computed_tokens == 0


def test_no_admission_in_a_step_that_preempted() -> None:
    """A step that preempted admits no waiting request, even one that would fit; the next step does."""
    sim = Sim(num_blocks=4, budget=5, caching=False)  # 3 usable blocks
    sim.add(make("a", 4, first=100, max_tokens=8), make("c", 5, first=200, arrival=1.0))
    assert rows(sim.step()) == [("a", 0, 4, [1], True), ("c", 0, 1, [2], False)]
    out = sim.step()  # a takes block 3; c's chunk needs another block: c is the latest, it goes
    assert rows(out) == [("a", 4, 1, [1, 3], True)] and out.preempted == ["c"]
    # 4 tokens of budget and block 2 are left, enough for a chunk of c, but nothing is admitted
    assert sim.kv.num_free_blocks == 1 and out.num_tokens == 1 and sim.waiting == ["c"]
    assert rows(sim.step()) == [("a", 5, 1, [1, 3], True), ("c", 0, 4, [2], False)]


def test_resumed_request_hits_its_own_cached_blocks() -> None:
    """A preempted request's full blocks stay cached; on resume it recomputes only what was reused."""
    sim = Sim(num_blocks=5)  # 4 usable blocks
    sim.add(make("a", 4, first=100, max_tokens=2), make("c", 9, first=200, arrival=1.0))
    assert rows(sim.step()) == [("a", 0, 4, [1], True), ("c", 0, 9, [2, 3, 4], True)]
    out = sim.step()  # c's blocks freed tail first: a gets block 4; 2 and 3 keep their hashes
    assert rows(out) == [("a", 4, 1, [1, 4], True)] and out.preempted == ["c"]
    assert rows(sim.step()) == [("c", 8, 2, [2, 3, 4], True)]  # a finished; c hits 8 tokens
    assert sim.reqs["c"].num_cached_tokens == 0  # the hit of its first scheduling


def test_prefix_cache_hit_exact_blocks_and_salt_miss() -> None:
    """A shared prompt prefix reuses the cached full blocks; a different cache_salt gets no hit."""
    sim = Sim()
    prompt = list(range(10))
    sim.add(Request("a", prompt, SamplingParams(), max_tokens=4))
    assert rows(sim.step()) == [("a", 0, 10, [1, 2, 3], True)]
    sim.add(Request("b", prompt[:8] + [50, 51, 52], SamplingParams(), max_tokens=4, arrival_time=1.0),
            Request("s", prompt, SamplingParams(), max_tokens=4, arrival_time=2.0, cache_salt="other"))
    assert rows(sim.step()) == [("a", 10, 1, [1, 2, 3], True), ("b", 8, 3, [1, 2, 4], True),
                                ("s", 0, 10, [5, 6, 7], True)]
    assert [sim.reqs[r].num_cached_tokens for r in "abs"] == [0, 8, 0]
    assert sim.ref_counts() == {1: 2, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (10 + 11 + 10, 8)


def test_prompt_logprobs_request_skips_prefix_cache() -> None:
    """A request asking for prompt logprobs computes its whole prompt, cached prefix or not."""
    sim = Sim()
    sim.add(make("a", 9, first=0))
    assert rows(sim.step()) == [("a", 0, 9, [1, 2, 3], True)]
    sim.add(make("p", 9, first=0, arrival=1.0, prompt_logprobs=1))
    assert rows(sim.step()) == [("a", 9, 1, [1, 2, 3], True), ("p", 0, 9, [4, 5, 6], True)]
    assert sim.reqs["p"].num_cached_tokens == 0 and sim.kv.stats.requests == 1


def test_forks_share_blocks_and_copy_on_write() -> None:
    """Forked samples share the parent's blocks; the first write to the shared partial block copies it."""
    sim = Sim()
    p0, p1, p2 = (make(f"p#{i}", 6, first=100, n=3, max_tokens=3) for i in range(3))
    sim.add(p0, make("d", 2, first=200, arrival=1.0, max_tokens=2))
    out = sim.sched.schedule()
    assert rows(out) == [("p#0", 0, 6, [1, 2], True), ("d", 0, 2, [3], True)]
    sim.fork(p0, p1)
    sim.fork(p0, p2)
    for i, req in enumerate((p0, p1, p2, sim.reqs["d"])):
        req.append_output_token(500 + i)
    assert sim.running == ["p#0", "d", "p#1", "p#2"]
    assert sim.ref_counts() == {1: 3, 2: 3, 3: 1}
    out = sim.step()
    # p#0 and p#1 write into shared block 2: each gets a copy; p#2, its last holder, keeps it
    assert rows(out) == [("p#0", 6, 1, [1, 4], True), ("d", 2, 1, [3], True),
                         ("p#1", 6, 1, [1, 5], True), ("p#2", 6, 1, [1, 2], True)]
    assert out.blocks_to_copy == [(2, 4), (2, 5)]
    assert sim.ref_counts() == {1: 3, 2: 1, 4: 1, 5: 1}
    out = sim.step()
    assert out.blocks_to_copy == [] and [r[0] for r in rows(out)] == ["p#0", "p#1", "p#2"]
    assert sim.running == [] and sim.kv.num_free_blocks == 10


def test_forks_enter_running_past_max_num_seqs() -> None:
    """add_running does not check max_num_seqs: forks run over it, and admission waits until below it."""
    sim = Sim(max_num_seqs=2)
    p0, p1, p2 = (make(f"p#{i}", 5, first=100, n=3, max_tokens=3) for i in range(3))
    sim.add(p0)
    assert rows(sim.sched.schedule()) == [("p#0", 0, 5, [1, 2], True)]
    sim.fork(p0, p1)
    sim.fork(p0, p2)
    for i, req in enumerate((p0, p1, p2)):
        req.append_output_token(500 + i)
    sim.add(make("d", 2, first=200, arrival=1.0))
    assert sim.sched.num_running == 3
    for start in (5, 6):  # the three samples decode; d is not admitted while 3 >= 2 run
        assert [(r[0], r[1]) for r in rows(sim.step())] == [("p#0", start), ("p#1", start), ("p#2", start)]
        assert sim.waiting == ["d"]
    assert sim.running == [] and rows(sim.step()) == [("d", 0, 2, [5], True)]


def test_finish_and_abort_free_blocks_at_once() -> None:
    """Finishing a running request or aborting a waiting one returns every block to the pool now."""
    sim = Sim(max_num_seqs=1)
    free0 = sim.kv.num_free_blocks
    sim.add(make("a", 6, first=100, max_tokens=8), make("w", 3, first=200, arrival=1.0))
    sim.step()
    assert sim.kv.num_free_blocks == free0 - 2 and sim.waiting == ["w"]
    sim.sched.finish(sim.reqs["w"], RequestStatus.FINISHED_ABORTED)  # never scheduled
    assert sim.waiting == [] and sim.reqs["w"].is_finished and sim.kv.num_free_blocks == free0 - 2
    sim.sched.finish(sim.reqs["a"], RequestStatus.FINISHED_ABORTED)
    assert sim.kv.num_free_blocks == free0 and sim.kv.get_block_ids("a") == []
    assert sim.running == [] and not sim.sched.has_work()
    sim.sched.finish(sim.reqs["a"], RequestStatus.FINISHED_STOPPED)  # already finished: no-op
    assert sim.reqs["a"].status == RequestStatus.FINISHED_ABORTED
    assert sim.sched.schedule().is_empty


def test_last_token_at_max_tokens_and_max_model_len_is_not_scheduled() -> None:
    """A request is computed up to the token before its last; sampling the last one ends it."""
    sim = Sim(max_model_len=8)
    sim.add(make("a", 3, first=100, max_tokens=3), make("m", 6, first=200, arrival=1.0, max_tokens=16))
    assert rows(sim.step()) == [("a", 0, 3, [1], True), ("m", 0, 6, [2, 3], True)]
    assert rows(sim.step()) == [("a", 3, 1, [1], True), ("m", 6, 1, [2, 3], True)]  # m reaches 8
    assert sim.reqs["m"].status == RequestStatus.FINISHED_LENGTH and sim.running == ["a"]
    assert rows(sim.step()) == [("a", 4, 1, [1, 4], True)]  # a's 3rd token: 6 tokens, 5 computed
    assert sim.reqs["a"].num_tokens == 6 and sim.reqs["a"].num_computed_tokens == 5
    assert sim.reqs["a"].status == RequestStatus.FINISHED_LENGTH
    assert sim.sched.schedule().is_empty and sim.kv.num_free_blocks == 10


def test_pending_last_token_is_not_scheduled_again() -> None:
    """With a sampled token in flight (num_pending), a request whose in-flight token is its last is skipped."""
    sim = Sim(max_model_len=8)
    a = make("a", 3, first=100, max_tokens=2)
    m = make("m", 6, first=200, arrival=1.0, max_tokens=16)
    sim.add(a, m)
    assert rows(sim.sched.schedule()) == [("a", 0, 3, [1], True), ("m", 0, 6, [2, 3], True)]
    a.num_pending = m.num_pending = 1  # step 1's tokens still on the device
    out = sim.sched.schedule()  # each computes its in-flight token (a placeholder)
    assert rows(out) == [("a", 3, 1, [1], True), ("m", 6, 1, [2, 3], True)]
    assert [s.token_ids for s in out.scheduled] == [[-1], [-1]]
    a.append_output_token(900)  # step 1 lands; step 2 is in flight, num_pending stays 1
    m.append_output_token(900)
    # a's in-flight token is its 2nd of 2, m's the 8th of max_model_len 8: nothing to schedule
    assert sim.sched.schedule().is_empty and sim.running == ["a", "m"]
    a.num_pending = m.num_pending = 0  # step 2 lands: both end there
    for req in (a, m):
        req.append_output_token(901)
        sim.sched.finish(req, RequestStatus.FINISHED_LENGTH)
    assert a.num_output_tokens == 2 and m.num_tokens == 8 and sim.kv.num_free_blocks == 10


def test_preempting_a_request_passed_over_keeps_the_next_one_scheduled() -> None:
    """A victim earlier in the running list (passed over this step) shifts the list: the requests
    after the one that needed its block are still scheduled in the same step."""
    sim = Sim(num_blocks=4)  # 3 usable blocks of 4 tokens
    p = make("p", 3, first=100, arrival=3.0, max_tokens=1)
    q = make("q", 4, first=200, arrival=1.0)
    r = make("r", 3, first=300, arrival=2.0)
    sim.add(p, q, r)
    assert rows(sim.sched.schedule()) == [("p", 0, 3, [1], True), ("q", 0, 4, [2], True),
                                          ("r", 0, 3, [3], True)]
    p.num_pending = 1  # p's only output token is still on the device: nothing left to compute
    q.append_output_token(900)
    r.append_output_token(900)
    out = sim.sched.schedule()
    # q's 5th token needs a block: p (latest arrival, passed over) is preempted for it; r still runs
    assert out.preempted == ["p"]
    assert rows(out) == [("q", 4, 1, [2, 1], True), ("r", 3, 1, [3], True)]
    assert sim.running == ["q", "r"] and [w.request_id for w in sim.sched.waiting] == ["p"]
