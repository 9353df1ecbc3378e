"""The engine's cheap per-step paths give the same results as the general ones.

On a tiny random-weights Llama (no tokenizer: token-id prompts): output kinds (DELTA,
CUMULATIVE, FINAL_ONLY) carry the same content, ``LLM.generate`` gets one output per
request, the greedy fast path picks what the full sampler picks, the frozen GC heap is
given back, and request status / ``is_finished`` stay in step.
"""

from __future__ import annotations

import gc
import json

import pytest

from paged_backend import LLM, SamplingParams
from paged_backend.core.request import Request, RequestStatus
from paged_backend.engine.gc_heap import frozen_heap
from paged_backend.outputs import RequestOutput, merge_delta
from paged_backend.sampling_params import RequestOutputKind

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": True,
          "rope_theta": 10000.0, "max_position_embeddings": 256, "torch_dtype": "float32"}
PROMPTS = [[(7 * i + 13 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 17, 33, 8, 40, 16])]


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("tiny-dummy")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return LLM(str(path), load_format="dummy", dtype="float32", device="cpu", block_size=16,
               kv_cache_memory_bytes=8 << 20, log_stats_interval=0, seed=0)


def _drain(engine, ids: set[str]) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    done: set[str] = set()
    while len(done) < len(ids):
        for out in engine.step():
            outs[out.request_id].append(out)
            if out.finished:
                done.add(out.request_id)
    return outs


def _content(out: RequestOutput) -> list[tuple]:
    return [(c.index, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason,
             c.num_output_tokens) for c in out.outputs] + [out.usage, out.prompt_logprobs, out.finished]


PARAMS = [
    SamplingParams(max_tokens=9, temperature=0, detokenize=False),
    SamplingParams(max_tokens=7, temperature=0.8, seed=5, n=3, logprobs=2, detokenize=False),
    SamplingParams(max_tokens=6, temperature=1.0, seed=9, prompt_logprobs=1, ignore_eos=True, detokenize=False),
]


@pytest.mark.parametrize("p", range(len(PARAMS)))
def test_output_kinds_carry_the_same_content(tiny_llm, p):
    engine = tiny_llm.engine
    streams = {}
    for kind in RequestOutputKind:
        assert engine.reset_prefix_cache()  # the same computation for each kind: no prefix hits
        rid = f"kind-{p}-{kind.name}"
        engine.add_request(rid, PROMPTS[p], PARAMS[p].model_copy(update={"output_kind": kind}))
        streams[kind] = _drain(engine, {rid})[rid]
    delta = streams[RequestOutputKind.DELTA]
    merged = None
    for d in delta:
        merged = merge_delta(merged, d)
    cumulative = streams[RequestOutputKind.CUMULATIVE]
    final_only = streams[RequestOutputKind.FINAL_ONLY]
    finals = [merged, cumulative[-1], final_only[0]]
    assert len(final_only) == 1 and final_only[0].finished
    assert len(cumulative) == len(delta) > 1
    assert _content(finals[0]) == _content(finals[1]) == _content(finals[2])
    # every cumulative output extends the previous one
    for a, b in zip(cumulative, cumulative[1:], strict=False):
        for ca in a.outputs:
            cb = next(c for c in b.outputs if c.index == ca.index)
            assert cb.token_ids[: len(ca.token_ids)] == ca.token_ids
    n = PARAMS[p].n
    assert sorted(c.index for c in merged.outputs) == list(range(n))
    for c in merged.outputs:
        if PARAMS[p].logprobs is None:
            assert c.logprobs is None and c.cumulative_logprob is None
        else:
            assert len(c.logprobs) == len(c.token_ids)
            assert c.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids,
                                                                                  strict=True)), abs=1e-5)
    assert not engine.has_unfinished_requests()


def test_llm_generate_builds_one_output_per_request(tiny_llm):
    engine = tiny_llm.engine
    emitted: list[RequestOutput] = []
    step = engine.step

    def counting_step():
        outs = step()
        emitted.extend(outs)
        return outs

    engine.step = counting_step
    try:
        params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
        outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        del engine.step
    assert len(emitted) == len(PROMPTS) and all(o.finished for o in emitted)
    assert params.output_kind is RequestOutputKind.DELTA  # the caller's params are not changed
    for prompt, out in zip(PROMPTS, outs, strict=True):
        rid = f"delta-{len(prompt)}"
        engine.add_request(rid, prompt, params)
        merged = None
        for d in _drain(engine, {rid})[rid]:
            merged = merge_delta(merged, d)
        assert out.prompt_token_ids == prompt and out.finished
        assert _content(out)[:-3] == _content(merged)[:-3]  # the completions
        assert out.usage.completion_tokens == merged.usage.completion_tokens == 8


def test_greedy_fast_path_picks_what_the_full_sampler_picks(tiny_llm):
    """Rows without logprobs take the argmax fast path (once min_tokens stops banning); the same
    requests with ``logprobs=0`` always go through the full sampler."""
    engine = tiny_llm.engine
    probe = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, detokenize=False),
                              use_tqdm=False)
    firsts = [o.outputs[0].token_ids[0] for o in probe]

    def params(i: int, logprobs: int | None) -> SamplingParams:
        # stop at the token greedy picks first, banned while min_tokens is not reached
        return SamplingParams(max_tokens=12, min_tokens=3, temperature=0, stop_token_ids=[firsts[i]],
                              ignore_eos=True, logprobs=logprobs, detokenize=False)

    calls = []
    greedy = engine.sampler.greedy
    engine.sampler.greedy = lambda logits: calls.append(logits.shape[0]) or greedy(logits)
    try:
        fast = tiny_llm.generate(PROMPTS, [params(i, None) for i in range(len(PROMPTS))], use_tqdm=False)
    finally:
        del engine.sampler.greedy
    full = tiny_llm.generate(PROMPTS, [params(i, 0) for i in range(len(PROMPTS))], use_tqdm=False)
    assert calls, "the fast path was never taken"
    for f, g in zip(fast, full, strict=True):
        assert f.outputs[0].token_ids == g.outputs[0].token_ids
        assert f.outputs[0].finish_reason == g.outputs[0].finish_reason
        assert len(f.outputs[0].token_ids) >= 3  # min_tokens held the stop token back
    # mixed batch: one row asking for logprobs sends everything through the full sampler
    mixed = tiny_llm.generate(PROMPTS, [params(i, 0 if i == 2 else None) for i in range(len(PROMPTS))],
                              use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in full]


def test_abort_of_a_final_only_request_returns_everything(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("fo", PROMPTS[1], params)
    for _ in range(4):
        assert engine.step() == []
    out = engine.abort_request("fo")
    assert out is not None and out.finished
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 4
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.block_pool.num_total_usable


def test_frozen_heap_is_given_back():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()  # frozen by the application: stays frozen
    try:
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_overlapping_frozen_heaps_give_it_back_after_the_last():
    """Two engines' sections (loop threads, core readers) that end in the order they began: the heap stays
    frozen while one is open, and is given back after the last."""
    first, second = frozen_heap(), frozen_heap()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gc.get_freeze_count() > 0
    second.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0


def test_frozen_heap_ignores_objects_frozen_at_start_up(monkeypatch: pytest.MonkeyPatch):
    """Some Pythons start with a few objects frozen: the engine's freeze must still end."""
    import paged_backend.engine.gc_heap as gc_heap

    gc.freeze()  # as such an interpreter did before user code
    try:
        monkeypatch.setattr(gc_heap, "_STARTUP_FROZEN", gc.get_freeze_count())
        with frozen_heap():
            with frozen_heap():  # nested (the async loop around a generate): the outer one unfreezes
                pass
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
        # a cycle made before the engine's freeze is collectable once it ends
        collected = []

        class Node:
            def __init__(self) -> None:
                self.me = self

            def __del__(self) -> None:
                collected.append(1)

        node = Node()
        with frozen_heap():
            del node
            gc.collect()
            assert not collected  # frozen: skipped
        gc.collect()
        assert collected == [1]
    finally:
        gc.unfreeze()


def test_request_is_finished_follows_status():
    req = Request("r", [1, 2, 3], SamplingParams(), max_tokens=4)
    for status in RequestStatus:
        req.status = status
        assert req.status is status
        assert req.is_finished == status.finished
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length" and RequestStatus.RUNNING.finish_reason is None


class _AlwaysCall(dict):
    """A ``quiet_end`` that never lets the scheduler skip ``allocate_slots``."""

    def get(self, key, default=None):
        return 0


def test_scheduler_skipping_allocate_slots_changes_nothing():
    """Two schedulers on identical request streams (random forks, finishes and preemptions in
    a small pool), one calling allocate_slots for every request every step: same outputs,
    same blocks, same prefix cache."""
    import random

    from paged_backend.core.kv_cache_manager import KVCacheManager
    from paged_backend.core.scheduler import Scheduler

    def make() -> tuple[Scheduler, KVCacheManager]:
        kv = KVCacheManager(num_blocks=60, block_size=4)
        return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=200), kv

    (fast, fast_kv), (slow, slow_kv) = make(), make()
    slow_kv.quiet_end = _AlwaysCall()
    calls = {"fast": 0, "slow": 0}
    for name, kv in (("fast", fast_kv), ("slow", slow_kv)):
        def counted(*args, _inner=kv.allocate_slots, _name=name, **kwargs):
            calls[_name] += 1
            return _inner(*args, **kwargs)
        kv.allocate_slots = counted
    rng = random.Random(3)
    live: dict[str, tuple[Request, Request]] = {}
    ids = 0
    for _ in range(300):
        if len(live) < 6 and rng.random() < 0.3:
            ids += 1
            prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
            pair = tuple(Request(f"r{ids}", prompt, SamplingParams(), max_tokens=99, arrival_time=ids)
                         for _ in range(2))
            live[f"r{ids}"] = pair
            fast.add_request(pair[0])
            slow.add_request(pair[1])
        outs = fast.schedule(), slow.schedule()
        assert [(s.request_id, s.start_pos, s.num_new_tokens, s.block_ids, s.samples, s.token_ids)
                for s in outs[0].scheduled] == [
            (s.request_id, s.start_pos, s.num_new_tokens, s.block_ids, s.samples, s.token_ids)
            for s in outs[1].scheduled]
        assert (outs[0].blocks_to_copy, outs[0].preempted) == (outs[1].blocks_to_copy, outs[1].preempted)
        tok = rng.randrange(50)
        for s0, s1 in zip(outs[0].scheduled, outs[1].scheduled, strict=True):
            if s0.samples:
                live[s0.request_id][0].append_output_token(tok)
                live[s1.request_id][1].append_output_token(tok)
        for rid, (a, b) in list(live.items()):
            if a.status != RequestStatus.RUNNING or a.num_computed_tokens != a.num_tokens - 1:
                continue
            roll = rng.random()
            if roll < 0.08:  # fork a child that shares every block (n > 1)
                ids += 1
                kids = [Request(f"r{ids}", x.all_token_ids[:-1], SamplingParams(), max_tokens=99,
                                arrival_time=ids) for x in (a, b)]
                for parent, kid, sched, kv in ((a, kids[0], fast, fast_kv), (b, kids[1], slow, slow_kv)):
                    kid.append_output_token(parent.all_token_ids[-1])
                    kid.num_computed_tokens = parent.num_computed_tokens
                    kv.fork(parent, kid)
                    sched.add_running(kid)
                live[f"r{ids}"] = (kids[0], kids[1])
            elif roll < 0.15:
                fast.finish(a, RequestStatus.FINISHED_STOPPED)
                slow.finish(b, RequestStatus.FINISHED_STOPPED)
                del live[rid]
        pools = fast_kv.block_pool, slow_kv.block_pool
        assert [(b.ref_cnt, b.block_hash) for b in pools[0].blocks] == [(b.ref_cnt, b.block_hash)
                                                                       for b in pools[1].blocks]
    assert fast.num_preemptions > 0
    assert calls["fast"] < 0.8 * calls["slow"]  # the skip was taken (2 of every 4 decode steps here)
