"""vLLM's request extras through the OpenAI app on the real SmolLM2, driven by the ``openai`` SDK: beam search
(``use_beam_search``, ``n`` as the width), ``prompt_logprobs``, ``bad_words``, ``return_token_ids`` and
``stream_options.continuous_usage_stats``; every answer is compared with the offline engine."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from paged_backend.adapters.api import AdapterError, EngineAdapter
from paged_backend.adapters.openai_server import create_openai_app
from paged_backend.adapters.triton_protocol import parse_sampling_parameters

from paged_backend.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ENGINE_ARGS = {"max_model_len": 512, "num_gpu_blocks_override": 128, "log_stats_interval": 0}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def app():
    ad = EngineAdapter({"model": MODEL, **ENGINE_ARGS})
    ad.start()
    yield create_openai_app(ad, prefix="/v1")
    ad.shutdown()


@pytest.fixture(scope="module")
def offline():
    from paged_backend import LLM

    return LLM(MODEL, **ENGINE_ARGS)


def _call(app, fn) -> Any:
    """``fn(client)`` with an ``AsyncOpenAI`` client on the app (in-process ASGI), run to completion."""
    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=300) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
            return await fn(client)

    return asyncio.run(go())


def _completion(app, stream: bool = False, **kw) -> Any:
    async def fn(client):
        resp = await client.completions.create(model=MODEL, stream=stream, **kw)
        return [c async for c in resp] if stream else resp

    return _call(app, fn)


def _chat(app, stream: bool = False, **kw) -> Any:
    async def fn(client):
        resp = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=stream, **kw)
        return [c async for c in resp] if stream else resp

    return _call(app, fn)


def _raw(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=300) as http:
            return await http.post(path, json=body)

    return asyncio.run(go())


def _chat_ids(offline) -> list[int]:
    return offline.apply_chat_template(CHAT)


# -- beam search ---------------------------------------------------------------------------

def test_beam_search_equals_the_offline_engines(app, offline):
    beams = SamplingParams(use_beam_search=True, n=2, beam_width=2, max_tokens=8, length_penalty=0.5)
    want = offline.generate([PROMPT], beams, use_tqdm=False)[0].outputs
    resp = _completion(app, prompt=PROMPT, max_tokens=8, n=2,
                       extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True})
    assert [c.text for c in resp.choices] == [o.text for o in want]
    assert [c.model_extra["token_ids"] for c in resp.choices] == [o.token_ids for o in want]
    assert [c.finish_reason for c in resp.choices] == [o.finish_reason for o in want]
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in want)
    # chat, streamed: the whole answer arrives after the search (vLLM's way), in order
    want = offline.generate([_chat_ids(offline)], SamplingParams(use_beam_search=True, n=2, beam_width=2,
                                                                 max_tokens=8), use_tqdm=False)[0].outputs
    chunks = _chat(app, stream=True, max_tokens=8, n=2, extra_body={"use_beam_search": True})
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [o.text for o in want]


# -- prompt logprobs -----------------------------------------------------------------------

def _check_prompt_logprobs(got: list, out, k: int, tok) -> None:
    """Served prompt logprobs against the offline engine's: fp32 on the CPU, the same tokens, ranks and values
    (equal bit for bit when both forwards split their matmuls over the same threads: ``scripts/test.sh`` turns
    off MKL's and OpenMP's load-dependent thread counts)."""
    assert len(got) == len(out.prompt_token_ids) and got[0] is None
    for pos in range(1, len(got)):
        entry, want = got[pos], out.prompt_logprobs[pos]
        tid = out.prompt_token_ids[pos]
        assert next(iter(entry)) == str(tid)  # the prompt token first, then the top k
        assert entry[str(tid)]["logprob"] == pytest.approx(want[tid], abs=1e-5)
        assert entry[str(tid)]["rank"] == out.prompt_logprob_ranks[pos] >= 1
        tops = sorted(want.items(), key=lambda kv: kv[1], reverse=True)[:k]
        for r, (t, lp) in enumerate(tops):
            assert entry[str(t)]["rank"] == r + 1 and entry[str(t)]["logprob"] == pytest.approx(lp, abs=1e-5)
            assert entry[str(t)]["decoded_token"] == tok.decode([t])
        assert set(entry) == {str(t) for t in want}


def test_prompt_logprobs_equal_the_offline_engines(app, offline):
    out = offline.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                           use_tqdm=False)[0]
    resp = _completion(app, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2})
    _check_prompt_logprobs(resp.choices[0].model_extra["prompt_logprobs"], out, 2, offline.tokenizer)
    assert resp.choices[0].text == out.outputs[0].text
    chat_out = offline.generate([_chat_ids(offline)], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1),
                                use_tqdm=False)[0]
    resp = _chat(app, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    _check_prompt_logprobs(resp.model_extra["prompt_logprobs"], chat_out, 1, offline.tokenizer)
    plain = _raw(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0] and "token_ids" not in plain["choices"][0]


# -- bad words -----------------------------------------------------------------------------

def test_bad_words_never_appear_in_the_greedy_answer(app, offline):
    plain = _chat(app, max_tokens=12, temperature=0).choices[0].message.content
    assert "Paris" in plain
    banned = _chat(app, max_tokens=12, temperature=0, extra_body={"bad_words": ["Paris"]}).choices[0].message.content
    assert "Paris" not in banned
    want = offline.chat(CHAT, SamplingParams(max_tokens=12, temperature=0, bad_words=["Paris"]),
                        use_tqdm=False)[0].outputs[0].text
    assert banned == want
    text = _completion(app, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in text.choices[0].text


# -- token ids -------------------------------------------------------------------------------

def test_return_token_ids_equal_the_tokenizers_and_the_offline_engines(app, offline):
    tok = offline.tokenizer
    want = offline.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    resp = _completion(app, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    choice = resp.choices[0].model_extra
    assert choice["prompt_token_ids"] == tok(PROMPT).input_ids == want.prompt_token_ids
    assert choice["token_ids"] == want.outputs[0].token_ids
    chunks = _completion(app, stream=True, prompt=PROMPT, max_tokens=6, temperature=0,
                         extra_body={"return_token_ids": True})
    firsts = [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks if c.choices]
    assert firsts[0] == want.prompt_token_ids and not any(firsts[1:])
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []] \
        == want.outputs[0].token_ids
    chat_want = offline.chat(CHAT, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    resp = _chat(app, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    assert resp.model_extra["prompt_token_ids"] == _chat_ids(offline) == chat_want.prompt_token_ids
    assert resp.choices[0].model_extra["token_ids"] == chat_want.outputs[0].token_ids
    chunks = _chat(app, stream=True, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    assert chunks[0].model_extra["prompt_token_ids"] == chat_want.prompt_token_ids
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []] \
        == chat_want.outputs[0].token_ids
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == chat_want.outputs[0].text


# -- continuous usage ------------------------------------------------------------------------

def _check_running_usage(chunks: list, prompt_tokens: int, total: int) -> None:
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == total
    assert all(c.usage.prompt_tokens == prompt_tokens for c in chunks)
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_continuous_usage_is_on_every_chunk_with_running_counts(app, offline):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _completion(app, stream=True, prompt=PROMPT, max_tokens=5, temperature=0, stream_options=options)
    n_prompt = len(offline.tokenizer(PROMPT).input_ids)
    _check_running_usage(chunks, n_prompt, 5)
    assert chunks[-1].choices == []  # the closing usage chunk is still there
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert [c.usage.completion_tokens for c in text_chunks] == list(range(1, len(text_chunks) + 1))
    chunks = _chat(app, stream=True, max_tokens=5, temperature=0,
                   stream_options={"continuous_usage_stats": True})  # include_usage defaults on, as in vLLM
    _check_running_usage(chunks, len(_chat_ids(offline)), 5)
    assert chunks[0].usage.completion_tokens == 0  # the role chunk
    plain = _chat(app, stream=True, max_tokens=2, temperature=0, stream_options={"include_usage": True})
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 2


# -- refusals --------------------------------------------------------------------------------

BAD = [
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": "Paris"}, "bad_words"), ({"bad_words": [1]}, "bad_words"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"return_token_ids": "yes"}, "return_token_ids"), ({"use_beam_search": 1}, "use_beam_search"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop"), ({"use_beam_search": True, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "bad_words": ["x"]}, "bad_words"), ({"use_beam_search": True, "n": 100}, "n"),
    ({"use_beam_search": True, "guided_regex": "a+"}, "guided_regex"), ({"length_penalty": "x"}, "length_penalty"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options"),
    ({"best_of": 3}, "best_of"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_values_are_400s_naming_the_field(app, extra, param):
    resp = _raw(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_chat_refuses_beam_search_with_logprobs_and_triton_parameters_carry_the_fields(app):
    resp = _raw(app, "/v1/chat/completions", {"messages": CHAT, "use_beam_search": True, "logprobs": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"
    assert parse_sampling_parameters('{"bad_words": "[\\"Paris\\"]"}').bad_words == ["Paris"]
    params = parse_sampling_parameters('{"use_beam_search": "true", "beam_width": "2", "length_penalty": "0.5"}')
    assert (params.use_beam_search, params.beam_width, params.length_penalty) == (True, 2, 0.5)
    with pytest.raises(AdapterError, match="beam search"):
        parse_sampling_parameters('{"bad_words": ["Paris"], "use_beam_search": true}')


def test_a_beam_search_left_early_is_aborted_with_its_blocks_freed(app):
    import time

    adapter = app.state.engine_adapter

    async def go() -> None:
        params = SamplingParams(use_beam_search=True, n=3, beam_width=3, max_tokens=40, ignore_eos=True)
        task = asyncio.ensure_future(adapter.complete(PROMPT, params, request_id="beam-left"))
        await asyncio.sleep(1.0)
        assert adapter.has_requests(["beam-left"])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while True:
        s = adapter.stats()
        if (s["num_running"], s["num_waiting"]) == (0, 0) and s["num_free_blocks"] == adapter.model_info()[
                "num_gpu_blocks"]:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert not adapter.has_requests(["beam-left"])
