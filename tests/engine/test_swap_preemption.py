"""Swap preemption on the real SmolLM2 (fp32, CPU): a device pool too small for the batch and a host
tier big enough, so preempted requests are swapped out and back in; greedy output equals
transformers', and aborts in every state leave both tiers' pools whole."""

from __future__ import annotations

import pytest
from paged_backend.adapters.metrics import PrometheusMetrics
from smollm2 import MAX_NEW, PROMPTS, assert_no_leak, hf_greedy, make_llm

from paged_backend import SamplingParams
from paged_backend.core.request import RequestStatus

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def assert_host_free(engine) -> None:
    swap = engine.swap
    assert engine.scheduler.num_swapped == 0
    assert swap.num_free_blocks == swap.num_total_usable
    assert all(b.ref_cnt == 0 for b in swap.pool.blocks)


@pytest.mark.parametrize("caching", [True, False])
def test_swap_preemption_keeps_greedy_outputs(caching: bool):
    # 15 usable device blocks of 16 tokens; a host tier of 0.05 GiB (~70 blocks of 720 KiB). With prefix
    # caching a swapped-out request's blocks still cached on the device at swap in come back in place; without
    # it every block is copied back from the host
    llm = make_llm(num_gpu_blocks_override=16, swap_space=0.05, preemption_mode="swap", enable_prefix_caching=caching)
    engine = llm.engine
    assert engine.swap is not None and engine.swap.num_total_usable >= 60
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    swap = engine.swap
    assert engine.scheduler.num_swap_preemptions > 0
    assert swap.num_swapped_in_blocks + swap.num_reused_in_place_blocks == swap.num_swapped_out_blocks > 0
    assert (swap.num_reused_in_place_blocks > 0) == caching and swap.num_swapped_in_blocks > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(p) for p in PROMPTS]
    assert_no_leak(engine)
    assert_host_free(engine)


def test_aborts_in_every_state_free_both_tiers():
    llm = make_llm(num_gpu_blocks_override=16, swap_space=0.05, preemption_mode="swap")
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0))
    seen: set[str] = set()
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        sched = engine.scheduler
        if sched.swapped and "swapped" not in seen:  # one swapped out (its copies ran this step)
            seen.add("swapped")
            req = sched.swapped[0]
            assert req.status == RequestStatus.SWAPPED and engine.swap.host_block_ids(req.request_id)
            assert swapped_gauge(engine) == sched.num_swapped >= 1
            engine.abort_request(req.request_id)
        elif sched.running and "running" not in seen and "swapped" in seen:
            req = sched.running[-1]
            if req.num_preemptions:  # swapped out and back in earlier
                seen.add("running")
            engine.abort_request(req.request_id)
        elif sched.waiting and "waiting" not in seen:
            seen.add("waiting")
            engine.abort_request(sched.waiting[-1].request_id)
    assert {"swapped", "waiting"} <= seen
    for rid in list(engine.groups):  # what is left, in whatever state
        engine.abort_request(rid)
    assert_no_leak(engine)
    assert_host_free(engine)
    assert swapped_gauge(engine) == 0
    # the same load again, untouched until a request comes back from the host: aborted right after the
    # step that queued its host -> device copies
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=40, temperature=0.0))
    sched = engine.scheduler
    while engine.has_unfinished_requests() and "swapped_in" not in seen:
        was_swapped = {r.request_id for r in sched.swapped}
        engine.step()
        back = [r for r in sched.running if r.request_id in was_swapped]
        if back:
            seen.add("swapped_in")
            engine.abort_request(back[0].request_id)
    assert "swapped_in" in seen
    for rid in list(engine.groups):
        engine.abort_request(rid)
    assert_no_leak(engine)
    assert_host_free(engine)


def swapped_gauge(engine) -> float:
    """vllm:num_requests_swapped as the adapters' Prometheus endpoint renders it from the engine's stats."""
    text = PrometheusMetrics("m", engine.get_stats).render()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_swapped{")]
    return float(line.rsplit(" ", 1)[1])
