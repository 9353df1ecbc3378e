"""AsyncEngine: the engine loop in a thread behind asyncio (the adapter API's core); the same
tests against EngineCoreClient, the engine stepped in a core process."""

from __future__ import annotations

import asyncio

import pytest
from smollm2 import PROMPTS, assert_no_leak, hf_greedy, model_dir

from paged_backend import AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams
from paged_backend.engine.core_client import EngineCoreClient

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[(False, False), (False, True), (True, True)],
                ids=["sync", "async-scheduling", "core-process"])
def engine(request):
    """The CPU engine, with and without async scheduling (the CUDA default: one step in flight), and
    in a core process of its own."""
    in_process, async_scheduling = not request.param[0], request.param[1]
    config = EngineConfig(model=model_dir(), dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20,
                          log_stats_interval=0, async_scheduling=async_scheduling,
                          engine_core_process=not in_process)
    eng = AsyncEngine(config) if in_process else EngineCoreClient(config)
    yield eng
    eng.shutdown()
    assert not eng.is_ready and not eng.is_dead


def assert_engine_no_leak(engine) -> None:
    """Every block is back in the pool and no request is left (in a core process: asked through the pipe)."""
    if isinstance(engine, AsyncEngine):
        assert_no_leak(engine.engine)
        return
    state = engine.core_state()
    assert state["num_unfinished"] == state["num_running"] == state["num_waiting"] == 0
    assert state["num_free_blocks"] == state["num_total_usable"]


async def _collect(engine, rid, prompt, params):
    deltas = [d async for d in engine.generate(rid, prompt, params)]
    return deltas


def test_concurrent_streams_equal_transformers(engine):
    params = SamplingParams(max_tokens=16, temperature=0)

    async def main():
        return await asyncio.gather(*[_collect(engine, f"s{i}", p, params) for i, p in enumerate(PROMPTS[:4])])

    results = asyncio.run(main())
    for prompt, deltas in zip(PROMPTS[:4], results, strict=True):
        assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
        toks = [t for d in deltas for c in d.outputs for t in c.token_ids]
        assert toks == hf_greedy(prompt)
        text = "".join(c.text for d in deltas for c in d.outputs)
        assert text == engine.tokenizer.decode(toks, skip_special_tokens=True)
        assert deltas[-1].usage.completion_tokens == 16
    assert engine.is_ready
    stats = engine.stats()
    assert stats["generation_tokens_total"] >= 64 and stats["num_running"] == 0
    assert_engine_no_leak(engine)


def test_consumer_that_stops_iterating_aborts_its_request(engine):
    async def main():
        agen = engine.generate("quit", PROMPTS[4], SamplingParams(max_tokens=200, temperature=0))
        async for _ in agen:
            break
        await agen.aclose()
        await engine.abort("no-such-request")  # a no-op, but it waits for the loop to drain
        return engine.stats()

    stats = asyncio.run(main())
    assert stats["num_running"] == 0
    assert_engine_no_leak(engine)


def test_abort_ends_the_stream_with_abort(engine):
    async def main():
        seen = []

        async def consume():
            async for d in engine.generate("ab", PROMPTS[4], SamplingParams(max_tokens=500, temperature=0)):
                seen.append(d)

        task = asyncio.create_task(consume())
        while not seen:
            await asyncio.sleep(0.01)
        await engine.abort("ab")
        await asyncio.wait_for(task, 30)
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs and seen[-1].outputs[-1].finish_reason == "abort"
    assert_engine_no_leak(engine)


def test_bad_request_raises_before_streaming(engine):
    async def main():
        with pytest.raises(InvalidRequestError, match="maximum context length") as exc:
            await _collect(engine, "long", PROMPTS[0], SamplingParams(max_tokens=10**6))
        assert exc.value.param == "max_tokens"
        # the engine keeps serving
        return await _collect(engine, "ok", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))

    deltas = asyncio.run(main())
    assert deltas[-1].finished
    info = engine.model_info()
    assert info["max_model_len"] == 8192 and info["kv_capacity_tokens"] > 0
