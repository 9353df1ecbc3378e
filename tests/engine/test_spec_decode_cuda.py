"""Speculative decoding under CUDA graphs (runs on a GPU machine only): SmolLM2 in fp32 with the Triton backend,
greedy tokens with n-gram drafts and with a draft model (the target's own checkpoint) equal greedy tokens
without speculation, synchronous and under async scheduling, and the verification steps (the last token and k
drafts a request) replayed the graphs captured for 1 + k tokens a request, in the target and in the draft
model's runner (which observes those steps), beside the one-token decode graphs."""

from __future__ import annotations

import gc

import pytest
import torch
from smollm2 import PROMPTS, model_dir

from paged_backend import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.cuda]

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
COUNTING = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"  # n-grams recur at once: the n-gram drafts get accepted
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
ASYNC = pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])


@pytest.fixture(autouse=True)
def _release_engines():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _llm(**kw) -> LLM:
    return LLM(model_dir(), dtype="float32", device="cuda", gpu_memory_utilization=0.25, max_num_seqs=16,
               log_stats_interval=0, seed=0, **kw)


def _tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected() -> dict[str, list[list[int]]]:
    """Greedy tokens without speculation (decode steps under the one-token graphs)."""
    llm = _llm()
    out = {"counting": _tokens(llm, [COUNTING]), "batch": _tokens(llm, [COUNTING, *PROMPTS])}
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays[1] > 0
    llm.shutdown()
    return out


def _check_graphs(runner, *, decode: bool = False) -> None:
    graphs = runner.graphs
    assert graphs is not None and (1 + K, 1) in graphs.graphs, "no graph for verification steps was captured"
    assert graphs.replays[1 + K] > 0, f"no verification step replayed a graph: {dict(graphs.replays)}"
    assert runner.step_counts["graph"] >= graphs.replays[1 + K] + graphs.replays[1]
    if decode:
        assert graphs.replays[1] > 0


@ASYNC
def test_ngram_verification_steps_replay_graphs_and_keep_greedy_tokens(expected, async_):
    llm = _llm(speculative_config=NGRAM, async_scheduling=async_)
    try:
        assert _tokens(llm, [COUNTING]) == expected["counting"]  # one request: every verification step is uniform
        _check_graphs(llm.engine.runner)
        stats = llm.engine.spec.stats
        assert stats.num_accepted_tokens > 0
        assert _tokens(llm, [COUNTING, *PROMPTS]) == expected["batch"]
    finally:
        llm.shutdown()


@ASYNC
def test_draft_model_steps_replay_graphs_in_both_runners_and_keep_greedy_tokens(expected, async_):
    spec = {"method": "draft_model", "model": model_dir(), "num_speculative_tokens": K}
    llm = _llm(speculative_config=spec, async_scheduling=async_)
    try:
        assert _tokens(llm, [COUNTING]) == expected["counting"]
        assert _tokens(llm, [COUNTING, *PROMPTS]) == expected["batch"]
        stats = llm.engine.spec.stats
        # the draft is the target: every draft the target's own greedy choice (ends of requests aside)
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0, stats.snapshot()
        _check_graphs(llm.engine.runner)
        _check_graphs(llm.engine.spec.draft.runner, decode=True)  # observed verifications, one-token passes
    finally:
        llm.shutdown()
