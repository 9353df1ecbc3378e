"""Speculative decoding (n-gram drafts) on the real SmolLM2 (fp32, CPU): greedy output equal to
transformers' token for token whatever the batching, chunking, prefix caching or preemption did;
temperature > 0 keeps the target's distribution; seeded requests reproduce; no block leaks. Most tests run
synchronously and under async scheduling (forced on the CPU), where a request waits while its step is in
flight and the engine's requests take turns in two half-size steps."""

from __future__ import annotations

import functools

import pytest
import torch
from smollm2 import MAX_NEW, PROMPTS, assert_no_leak, hf_greedy, hf_model, make_llm, prompt_ids

from paged_backend import SamplingParams

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
COUNTING = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"  # n-grams recur at once


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _expected():
    return [hf_greedy(p) for p in PROMPTS]


ASYNC = pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])


@functools.lru_cache(maxsize=2)
def spec_llm(async_: bool = False):
    return make_llm(speculative_config=SPEC, async_scheduling=async_)


def _check_drafts_verified(llm, before: int = 0) -> None:
    stats = llm.engine.spec.stats
    assert stats.num_drafts > before and stats.num_accepted_tokens > 0


@ASYNC
def test_greedy_batched_equals_transformers(async_):
    llm = spec_llm(async_)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == _expected()
    _check_drafts_verified(llm)
    # fewer steps than tokens: accepted drafts emit several tokens a step
    assert llm.engine.stats.num_steps < MAX_NEW * len(PROMPTS)
    assert_no_leak(llm.engine)


@ASYNC
def test_greedy_chunked_prefill_and_preemption(async_):
    # 24 tokens a step: long prompts in chunks beside speculative steps; 15 usable blocks: preemption
    llm = make_llm(speculative_config=SPEC, max_num_batched_tokens=24, num_gpu_blocks_override=16,
                   async_scheduling=async_)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == _expected()
    assert llm.engine.stats.num_preemptions_total > 0
    _check_drafts_verified(llm)
    assert_no_leak(llm.engine)


@ASYNC
def test_greedy_prefix_cache_second_pass(async_):
    llm = spec_llm(async_)
    first = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    hits = llm.engine.get_stats()["prefix_cache_hits"]
    second = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert second == first == _expected()
    assert llm.engine.get_stats()["prefix_cache_hits"] > hits
    assert_no_leak(llm.engine)


@ASYNC
def test_stops_logprobs_and_n_match_plain_decoding(llm, async_):
    spec = spec_llm(async_)
    cases = [
        SamplingParams(max_tokens=20, temperature=0.0, stop=[" 3,"]),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[34]),  # the digit 2
        SamplingParams(max_tokens=7, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=9, temperature=0.0, min_tokens=5, n=2),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3),
    ]
    for params in cases:
        want = llm.generate([COUNTING, PROMPTS[1]], params, use_tqdm=False)
        got = spec.generate([COUNTING, PROMPTS[1]], params, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            for wc, gc in zip(w.outputs, g.outputs, strict=True):
                assert (gc.token_ids, gc.text, gc.finish_reason, gc.stop_reason) == (
                    wc.token_ids, wc.text, wc.finish_reason, wc.stop_reason), params
                if params.logprobs:
                    assert len(gc.logprobs) == len(gc.token_ids)
                    for a, b in zip(gc.logprobs, wc.logprobs, strict=True):
                        assert a.keys() == b.keys()
                        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
                    assert abs(gc.cumulative_logprob - wc.cumulative_logprob) < 1e-3
    _check_drafts_verified(spec)
    assert_no_leak(spec.engine)


@ASYNC
def test_structured_outputs_run_without_drafts_beside_speculative_rows(llm, async_):
    import re

    from paged_backend.sampling_params import StructuredOutputsParams

    spec = spec_llm(async_)
    before = spec.engine.spec.stats.num_drafts
    regex = SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=StructuredOutputsParams(
        regex=r" [12][0-9]{3}\."))
    plain = SamplingParams(max_tokens=20, temperature=0.0)
    outs = spec.generate(["The year is", COUNTING], [regex, plain], use_tqdm=False)
    assert re.fullmatch(r" [12][0-9]{3}\.", outs[0].outputs[0].text)
    assert outs[1].outputs[0].token_ids == llm.generate([COUNTING], plain, use_tqdm=False)[0].outputs[0].token_ids
    _check_drafts_verified(spec, before)
    assert_no_leak(spec.engine)


@ASYNC
def test_seeded_sampling_reproducible_alone_and_in_a_batch(async_):
    llm = spec_llm(async_)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=1234)
    alone = _tokens(llm.generate([COUNTING], params, use_tqdm=False))[0]
    again = _tokens(llm.generate([COUNTING], params, use_tqdm=False))[0]
    others = SamplingParams(max_tokens=16, temperature=1.0)
    batch = llm.generate([PROMPTS[0], COUNTING, PROMPTS[2]], [others, params, others], use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids
    assert_no_leak(llm.engine)


def test_abort_in_the_middle_of_speculative_steps_leaks_nothing():
    engine = spec_llm().engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate([COUNTING, COUNTING + ", 3", PROMPTS[3]]):
        engine.add_request(f"r{i}", p, params)
    aborted = 0
    while engine.has_unfinished_requests():
        engine.step()
        drafted = [r.request_id for r in engine.scheduler.running if r.spec_token_ids]
        if drafted:  # the next step would verify these drafts
            engine.step()  # a speculative step
            engine.abort_request(drafted[0])
            aborted += 1
    assert aborted >= 1
    assert_no_leak(engine)


def _verifying_in_flight(engine) -> list[str]:
    """Async scheduling: the requests whose drafts the step in flight verifies."""
    f = engine._inflight
    return [] if f is None else [s.request_id for s in f.sched.scheduled if s.num_draft]


def test_async_abort_while_a_verification_is_in_flight_leaks_nothing():
    """A request aborted while its drafts are verified on the device: its blocks are freed at once, its landed
    tokens dropped and its rejected positions not rolled back (nothing left to roll back); the others keep
    the synchronous engine's tokens."""
    engine = make_llm(speculative_config=SPEC, async_scheduling=True).engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [COUNTING, COUNTING + ", 3", PROMPTS[3], PROMPTS[1]]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    aborted: set[str] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
        verifying = [r for r in _verifying_in_flight(engine) if r not in aborted]
        if verifying and len(aborted) < 2:
            assert engine.abort_request(verifying[0]) is not None
            aborted.add(verifying[0])
    assert len(aborted) == 2
    assert_no_leak(engine)
    want = make_llm().generate(prompts, params, use_tqdm=False)
    for i, w in enumerate(want):
        if f"r{i}" not in aborted:
            assert tokens[f"r{i}"] == w.outputs[0].token_ids


def test_async_a_verification_in_flight_is_preempted_by_recompute(monkeypatch):
    """Eight blocks, swap preemption: a request whose drafts are being verified when another needs its blocks is
    recomputed (how many positions it keeps is not known yet), the others swapped; the plain engine's tokens."""
    from paged_backend.core.scheduler import Scheduler

    victims: list[tuple[bool, bool]] = []  # (verification in flight, swapped)
    preempt = Scheduler._preempt

    def spy(self, req, out):
        verifying = bool(req.num_pending and req.spec_token_ids)
        swaps = self.num_swap_preemptions
        preempt(self, req, out)
        victims.append((verifying, self.num_swap_preemptions > swaps))

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    prompts = [COUNTING, "a, b, c, a, b, c, a, b", "x y z x y z x y z", "1 2 1 2 1 2 1 2", PROMPTS[3]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = make_llm(speculative_config=SPEC, async_scheduling=True, num_gpu_blocks_override=8,
                   preemption_mode="swap", swap_space=0.05)
    got = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert (True, False) in victims and (False, True) in victims, victims
    assert (True, True) not in victims
    assert got == _tokens(make_llm().generate(prompts, params, use_tqdm=False))
    assert_no_leak(llm.engine)


def _counters(engine) -> tuple:
    s = engine.spec.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos


def test_async_counters_equal_the_synchronous_engine_and_steps_overlap():
    """The same greedy workload drafts and accepts exactly as the synchronous engine (each request proposes
    after each of its steps either way), and a step is queued while the one before it is still in flight."""
    prompts = [*PROMPTS[:4], COUNTING, PROMPTS[7]]
    sync = make_llm(speculative_config=SPEC)
    want = _tokens(sync.generate(prompts, GREEDY, use_tqdm=False))
    engine = make_llm(speculative_config=SPEC, async_scheduling=True).engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    overlapped = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        for out in outs:
            got[out.request_id] += out.outputs[0].token_ids
        # one step's outputs processed while the next (with drafts to verify) is on the device
        overlapped += bool(outs) and bool(_verifying_in_flight(engine))
    assert [got[str(i)] for i in range(len(prompts))] == want
    assert overlapped > MAX_NEW // 4
    assert _counters(engine) == _counters(sync.engine)
    assert_no_leak(engine)


def _target_top_k(ids: list[int], temperature: float, k: int) -> dict[int, float]:
    with torch.inference_mode():
        logits = hf_model()(torch.tensor([ids])).logits[0, -1] / temperature
    vals, idx = logits.topk(k)
    return dict(zip(idx.tolist(), vals.softmax(-1).tolist(), strict=True))


def test_rejection_sampling_keeps_the_target_distribution():
    """The first two sampled tokens of many seeded requests, (t1, t2): t2 comes from a verification
    step (a draft kept or the residual), so its joint distribution with t1 must be the target's."""
    temperature, top_k, n = 3.0, 4, 240
    llm = spec_llm()
    drafts_before = llm.engine.spec.stats.num_drafts
    prompt = prompt_ids("1, 2, 3, 1, 2, 3,")
    assert len(prompt) == 17  # every request after the first computes one token of it (prefix cache)
    params = [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=i) for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert llm.engine.spec.stats.num_drafts - drafts_before > n // 4  # many t2 came from verification
    p1 = _target_top_k(prompt, temperature, top_k)
    expected = {(a, b): pa * pb for a, pa in p1.items()
                for b, pb in _target_top_k(prompt + [a], temperature, top_k).items()}
    # categories expected at least 10 times each, the rest pooled
    big = {c for c, p in expected.items() if p * n >= 10}
    observed: dict = {}
    for pair in pairs:
        key = pair if pair in big else "rest"
        observed[key] = observed.get(key, 0) + 1
    exp_counts = {c: expected[c] * n for c in big}
    exp_counts["rest"] = n - sum(exp_counts.values())
    chi2 = sum((observed.get(c, 0) - e) ** 2 / e for c, e in exp_counts.items() if e > 0)
    dof = len(exp_counts) - 1
    # p = 0.001 critical values of the chi-square distribution
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
                10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25}[dof]
    assert chi2 < critical, (chi2, dof, observed, exp_counts)
    assert_no_leak(llm.engine)


def test_stats_and_async_scheduling_off_by_default():
    llm = spec_llm()
    llm.generate([COUNTING], GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats()
    spec = llm.engine.spec.stats
    assert stats["spec_decode_num_drafts"] == spec.num_drafts > 0
    assert stats["spec_decode_num_accepted_tokens"] == sum(stats["spec_decode_num_accepted_tokens_per_pos"])
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    assert not llm.engine.async_scheduling  # the CPU; on one CUDA device too, unless asked for
    assert spec_llm(True).engine.async_scheduling


# -- a draft model: SmolLM2 as its own draft proposes exactly the target's greedy tokens ----------

def _draft_spec() -> dict:
    from smollm2 import model_dir

    return {"method": "draft_model", "model": model_dir(), "num_speculative_tokens": 3}


def _all_accepted(llm) -> None:
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


@ASYNC
def test_draft_model_itself_greedy_all_accepted_under_chunking_preemption_and_forks(async_):
    llm = make_llm(speculative_config=_draft_spec(), max_num_batched_tokens=24, num_gpu_blocks_override=11,
                   async_scheduling=async_)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == _expected()
    assert llm.engine.stats.num_preemptions_total > 0
    # its cache follows the target's blocks (recomputes, prefix hits, copy-on-write of forked samples)
    _all_accepted(llm)
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=2), use_tqdm=False)
    for o, exp in zip(outs, _expected()[:3], strict=True):
        assert o.outputs[0].token_ids == o.outputs[1].token_ids == exp
    _all_accepted(llm)
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    alone = _tokens(llm.generate([PROMPTS[2]], params, use_tqdm=False))[0]
    batch = llm.generate([PROMPTS[0], PROMPTS[2]], [SamplingParams(max_tokens=12, temperature=1.0), params],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert_no_leak(llm.engine)


def test_draft_model_async_counters_equal_the_synchronous_engine():
    sync, asyn = (make_llm(speculative_config=_draft_spec(), async_scheduling=a) for a in (False, True))
    want, got = (_tokens(e.generate(PROMPTS[:4], GREEDY, use_tqdm=False)) for e in (sync, asyn))
    assert got == want == _expected()[:4]
    assert _counters(asyn.engine) == _counters(sync.engine)
    assert asyn.engine.num_async_steps > 0
    assert_no_leak(asyn.engine)


# -- disable_by_batch_size: no drafts while the engine holds more requests, speculation resumes after ------

DISABLE_AT = 2
BATCH_PROMPTS = [COUNTING, PROMPTS[3], PROMPTS[0], PROMPTS[1]]
# two requests run long, two stop early: four held, then two
BATCH_PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 14, 3, 3)]


def _run_over_the_limit(spec: dict, async_: bool):
    """The batch on an engine whose speculation stops above ``DISABLE_AT`` requests: after every step, while
    more are held, no request holds drafts and none was verified. The LLM and each request's tokens."""
    spec_llm_ = make_llm(speculative_config={**spec, "disable_by_batch_size": DISABLE_AT}, async_scheduling=async_)
    engine = spec_llm_.engine
    for i, (p, params) in enumerate(zip(BATCH_PROMPTS, BATCH_PARAMS, strict=True)):
        engine.add_request(str(i), p, params)
    tokens: list[list[int]] = [[] for _ in BATCH_PROMPTS]
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[int(out.request_id)] += out.outputs[0].token_ids
        if engine.scheduler.num_requests > DISABLE_AT:
            assert engine.spec.stats.num_drafts == 0
            assert not any(r.spec_token_ids for r in engine.scheduler.running)
    stats = engine.get_stats()
    assert stats["spec_decode_num_disabled_steps"] == engine.spec.stats.num_disabled_steps > 0
    assert_no_leak(engine)
    return spec_llm_, tokens


@ASYNC
def test_disable_by_batch_size_plain_steps_then_ngram_drafts_resume(llm, async_):
    """N-gram drafts: plain decode steps while four requests are held, drafts verified once two are left; the
    tokens are the plain engine's."""
    spec, tokens = _run_over_the_limit(SPEC, async_)
    assert tokens == _tokens(llm.generate(BATCH_PROMPTS, BATCH_PARAMS, use_tqdm=False))
    _check_drafts_verified(spec)


@ASYNC
def test_disable_by_batch_size_draft_model_catches_up(llm, async_):
    """SmolLM2 as its own draft: it computed every step's KV while speculation was off, so once two requests
    are left all of its drafts are the target's tokens."""
    spec, tokens = _run_over_the_limit(_draft_spec(), async_)
    assert tokens == _tokens(llm.generate(BATCH_PROMPTS, BATCH_PARAMS, use_tqdm=False))
    _all_accepted(spec)
