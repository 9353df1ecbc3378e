"""Engine behaviour on the real SmolLM2: sampling, stops, logprobs, aborts, bad input."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError
from smollm2 import PROMPTS, assert_no_leak, hf_model, make_llm, prompt_ids

from paged_backend import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.slow


def _run(engine, ids):
    """Step until the given request ids are finished; returns their merged token ids."""
    toks = {rid: [] for rid in ids}
    done = set()
    while len(done) < len(ids):
        for out in engine.step():
            if out.request_id in toks:
                for c in out.outputs:
                    toks[out.request_id] += c.token_ids
                if out.finished:
                    done.add(out.request_id)
    return toks


def test_seeded_sampling_same_alone_and_in_mixed_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=t, seed=s) for t, s in [(0.7, None), (1.3, 9), (0.0, None)]]
    batch = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5]], [others[0], params, others[1], others[2]],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(max_tokens=12, temperature=1.5, n=4)
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_no_leak(llm.engine)


def test_stop_string_never_emitted_in_part(llm):
    base = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[10:14]
    assert len(stop) == 4 and stop.strip()
    eng = llm.engine
    eng.add_request("stop", PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    pieces, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            pieces.append(out.outputs[0].text if out.outputs else "")
            final = out
    streamed = "".join(pieces)
    assert streamed == text[: text.index(stop)]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0]
    assert out.outputs[0].text == text[: text.index(stop) + len(stop)]
    assert_no_leak(eng)


def test_stop_token_ids_min_tokens_and_ignore_eos(llm):
    base = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    toks = base.outputs[0].token_ids
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[toks[3]]),
                       use_tqdm=False)[0].outputs[0]
    first = toks.index(toks[3])
    assert out.token_ids == toks[: first + 1] and out.finish_reason == "stop" and out.stop_reason == toks[3]
    # min_tokens masks the stop token until enough tokens are out
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[toks[3]],
                                                    min_tokens=8), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8 and toks[3] not in out.token_ids[:7]
    # "Hi" with the chat template ends in EOS quickly; ignore_eos runs to max_tokens
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=64, temperature=0),
                    use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == 2
    full = llm.chat([{"role": "user", "content": "Say hi."}],
                    SamplingParams(max_tokens=len(chat.token_ids) + 5, temperature=0, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == len(chat.token_ids) + 5
    assert full.token_ids[: len(chat.token_ids)] == chat.token_ids


def test_logit_bias_and_allowed_token_ids_steer_greedy_output(llm):
    base = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    forced = 1000  # an ordinary token the model would not pick here
    assert forced not in base.token_ids
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, logit_bias={forced: 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [forced] * 4
    # banning the first greedy token changes the first step only to the runner-up
    banned = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0, logprobs=2,
                                                       logit_bias={base.token_ids[0]: -100.0}),
                          use_tqdm=False)[0].outputs[0]
    top2 = list(banned.logprobs[0])[:2]  # raw logprobs: the banned token still ranks first
    assert top2[0] == base.token_ids[0] and banned.token_ids == [top2[1]]
    allowed = [base.token_ids[2], forced, 7]
    out = llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=6, temperature=0.8, seed=3,
                                                                allowed_token_ids=allowed),
                                                 SamplingParams(max_tokens=8, temperature=0)], use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    assert out[1].outputs[0].token_ids == llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0),
                                                       use_tqdm=False)[0].outputs[0].token_ids


def test_logprobs_and_prompt_logprobs_match_transformers(llm):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=5, prompt_logprobs=3)
    out = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    ids = prompt_ids(PROMPTS[3])
    seq = ids + out.outputs[0].token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model()(torch.tensor([seq])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        lp = out.prompt_logprobs[pos]
        assert ids[pos] in lp
        assert lp[ids[pos]] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-3)
        top3 = torch.topk(ref[pos - 1], 3).indices.tolist()
        assert set(top3) <= set(lp)
    for step, lp in enumerate(out.outputs[0].logprobs):
        tok = out.outputs[0].token_ids[step]
        row = ref[len(ids) - 1 + step]
        assert list(lp)[:5] == torch.topk(row, 5).indices.tolist()
        assert lp[tok] == pytest.approx(row[tok].item(), abs=1e-3)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(lp[t] for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)), abs=1e-4)


def test_abort_mid_generation_and_at_last_step_frees_blocks(llm):
    eng = llm.engine
    total = eng.kv.block_pool.num_total_usable
    eng.add_request("a", PROMPTS[4], SamplingParams(max_tokens=50, temperature=0))
    eng.add_request("b", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))
    eng.step()
    eng.step()
    assert eng.kv.num_free_blocks < total
    final = eng.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert eng.kv.num_blocks_of("a") == 0
    # "b" is at its last step: abort it before that step runs
    while True:
        outs = eng.step()
        if not eng.has_unfinished_requests():
            break
        req = eng.samples["b"][1].request
        if req.num_output_tokens == 2:
            eng.abort_request("b")
            break
    assert_no_leak(eng)
    assert eng.abort_request("never-existed") is None
    del outs


def test_random_aborts_leak_nothing():
    llm = make_llm(num_gpu_blocks_override=40, max_num_seqs=16)
    eng = llm.engine
    rng = random.Random(0)
    live: set[str] = set()
    for i in range(200):
        rid = f"r{i}"
        ids = [rng.randrange(100, 49000) for _ in range(rng.randrange(1, 40))]
        eng.add_request(rid, ids, SamplingParams(max_tokens=rng.randrange(1, 6), temperature=1.0,
                                                 n=rng.choice([1, 1, 2])))
        live.add(rid)
        for out in eng.step() if rng.random() < 0.5 else []:
            if out.finished:
                live.discard(out.request_id)
        victim = rng.choice(sorted(live)) if live else None
        if victim and eng.abort_request(victim) is not None:
            live.discard(victim)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats.num_aborted_total > 50
    assert_no_leak(eng)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -1), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("logprobs", 21), ("n", 0), ("min_p", 2.0), ("stop", [""]),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValidationError) as exc:
        SamplingParams(**{field: value})
    assert field in str(exc.value)


def test_bad_requests_are_refused_and_the_engine_keeps_serving(llm):
    eng = llm.engine
    eng.add_request("good", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    first = [t for out in eng.step() for c in out.outputs for t in c.token_ids]
    assert len(first) == 1
    cases = [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 2, 10**6], SamplingParams(), "vocabulary"),
        ([-3], SamplingParams(), "vocabulary"),
        ("hello " * 9000, SamplingParams(max_tokens=16), "maximum context length"),
        (PROMPTS[0], SamplingParams(max_tokens=eng.max_model_len), "maximum context length"),
        (PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}), "logit_bias contains token id 1000000"),
        (PROMPTS[0], SamplingParams(allowed_token_ids=[5, 10**6]), "allowed_token_ids contains token id"),
    ]
    for prompt, params, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            eng.add_request("bad", prompt, params)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("good", PROMPTS[0], SamplingParams())
    toks = _run(eng, ["good"])
    assert len(first + toks["good"]) == 5
    assert_no_leak(eng)


@pytest.mark.parametrize("n2_first", [False, True])
def test_a_request_id_never_takes_another_requests_sample_id(llm, n2_first):
    """``k#0`` alone and ``k`` with n = 2 would share the scheduler id ``k#0``: the later one is refused."""
    eng = llm.engine
    one = ("k#0", list(range(100, 140)), SamplingParams(max_tokens=3, temperature=0))
    two = ("k", list(range(200, 240)), SamplingParams(max_tokens=3, temperature=0, n=2))
    first, second = (two, one) if n2_first else (one, two)
    eng.add_request(*first)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request(*second)
    _run(eng, [first[0]])
    eng.add_request(*second)  # free again once the first finished
    _run(eng, [second[0]])
    assert_no_leak(eng)


def test_a_text_too_long_for_the_context_is_refused_before_tokenizing(llm, monkeypatch):
    eng = llm.engine
    assert eng.max_prompt_bytes >= eng.max_model_len * 4
    calls = []
    monkeypatch.setattr(eng.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    with pytest.raises(InvalidRequestError, match="maximum context length") as ei:
        eng.process_input("long", "a" * (eng.max_prompt_bytes + 1), SamplingParams())
    assert ei.value.code == "context_length_exceeded" and not calls


def test_max_token_bytes_bounds_every_tokens_text(llm):
    from paged_backend.engine.llm_engine import max_token_bytes

    tok = llm.engine.tokenizer
    bound = max_token_bytes(tok)
    texts = [tok.decode([i]) for i in range(0, tok.vocab_size, 7)]
    assert max(len(t.encode("utf-8", "surrogatepass")) for t in texts) <= bound


def test_stop_strings_are_capped():
    with pytest.raises(ValidationError, match="at most 1024 characters"):
        SamplingParams(stop=["x" * 2000])
    with pytest.raises(ValidationError, match="at most 64 stop strings"):
        SamplingParams(stop=[f"s{i}" for i in range(65)])


def test_request_that_can_never_fit_the_cache_is_refused():
    llm = make_llm(num_gpu_blocks_override=5)  # 4 usable blocks = 64 tokens
    with pytest.raises(InvalidRequestError, match="could never run"):
        llm.engine.add_request("big", list(range(100, 160)), SamplingParams(max_tokens=10))
    out = llm.generate([list(range(100, 140))], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10


def test_missing_or_malformed_model_dir(tmp_path):
    from paged_backend import LLM

    with pytest.raises(FileNotFoundError, match="neither a local directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_chat_and_generate_on_the_default_model(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    info = llm.engine.model_info()
    assert info["vocab_size"] == 49152 and info["max_model_len"] == 8192


def test_prompt_logprobs_survive_preemption(llm):
    want = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1),
                        use_tqdm=False)[0].prompt_logprobs
    small = make_llm(num_gpu_blocks_override=14)
    # 13 usable blocks: all three fit at first (2 shared + 1 + 1, and 8), then the short ones
    # grow into new blocks and the latest arrival, the prompt_logprobs one, is preempted
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=1)]
    outs = small.generate([PROMPTS[5], PROMPTS[6], PROMPTS[4]], params, use_tqdm=False)
    assert small.engine.stats.num_preemptions_total > 0
    got = outs[-1].prompt_logprobs
    assert len(got) == len(want) == len(prompt_ids(PROMPTS[4]))
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys() and all(abs(g[k] - w[k]) < 1e-4 for k in g)
    assert_no_leak(small.engine)
