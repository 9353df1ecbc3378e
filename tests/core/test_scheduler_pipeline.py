"""Pipeline parallelism's scheduling (no torch): micro-batches of at most ``max_seqs`` requests, and a
request whose sampled token is in flight (``num_pending``) skipped until it lands
(``skip_in_flight``), as the engine's ``PipelinedSteps`` drives the scheduler."""

from __future__ import annotations

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.scheduler import Scheduler, SchedulerOutput
from paged_backend.sampling_params import SamplingParams


def _req(req_id: str, prompt_len: int, first: int, arrival: float = 0.0) -> Request:
    return Request(req_id, list(range(first, first + prompt_len)), SamplingParams(), max_tokens=50,
                   arrival_time=arrival)


def _sched(num_blocks: int = 64, budget: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, True), max_num_seqs=8, max_num_batched_tokens=budget,
                     max_model_len=128, skip_in_flight=True)


def _submit(out: SchedulerOutput, reqs: dict[str, Request]) -> list[Request]:
    """What submit does: the sampled requests' tokens are now in flight."""
    sampled = [reqs[s.request_id] for s in out.scheduled if s.samples]
    for r in sampled:
        r.num_pending = 1
    return sampled


def _land(sampled: list[Request]) -> None:
    for r in sampled:
        r.num_pending = 0
        r.append_output_token(900 + r.num_output_tokens)


def _ids(out: SchedulerOutput) -> list[str]:
    return [s.request_id for s in out.scheduled]


def test_micro_batches_hold_disjoint_requests():
    sched = _sched()
    reqs = {r.request_id: r for r in (_req("a", 3, 100), _req("b", 3, 200), _req("c", 3, 300), _req("d", 3, 400))}
    for r in reqs.values():
        sched.add_request(r)
    first = sched.schedule(max_seqs=2)
    assert _ids(first) == ["a", "b"]
    in_a = _submit(first, reqs)
    second = sched.schedule(max_seqs=2)
    assert _ids(second) == ["c", "d"]
    in_b = _submit(second, reqs)
    assert sched.schedule(max_seqs=2).is_empty  # everything is in flight
    _land(in_a)
    third = sched.schedule(max_seqs=2)
    assert [(s.request_id, s.start_pos, s.num_new_tokens, s.samples) for s in third.scheduled] == [
        ("a", 3, 1, True), ("b", 3, 1, True)]
    _submit(third, reqs)
    _land(in_b)
    assert _ids(sched.schedule(max_seqs=2)) == ["c", "d"]
    assert _ids(_sched().schedule()) == []  # no cap given: the scheduler as before


def test_a_prompt_chunk_follows_its_previous_chunk_in_flight():
    """A chunk does not sample: the next chunk may go in the next micro-batch (each stage runs them in order)."""
    sched = _sched(budget=8)
    reqs = {"a": _req("a", 20, 100)}
    sched.add_request(reqs["a"])
    outs = [sched.schedule(max_seqs=1) for _ in range(3)]
    assert [(s.start_pos, s.num_new_tokens, s.samples) for o in outs for s in o.scheduled] == [
        (0, 8, False), (8, 8, False), (16, 4, True)]
    sampled = _submit(outs[2], reqs)
    assert sched.schedule(max_seqs=1).is_empty
    _land(sampled)
    assert [(s.start_pos, s.num_new_tokens) for s in sched.schedule(max_seqs=1).scheduled] == [(20, 1)]


def test_preempted_in_flight_waits_for_its_token():
    """A request preempted while its token is in flight is not readmitted (nor sampled twice) until the
    token lands; then it recomputes with that token."""
    sched = _sched(num_blocks=5)  # 4 usable blocks of 4 tokens
    reqs = {"a": _req("a", 7, 100, arrival=0.0), "b": _req("b", 7, 200, arrival=1.0)}
    for r in reqs.values():
        sched.add_request(r)
    out = sched.schedule()
    assert _ids(out) == ["a", "b"]  # 2 blocks each
    _land(_submit(out, reqs))
    out = sched.schedule(max_seqs=1)  # a's 8th token fits its second block
    in_a = _submit(out, reqs)
    assert _ids(out) == ["a"]
    in_b = _submit(sched.schedule(max_seqs=1), reqs)  # b's 8th token, a in flight
    assert [r.request_id for r in in_b] == ["b"]
    _land(in_a)
    out = sched.schedule(max_seqs=1)  # a needs a third block: b, in flight, is preempted
    assert _ids(out) == ["a"] and out.preempted == ["b"]
    _submit(out, reqs)
    sched.finish(reqs["a"], RequestStatus.FINISHED_ABORTED)  # aborted in flight: room for b now
    assert sched.schedule().is_empty  # yet b waits for its token in flight
    _land(in_b)
    out = sched.schedule()
    # recomputed with its landed token (its first block from the prefix cache)
    assert [(s.request_id, s.start_pos, s.num_new_tokens, s.samples) for s in out.scheduled] == [("b", 4, 5, True)]
    assert reqs["b"].output_token_ids == [900, 901]
