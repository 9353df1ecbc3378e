"""The adapter's life on the real SmolLM2, in-process: a dead engine makes it not alive, drains
are bounded (the rest aborted), a cache smaller than max_model_len refuses to start, and the
OpenAI app's privacy options (cached-token reporting, salting by user, trusted templates)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from paged_backend.adapters.api import AdapterError, EngineAdapter
from paged_backend.adapters.openai_server import create_openai_app
from paged_backend.adapters.serving_options import ServingOptions

from paged_backend.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"model": "SmolLM2-135M-Instruct", "max_model_len": 512, "num_gpu_blocks_override": 128,
               "log_stats_interval": 0}
SHARED = "You are a helpful assistant for a travel agency. Answer briefly and politely. " * 3


def _started(**overrides) -> EngineAdapter:
    ad = EngineAdapter({**ENGINE_ARGS, **overrides})
    ad.start()
    return ad


@pytest.fixture(scope="module")
def adapter():
    ad = _started()
    yield ad
    ad.shutdown()


def _idle(ad: EngineAdapter) -> dict:
    deadline = time.monotonic() + 10
    while True:
        s = ad.stats()
        if (s["num_running"], s["num_waiting"]) == (0, 0) and s["num_free_blocks"] == ad.model_info()["num_gpu_blocks"]:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_a_cache_smaller_than_max_model_len_refuses_to_start():
    ad = EngineAdapter({**ENGINE_ARGS, "num_gpu_blocks_override": 8})
    with pytest.raises(ValueError, match=r"holds 112 tokens, fewer than max_model_len \(512\).*--max-model-len"):
        ad.start()
    assert not ad.is_alive and not ad.is_ready


def test_a_dead_engine_loop_makes_the_adapter_not_alive():
    ad = _started()
    try:
        assert ad.is_alive

        def broken_step():
            raise RuntimeError("injected failure")

        ad._engine.engine.step = broken_step

        async def go():
            async for _ in ad.generate("Hello", SamplingParams(max_tokens=4)):
                pass

        with pytest.raises(AdapterError) as ei:
            asyncio.run(go())
        assert ei.value.status == 503
        assert not ad.is_alive and not ad.is_ready
        with pytest.raises(AdapterError, match="must be restarted"):
            asyncio.run(go())
    finally:
        ad.shutdown()


def test_drain_is_bounded_and_aborts_what_is_left():
    ad = _started()
    try:
        finishes: list[str | None] = []
        started = asyncio.Event()

        async def one() -> None:
            async for d in ad.generate("Tell me a story:", SamplingParams(max_tokens=400, ignore_eos=True)):
                started.set()
                for c in d.outputs:
                    if c.finish_reason:
                        finishes.append(c.finish_reason)

        async def go() -> float:
            tasks = [asyncio.ensure_future(one()) for _ in range(3)]
            await started.wait()
            t0 = time.monotonic()
            assert await asyncio.to_thread(ad.drain, 0.5) is False
            took = time.monotonic() - t0
            await asyncio.gather(*tasks)
            return took

        took = asyncio.run(go())
        assert took < 6.0
        assert finishes == ["abort"] * 3
        assert ad.is_draining and not ad.is_ready
        _idle(ad)
    finally:
        ad.shutdown()


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
        return await c.post(path, json=body)


def test_cached_tokens_are_not_reported_when_the_operator_turns_them_off(adapter):
    app = create_openai_app(adapter, prefix="/v1", options=ServingOptions(enable_prompt_tokens_details=False))
    body = {"prompt": SHARED + "Where is Rome?", "max_tokens": 1}
    for _ in range(2):
        resp = asyncio.run(_post(app, "/v1/completions", body))
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"] is None
    _idle(adapter)


def test_salting_by_user_keeps_users_apart(adapter):
    app = create_openai_app(adapter, prefix="/v1", options=ServingOptions(cache_salt_from_user=True))

    def cached(user: str) -> int:
        body = {"prompt": SHARED + "Where is Paris?", "max_tokens": 1, "user": user}
        resp = asyncio.run(_post(app, "/v1/completions", body))
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") > 0
    assert cached("bob") == 0
    _idle(adapter)


def test_a_trusted_request_template_is_used(adapter):
    app = create_openai_app(adapter, prefix="/v1", options=ServingOptions(trust_request_chat_template=True))
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1, "chat_template": template}
    resp = asyncio.run(_post(app, "/v1/chat/completions", body))
    assert resp.status_code == 200, resp.text
    expected = len(adapter.tokenizer.encode("<<Hello there>>", add_special_tokens=False))
    assert resp.json()["usage"]["prompt_tokens"] == expected
