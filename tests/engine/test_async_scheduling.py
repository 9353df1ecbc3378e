"""Async scheduling on the real SmolLM2 (fp32, CPU): step t+1 is scheduled and launched before
step t's tokens reach the host. Same tokens as transformers and as the synchronous engine,
whatever the batching, chunking, preemption, stops and aborts; no block leaks."""

from __future__ import annotations

import pytest
from smollm2 import MAX_NEW, PROMPTS, assert_no_leak, hf_greedy, make_llm, prompt_ids

from paged_backend import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm():
    return make_llm(async_scheduling=True)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 24}, {"num_gpu_blocks_override": 16}],
                         ids=["batched", "chunked", "preempting"])
def test_greedy_equals_transformers(kw):
    llm = make_llm(async_scheduling=True, **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(p) for p in PROMPTS]
    eng = llm.engine
    assert eng.num_async_steps > MAX_NEW - 2  # the decode steps overlapped
    if "num_gpu_blocks_override" in kw:
        assert eng.stats.num_preemptions_total > 0
    assert eng._inflight is None  # every request ended by length: nothing was left in flight
    assert_no_leak(eng)


def test_stops_on_eos_drop_the_token_in_flight(llm):
    # long enough that several prompts stop at EOS: their next step was already launched
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(p, 48) for p in PROMPTS]
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_no_leak(llm.engine)
    # a second pass over a stale step in flight, request ids reused, prefix cache warm
    again = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    assert _tokens(again) == _tokens(outs)
    assert_no_leak(llm.engine)


def test_sampling_logprobs_penalties_and_n_equal_the_synchronous_engine(llm):
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=7, repetition_penalty=1.3, logprobs=2),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3, presence_penalty=0.5, min_tokens=4,
                       stop_token_ids=[13]),
        SamplingParams(max_tokens=8, temperature=0.0, n=2, prompt_logprobs=1),
        SamplingParams(max_tokens=9, temperature=0.7, top_p=0.8, seed=11, stop=["."]),
    ]
    prompts = PROMPTS[:4]
    sync = make_llm(async_scheduling=False).generate(prompts, params, use_tqdm=False)
    asyn = llm.generate(prompts, params, use_tqdm=False)
    for s, a in zip(sync, asyn, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in s.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in s.outputs]
        assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in s.outputs]
        for ca, cs in zip(a.outputs, s.outputs, strict=True):
            assert (ca.logprobs is None) == (cs.logprobs is None)
            if cs.logprobs is not None:
                assert [sorted(d) for d in ca.logprobs] == [sorted(d) for d in cs.logprobs]
                assert ca.cumulative_logprob == pytest.approx(cs.cumulative_logprob, abs=1e-4)
        assert (a.prompt_logprobs is None) == (s.prompt_logprobs is None)
    assert_no_leak(llm.engine)


def test_aborts_while_tokens_are_in_flight_free_every_block(llm):
    eng = llm.engine
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS, strict=True):
        eng.add_request(rid, prompt_ids(p), SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    toks = {rid: [] for rid in ids}
    finished: set[str] = set()
    aborted = {"r1", "r4", "r6"}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            toks[out.request_id] += out.outputs[0].token_ids if out.outputs else []
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        if steps == 4:  # mid-decode: these requests each have a token in flight
            assert eng._inflight is not None
            in_flight = {s.request.request_id for _, s in eng._inflight.rows}
            assert aborted <= in_flight
            for rid in aborted:
                assert eng.abort_request(rid) is not None
    assert finished | aborted == set(ids)
    for rid, p in zip(ids, PROMPTS, strict=True):
        if rid not in aborted:
            assert toks[rid] == hf_greedy(p)
    assert_no_leak(eng)
