"""``bentoml serve`` of bentos/smollm2, driven by the official ``openai`` SDK over loopback.

One server for the module (it loads while the offline ``LLM`` computes the expected greedy
answers); every answer is compared with that offline engine token for token.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time

import httpx
import openai
import pytest
from bento_server import BENTO_DIR, MODEL, Server, bentoml_env, bentoml_exe, start, stop, wait_ready

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"max_model_len": 1024, "num_gpu_blocks_override": 384}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("bentoml"), {**ENGINE_ARGS, "log_stats_interval": 1})
    yield srv
    if not stop(srv):
        pytest.fail("bentoml serve did not stop on SIGTERM within 60s")


@pytest.fixture(scope="module")
def offline():
    """The offline engine the server's greedy answers must equal (built while the server loads)."""
    from paged_backend import LLM

    return LLM(MODEL, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def server(server_process, offline):
    return wait_ready(server_process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


_EXPECTED: dict[str, object] = {}


def _greedy_chat(offline, max_tokens: int, messages=CHAT):
    """The offline engine's greedy answer (a CompletionOutput: text, token_ids, finish_reason)."""
    from paged_backend import SamplingParams

    key = json.dumps([max_tokens, messages])
    if key not in _EXPECTED:
        _EXPECTED[key] = offline.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                      use_tqdm=False)[0].outputs[0]
    return _EXPECTED[key]


def _greedy(offline, prompts: list[str], max_tokens: int) -> list[str]:
    from paged_backend import SamplingParams

    outs = offline.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _stats(server: Server) -> dict:
    resp = httpx.post(f"{server.url}/stats", json={}, timeout=30)
    resp.raise_for_status()
    return resp.json()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


# -- tests -------------------------------------------------------------------------------

def test_ready_and_models(server, client):
    assert httpx.get(f"{server.url}/readyz").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == ENGINE_ARGS["max_model_len"]


def test_chat_greedy_equals_offline_engine(client, offline):
    want = _greedy_chat(offline, 12)
    expected, n_tokens = want.text, len(want.token_ids)
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == want.finish_reason
    assert resp.usage.completion_tokens == n_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + n_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_equals_offline_engine(client, offline):
    (expected,) = _greedy(offline, [PROMPT], 10)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "length"
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + expected
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_stop_logprobs_and_max_tokens(client, offline):
    def sampled():
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=7, n=2)

    resp = sampled()
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.message.content and c.finish_reason in ("length", "stop") for c in resp.choices)
    assert 2 <= resp.usage.completion_tokens <= 12
    again = sampled()  # the same seed samples the same answers
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]

    full = _greedy_chat(offline, 12).text
    stop = full.split()[2]  # a word in the middle of the greedy answer
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=[stop])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == full[: full.index(stop)]

    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens and "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy: the chosen token is the top one

    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    assert len(comp.choices[0].logprobs.tokens) == 3 and comp.usage.completion_tokens == 3


def test_32_concurrent_streams_complete_without_mixing(server, offline):
    prompts = [f"Count from {i} to {i + 6}: {i}," for i in range(32)]
    expected = _greedy(offline, prompts, 5)

    async def one(c: openai.AsyncOpenAI, prompt: str) -> tuple[set[str], str, str | None]:
        ids, text, finish = set(), [], None
        async for chunk in await c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                                      stream=True):
            ids.add(chunk.id)
            for ch in chunk.choices:
                text.append(ch.text)
                finish = ch.finish_reason or finish
        return ids, "".join(text), finish

    async def all_streams():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=600) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(all_streams())
    seen_ids = set()
    for (ids, text, finish), want in zip(results, expected, strict=True):
        assert len(ids) == 1 and not (ids & seen_ids)
        seen_ids |= ids
        assert text == want
        assert finish == "length"


def test_client_disconnect_mid_stream_frees_blocks(server):
    before = _stats(server)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{server.url}/v1/chat/completions",
                                                        json=body) as resp:
        assert resp.status_code == 200
        lines = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                lines += 1
            if lines == 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    stats = _stats(server)
    while (stats["num_running"] or stats["num_aborted_total"] == before["num_aborted_total"]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = _stats(server)
    assert stats["num_aborted_total"] == before["num_aborted_total"] + 1
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["model"]["num_gpu_blocks"]
    assert stats["generation_tokens_total"] - before["generation_tokens_total"] < 900
    metrics = httpx.get(f"{server.url}/metrics").text
    assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0.0
    assert _metric(metrics, "vllm:num_requests_running") == 0.0


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    ({"max_tokens": -1}, openai.BadRequestError, "max_tokens"),
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"n": 0}, openai.BadRequestError, "'n'"),
    ({"messages": openai.NOT_GIVEN}, openai.BadRequestError, "messages"),
    ({"messages": [{"role": "user", "content": "hello " * 1100}], "max_tokens": 4}, openai.BadRequestError,
     "maximum context length is 1024 tokens"),
    ({"model": "no-such-model"}, openai.NotFoundError, "no-such-model"),
])
def test_bad_inputs_raise_the_matching_sdk_error(client, kwargs, error, needle):
    call = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as ei:
        client.chat.completions.create(**call)
    assert needle in ei.value.body["message"] or needle in str(ei.value.body.get("param"))
    assert ei.value.body["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"  # still serving


def test_malformed_json_is_a_400_with_openai_error(server):
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


def test_over_long_completion_prompt_names_the_context(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="word " * 1200, max_tokens=8)
    msg = ei.value.body["message"]
    assert msg.startswith("This model's maximum context length is 1024 tokens. However, you requested")


def test_native_streaming_endpoint(server, offline):
    expected = _greedy_chat(offline, 8, [{"role": "user", "content": "Say hello."}]).text
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{server.url}/generate",
                                                        json={"prompt": "Say hello.", "max_tokens": 8}) as resp:
        assert resp.status_code == 200
        text = "".join(resp.iter_text())
    assert text == expected
    bad = httpx.post(f"{server.url}/generate", json={"prompt": "x", "max_tokens": 0}, timeout=60)
    assert bad.status_code == 400 and "max_tokens" in bad.text


def test_metrics_have_vllm_names(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert _metric(text, name) >= 0
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert _metric(text, name) > 0, name
    assert _metric(text, "vllm:prefix_cache_hits_total") > 0  # the same chat prompt ran before
    assert "bentoml_" in text  # BentoML's own metrics are still there


def test_grafana_dashboard_queries_only_exported_metrics(server, client):
    """Every series docs/grafana/paged-backend.json queries is on this server's /metrics (after a
    finished request, so the per-reason success counter has a series)."""
    import grafana_dashboard

    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert grafana_dashboard.missing_from(httpx.get(f"{server.url}/metrics").text) == {}


def test_metrics_are_one_registry_with_vllms_request_metrics(server, client):
    """Each family once (BentoML's multiprocess collector does not publish the engine's a second
    time), no ``*_created``, vLLM's request histograms and counters current when a request ends."""
    before = httpx.get(f"{server.url}/metrics").text
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, n=2,
                              extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(families) == len(set(families)), sorted(f for f in families if families.count(f) > 1)
    assert "_created" not in text
    assert _metric(text, "vllm:generation_tokens_total") == _metric(before, "vllm:generation_tokens_total") + 10
    for name in ("vllm:time_per_output_token_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                 "vllm:request_inference_time_seconds_count", "vllm:request_params_n_count",
                 "vllm:request_params_max_tokens_count", "vllm:iteration_tokens_total_count"):
        assert _metric(text, name) > _metric(before, name), name
    assert 'vllm:request_params_n_bucket{le="2.0",model_name="SmolLM2-135M-Instruct"}' in text
    assert "vllm:num_preemptions_total" in text
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0"), info
    for label in ('block_size="16"', 'num_gpu_blocks="383"', 'cache_dtype="auto"', 'kv_cache_dtype="float32"',
                  'model_name="SmolLM2-135M-Instruct"'):
        assert label in info[0], (label, info[0])


def test_the_server_log_shows_the_engine_lines(server, client):
    """As ``vllm serve``: the engine's start-up lines and its periodic throughput line in the log."""
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    throughput = (r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                  r"Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%")
    deadline = time.monotonic() + 30
    while not re.search(throughput, server.log_text()):
        assert time.monotonic() < deadline, server.log_tail()
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
        time.sleep(0.5)
    log = server.log_text()
    assert re.search(r"\[INFO\] .*Engine: model=SmolLM2-135M-Instruct \(LlamaForCausalLM\), dtype=float32, "
                     r"device=cpu, max_model_len=1024, max_num_seqs=\d+, max_num_batched_tokens=\d+, "
                     r"attention backend=torch, CUDA graphs=off", log), log[:5000]
    assert re.search(r"KV cache: 383 blocks of 16 tokens = 6128 tokens \(float32, [\d.]+ GiB\); "
                     r"max concurrency at max_model_len 1024: 5\.98x", log), log[:5000]


def test_bento_builds_offline(server_process, tmp_path):
    """``bentoml build`` with no network (a fresh network namespace where unshare works)."""
    cmd = [bentoml_exe(), "build", "--output", "tag"]
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"]).returncode == 0:
        cmd = ["unshare", "-n", *cmd]
    out = subprocess.run(cmd, cwd=BENTO_DIR, env=bentoml_env(tmp_path), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    listed = subprocess.run([bentoml_exe(), "list", "-o", "json"], env=bentoml_env(tmp_path), capture_output=True,
                            text=True, timeout=120)
    assert any(b["tag"].startswith("paged-backend-smollm2:") for b in json.loads(listed.stdout))
