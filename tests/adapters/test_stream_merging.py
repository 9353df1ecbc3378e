"""A consumer that falls behind gets merged deltas (vLLM's RequestOutputCollector), not a queue.

The engine loop keeps stepping while the consumer is busy; the deltas it produced meanwhile
reach the consumer as one. Concatenated, they still equal the output of one non-streamed
request token for token, and finish reason and usage are those of the last step. The slow
consumer here blocks its event loop after each delta until the engine has generated a few
more tokens, as a busy HTTP writer does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from paged_backend.adapters.api import EngineAdapter
from paged_backend.adapters.openai_protocol import ChatCompletionRequest, CompletionRequest
from paged_backend.adapters.openai_server import create_chat_completion, create_completion, create_openai_app
from smollm2 import PROMPTS, assert_no_leak, model_dir
from starlette.requests import Request

from paged_backend import AsyncEngine, EngineConfig, SamplingParams
from paged_backend.outputs import CompletionOutput, RequestOutput, Usage, merge_delta
from paged_backend.sampling_params import RequestOutputKind

MAX_TOKENS = 24


def _fall_behind(stats: Callable[[], dict[str, Any]], tokens: int = 3, timeout: float = 60.0) -> None:
    """Block this thread (and so its event loop) until the engine generated ``tokens`` more
    tokens, or runs nothing any more: the deltas of those steps pile up undelivered."""
    start = stats()["generation_tokens_total"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = stats()
        if now["generation_tokens_total"] >= start + tokens or now["num_running"] == 0:
            return
        time.sleep(0.002)


def _delta(rid: str, index: int, ids: list[int], text: str, *, finish: str | None = None,
           logprobs: list[dict[int, float]] | None = None, completion_tokens: int = 0) -> RequestOutput:
    c = CompletionOutput(index=index, text=text, token_ids=ids, logprobs=logprobs, finish_reason=finish,
                         num_output_tokens=completion_tokens)
    return RequestOutput(rid, None, [1, 2], [c], finish is not None, Usage(2, completion_tokens))


def test_merge_delta_extends_in_place_and_keeps_the_input():
    first = _delta("r", 0, [5], "a", logprobs=[{5: -0.1}], completion_tokens=1)
    second = _delta("r", 0, [6, 7], "bc", logprobs=[{6: -0.2}, {7: -0.3}], completion_tokens=3)
    acc = merge_delta(None, first)
    assert acc is not first and acc.outputs[0] is not first.outputs[0]
    assert merge_delta(acc, second) is acc
    assert acc.outputs[0].token_ids == [5, 6, 7] and acc.outputs[0].text == "abc"
    assert acc.outputs[0].logprobs == [{5: -0.1}, {6: -0.2}, {7: -0.3}]
    assert acc.outputs[0].num_output_tokens == 3 and acc.usage.completion_tokens == 3
    assert first.outputs[0].token_ids == [5] and second.outputs[0].token_ids == [6, 7]  # inputs untouched
    # a sample that shows up later (n > 1) is added in index order
    merge_delta(acc, _delta("r", 1, [9], "z", finish="stop", completion_tokens=4))
    assert [c.index for c in acc.outputs] == [0, 1] and acc.finished
    assert acc.outputs[1].finish_reason == "stop" and acc.outputs[1].token_ids == [9]


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(EngineConfig(model=model_dir(), dtype="float32", device="cpu",
                                   kv_cache_memory_bytes=64 << 20, log_stats_interval=0))
    yield eng
    eng.shutdown()


async def _deltas(engine: AsyncEngine, rid: str, prompt: str, params: SamplingParams,
                  slow: bool = False) -> list[RequestOutput]:
    out = []
    async for d in engine.generate(rid, prompt, params):
        out.append(d)
        if slow and not d.finished:
            _fall_behind(engine.stats)
    return out


@pytest.mark.slow
def test_slow_consumer_gets_merged_deltas_equal_to_the_whole_output(engine):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    final_only = greedy.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY})

    async def main():
        whole = await _deltas(engine, "whole", PROMPTS[1], final_only)
        slow = await _deltas(engine, "slow", PROMPTS[1], greedy, slow=True)
        return whole, slow

    (whole,), slow = asyncio.run(main())
    want = whole.outputs[0]
    assert len(want.token_ids) == MAX_TOKENS
    assert len(slow) < MAX_TOKENS and any(len(d.outputs[0].token_ids) > 1 for d in slow)  # merged
    assert [d.finished for d in slow] == [False] * (len(slow) - 1) + [True]
    assert [t for d in slow for t in d.outputs[0].token_ids] == want.token_ids
    assert "".join(d.outputs[0].text for d in slow) == want.text
    lps = [lp for d in slow for lp in d.outputs[0].logprobs]
    assert len(lps) == MAX_TOKENS
    assert [max(d, key=d.get) for d in lps] == want.token_ids
    last = slow[-1]
    assert last.outputs[0].finish_reason == "length" and last.outputs[0].num_output_tokens == MAX_TOKENS
    assert last.usage.completion_tokens == MAX_TOKENS and last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.outputs[0].cumulative_logprob == pytest.approx(want.cumulative_logprob)
    for d in slow:  # totals are the newest step's: they count every token delivered so far
        assert d.usage.completion_tokens == d.outputs[0].num_output_tokens
        assert len(d.step_times) == len(d.outputs[0].token_ids)  # one engine step per token (n = 1)
    times = [t for d in slow for t in d.step_times]
    assert times == sorted(times) and not whole.step_times  # FINAL_ONLY outputs carry none
    assert_no_leak(engine.engine)


@pytest.mark.slow
def test_cumulative_outputs_are_replaced_not_merged(engine):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE)

    outs = asyncio.run(_deltas(engine, "cum", PROMPTS[2], params, slow=True))
    sizes = [len(o.outputs[0].token_ids) for o in outs]
    assert len(outs) < 12 and sizes == sorted(set(sizes)) and sizes[-1] == 12  # steps skipped, none appended twice
    assert all(o.outputs[0].token_ids == outs[-1].outputs[0].token_ids[: len(o.outputs[0].token_ids)] for o in outs)
    assert_no_leak(engine.engine)


# -- through the OpenAI layer ------------------------------------------------------------

@pytest.fixture(scope="module")
def app():
    # no prefix caching: the streamed request computes exactly what the whole one did
    adapter = EngineAdapter({"model": "SmolLM2-135M-Instruct", "max_model_len": 512, "num_gpu_blocks_override": 128,
                             "enable_prefix_caching": False})
    adapter.start()
    yield create_openai_app(adapter, prefix="/v1")
    adapter.shutdown()


def _request(app) -> Request:
    async def receive() -> dict:  # a client that stays connected
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return Request({"type": "http", "app": app, "method": "POST", "path": "/v1/completions", "headers": []},
                   receive)


async def _slow_sse(response, app) -> list[dict | str]:
    """The SSE events of a streaming response, read by a writer that is slow to come back."""
    events: list[dict | str] = []
    async for chunk in response.body_iterator:
        text = chunk if isinstance(chunk, str) else chunk.decode()
        for block in text.split("\n\n"):
            if block:
                assert block.startswith("data: ")
                data = block[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        if events[-1] != "[DONE]":
            _fall_behind(app.state.engine_adapter.stats)
    return events


@pytest.mark.slow
def test_slow_completion_stream_has_fewer_chunks_same_text_and_usage(app):
    fields = dict(model="SmolLM2-135M-Instruct", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                  ignore_eos=True)

    async def main():
        whole = await create_completion(CompletionRequest(**fields), _request(app))
        streamed = await create_completion(
            CompletionRequest(**fields, stream=True, stream_options={"include_usage": True}), _request(app))
        return json.loads(whole.body), await _slow_sse(streamed, app)

    whole, events = asyncio.run(main())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    text_chunks = [c for c in chunks if c["choices"][0]["text"]]
    assert 1 <= len(text_chunks) < MAX_TOKENS  # merged: fewer chunks than tokens
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert {c["id"] for c in events[:-1]} == {events[0]["id"]} and all(c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert usage["usage"]["completion_tokens"] == MAX_TOKENS


@pytest.mark.slow
def test_slow_chat_stream_with_logprobs_lists_every_token(app):
    fields = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": PROMPTS[0]}],
                  max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=1)

    async def main():
        whole = await create_chat_completion(ChatCompletionRequest(**fields), _request(app))
        streamed = await create_chat_completion(ChatCompletionRequest(**fields, stream=True), _request(app))
        return json.loads(whole.body), await _slow_sse(streamed, app)

    whole, events = asyncio.run(main())
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in events[1:-1] if c["choices"][0]["delta"].get("content") is not None]
    assert 1 <= len(content) < MAX_TOKENS
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == whole["choices"][0]["message"]["content"]
    tokens = [t for c in content for t in c["choices"][0]["logprobs"]["content"]]
    assert tokens == whole["choices"][0]["logprobs"]["content"]
    assert len(tokens) == whole["usage"]["completion_tokens"] == MAX_TOKENS
    assert events[-2]["choices"][0]["finish_reason"] == "length"
