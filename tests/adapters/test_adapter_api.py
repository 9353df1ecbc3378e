"""The adapter API: field conversion, error mapping, metrics, and the real engine behind it."""

from __future__ import annotations

import asyncio
import contextlib

import pydantic
import pytest
from paged_backend.adapters.api import AdapterError, EngineAdapter, build_sampling_params, to_adapter_error
from paged_backend.adapters.metrics import METRICS, SPEC_DECODE_METRICS, PrometheusMetrics, RequestTimer

from paged_backend.errors import EngineDeadError, InvalidRequestError
from paged_backend.outputs import CompletionOutput, RequestOutput, Usage, merge_delta
from paged_backend.sampling_params import SamplingParams

ENGINE_ARGS = {"model": "SmolLM2-135M-Instruct", "max_model_len": 512, "num_gpu_blocks_override": 128}


# -- build_sampling_params / to_adapter_error --------------------------------------------

def test_fields_become_sampling_params():
    p = build_sampling_params({"max_tokens": 7, "temperature": 0.0, "stop": "\n", "top_k": 5, "logprobs": 2})
    assert (p.max_tokens, p.temperature, p.stop, p.top_k, p.logprobs) == (7, 0.0, ["\n"], 5, 2)


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"logprobs": 99}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"output_kind": "final_only"}, "output_kind"),
])
def test_bad_fields_name_the_field(fields, param):
    with pytest.raises(AdapterError) as ei:
        build_sampling_params(fields)
    err = ei.value
    assert err.param == param and err.status == 400 and param in err.message


def test_field_names_map_back_to_what_the_user_sent():
    with pytest.raises(AdapterError) as ei:
        build_sampling_params({"max_tokens": 0}, field_names={"max_tokens": "max_completion_tokens"})
    assert ei.value.param == "max_completion_tokens"
    assert "max_completion_tokens" in ei.value.message


def test_cross_field_error_keeps_its_message():
    with pytest.raises(AdapterError) as ei:
        build_sampling_params({"min_tokens": 5, "max_tokens": 3})
    assert "min_tokens (5) must be <= max_tokens (3)" in ei.value.message


@pytest.mark.parametrize(("fields", "expected"), [
    ({"temperature": "0.5", "max_tokens": "12", "ignore_eos": "true"}, {"temperature": 0.5, "max_tokens": 12,
                                                                        "ignore_eos": True}),
    ({"max_tokens": "12.0", "ignore_eos": "False"}, {"max_tokens": 12, "ignore_eos": False}),
    ({"stop_token_ids": "[1, 2]", "stop": "[\"a\", \"b\"]"}, {"stop_token_ids": [1, 2], "stop": ["a", "b"]}),
    ({"stop": "plain"}, {"stop": ["plain"]}),
    ({"seed": "3"}, {"seed": 3}),
])
def test_string_values_are_converted_when_asked(fields, expected):
    p = build_sampling_params(fields, coerce_strings=True)
    assert {k: getattr(p, k) for k in expected} == expected


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": "1.5"}, "max_tokens"),
    ({"temperature": "warm"}, "temperature"),
    ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"stop_token_ids": "[1,"}, "stop_token_ids"),
])
def test_unconvertible_strings_name_the_field(fields, param):
    with pytest.raises(AdapterError) as ei:
        build_sampling_params(fields, coerce_strings=True)
    assert ei.value.param == param


def test_error_mapping_covers_engine_and_unknown_errors():
    e = to_adapter_error(InvalidRequestError("too long", param="prompt", code="context_length_exceeded"))
    assert (e.message, e.param, e.code, e.status) == ("too long", "prompt", "context_length_exceeded", 400)
    assert to_adapter_error(EngineDeadError("gone")).status == 503
    assert to_adapter_error(KeyError("bug")).status == 500
    try:
        SamplingParams(n=0)
    except pydantic.ValidationError as exc:
        assert to_adapter_error(exc).param == "n"


# -- metrics -----------------------------------------------------------------------------

def _delta(tokens: list[int], finish: str | None = None, completion: int = 0) -> RequestOutput:
    out = CompletionOutput(index=0, text="x" * len(tokens), token_ids=tokens, finish_reason=finish)
    return RequestOutput("r", "p", [1, 2, 3], [out], finish is not None, Usage(3, completion))


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_request_timer_feeds_vllm_histograms_and_stats_gauges():
    now = [100.0]
    stats = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "prompt_tokens_total": 30,
             "generation_tokens_total": 9, "prefix_cache_queries": 48, "prefix_cache_hits": 16}
    metrics = PrometheusMetrics("m", lambda: stats)
    timer = RequestTimer(metrics, clock=lambda: now[0])
    now[0] = 100.5
    timer.on_delta(_delta([5], completion=1))
    now[0] = 100.7
    timer.on_delta(_delta([6, 7], completion=3))
    now[0] = 101.0
    timer.on_delta(_delta([8], "stop", completion=4))
    timer.finish("abort")  # already finished: not counted twice
    text = metrics.render()
    assert _sample(text, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _sample(text, "vllm:inter_token_latency_seconds_count") == 2
    assert _sample(text, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert _sample(text, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert _sample(text, "vllm:request_generation_tokens_sum") == 4
    assert 'vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert "abort" not in text
    assert _sample(text, "vllm:num_requests_running") == 2
    assert _sample(text, "vllm:kv_cache_usage_perc") == 0.25
    assert _sample(text, "vllm:prompt_tokens_total") == 30
    assert _sample(text, "vllm:prefix_cache_hits_total") == 16
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    # one family each, no "*_created" beside them; vllm:cache_config_info only once an engine is loaded,
    # the spec_decode counters only with speculative decoding
    assert len(families) == len(set(families)) == len(METRICS) - 1 - len(SPEC_DECODE_METRICS)
    assert "_created" not in text


def test_request_timer_counts_engine_steps_of_merged_deltas():
    """A delta merged from three engine steps (slow consumer) gives one TTFT and two ITLs at
    the engine's step times, not one observation at its delivery."""
    metrics = PrometheusMetrics("m")
    timer = RequestTimer(metrics, clock=lambda: 50.0)  # created at 50.0 ... delivered at 50.0: unused
    first = merge_delta(None, _delta([5], completion=1))
    first.step_times = [50.2]
    for tok, t in ((6, 50.25), (7, 50.4)):
        d = _delta([tok], completion=tok - 4)
        d.step_times = [t]
        merge_delta(first, d)
    assert first.outputs[0].token_ids == [5, 6, 7] and first.step_times == [50.2, 50.25, 50.4]
    timer.on_delta(first)
    text = metrics.render()
    assert _sample(text, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert _sample(text, "vllm:inter_token_latency_seconds_count") == 2
    assert _sample(text, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.2)


# -- the real engine ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter():
    ad = EngineAdapter(ENGINE_ARGS)
    ad.start(background=True)
    assert ad.wait_ready(600)
    yield ad
    ad.shutdown()


def test_not_ready_before_start():
    ad = EngineAdapter(ENGINE_ARGS)
    assert not ad.is_ready

    async def go():
        async for _ in ad.generate("hi", SamplingParams()):
            pass

    with pytest.raises(AdapterError) as ei:
        asyncio.run(go())
    assert ei.value.status == 503


@pytest.mark.slow
def test_generate_matches_offline_engine(adapter):
    from paged_backend import LLM

    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = LLM(**ENGINE_ARGS).generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    out = asyncio.run(adapter.complete("The capital of France is", params))
    assert out.outputs[0].token_ids == expected.token_ids
    assert out.outputs[0].text == expected.text
    assert out.usage.completion_tokens == 8


@pytest.mark.slow
def test_refusal_comes_before_any_delta_and_names_the_field(adapter):
    async def go():
        deltas = []
        async for d in adapter.generate("hi " * 600, SamplingParams(max_tokens=4)):
            deltas.append(d)
        return deltas

    with pytest.raises(AdapterError) as ei:
        asyncio.run(go())
    assert ei.value.code == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in ei.value.message


def _settled_stats(adapter: EngineAdapter, timeout: float = 5.0) -> dict:
    """Engine stats once the loop thread has published the state after our last call."""
    import time

    deadline = time.monotonic() + timeout
    stats = adapter.stats()
    while stats["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = adapter.stats()
    return stats


@pytest.mark.slow
def test_leaving_the_stream_early_frees_every_block(adapter):
    total = adapter.model_info()["num_gpu_blocks"]
    before = adapter.stats()["num_aborted_total"]

    async def go():
        n = 0
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        async with contextlib.aclosing(adapter.generate("Tell me a long story.", params)) as stream:
            async for _ in stream:
                n += 1
                if n == 3:
                    break
        return n

    assert asyncio.run(go()) == 3
    stats = _settled_stats(adapter)
    assert stats["num_free_blocks"] == total
    assert stats["num_running"] == 0
    assert stats["num_aborted_total"] == before + 1
    assert 'finished_reason="abort"' in adapter.metrics_text()


@pytest.mark.slow
def test_drain_refuses_new_requests(adapter):
    """Last in this module: it drains the shared adapter."""
    assert adapter.drain(timeout=5.0)
    assert not adapter.is_ready

    async def go():
        async for _ in adapter.generate("hi", SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(AdapterError) as ei:
        asyncio.run(go())
    assert ei.value.status == 503 and "shutting down" in ei.value.message
