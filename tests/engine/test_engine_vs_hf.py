"""Greedy output of the engine equals transformers' generate token for token (fp32, CPU),
whatever the batching, chunking, prefix caching, preemption or forking did."""

from __future__ import annotations

import pytest
from smollm2 import MAX_NEW, PROMPTS, assert_no_leak, hf_beam, hf_greedy, make_llm, prompt_ids

from paged_backend import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _expected():
    return [hf_greedy(p) for p in PROMPTS]


def test_prompts_have_different_lengths():
    lens = {len(prompt_ids(p)) for p in PROMPTS}
    assert len(lens) == len(PROMPTS) and max(lens) > 100


def test_one_request_at_a_time():
    llm = make_llm(max_num_seqs=1)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == _expected()
    assert_no_leak(llm.engine)


def test_all_batched(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == _expected()
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(PROMPTS) or all(
        o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    assert_no_leak(llm.engine)


def test_chunked_prefill():
    llm = make_llm(max_num_batched_tokens=24)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == _expected()
    # the long prompt needed several steps of 24 tokens
    assert llm.engine.stats.num_steps > max(len(prompt_ids(p)) for p in PROMPTS) // 24
    assert_no_leak(llm.engine)


def test_prefix_caching_second_pass_from_cache():
    llm = make_llm()
    first = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    hits_before = llm.engine.get_stats()["prefix_cache_hits"]
    assert hits_before > 0  # the two SHARED prompts share their first blocks
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(second) == first == _expected()
    long_idx = max(range(len(PROMPTS)), key=lambda i: len(prompt_ids(PROMPTS[i])))
    assert second[long_idx].usage.cached_tokens >= 16 * ((len(prompt_ids(PROMPTS[long_idx])) - 1) // 16) - 16
    assert llm.engine.get_stats()["prefix_cache_hits"] > hits_before
    assert_no_leak(llm.engine)


def test_preemption_keeps_outputs():
    # 15 usable blocks of 16 tokens: far less than the batch needs, enough for any one request
    llm = make_llm(num_gpu_blocks_override=16)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_preemptions_total > 0
    assert _tokens(outs) == _expected()
    assert_no_leak(llm.engine)


def test_n2_greedy_copies_share_prompt_blocks(llm):
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=2), use_tqdm=False)
    for o, exp in zip(outs, _expected()[:4], strict=True):
        assert [c.index for c in o.outputs] == [0, 1]
        assert o.outputs[0].token_ids == o.outputs[1].token_ids == exp
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_equals_transformers(llm, length_penalty):
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
    params = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=10, length_penalty=length_penalty,
                            temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_beam(p, 3, 10, length_penalty)
    assert_no_leak(llm.engine)
