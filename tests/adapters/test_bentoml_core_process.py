"""``bentoml serve --arg engine_core_process=true``: the engine steps in a core process of the worker; the
OpenAI API answers as in-process (greedy text equal to the offline engine), and stopping the server leaves
no process behind. ``--arg workers=2``: both workers are front ends of one shared engine core."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import openai
import psutil
import pytest
from bento_server import MODEL, serving, start, stop, wait_ready

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"max_model_len": 512, "num_gpu_blocks_override": 128, "device": "cpu"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("bentoml"), {**ENGINE_ARGS, "engine_core_process": "true"})
    yield srv
    stop(srv)


@pytest.fixture(scope="module")
def offline():
    """The offline engine the server's greedy answers must equal (built while the server loads)."""
    from paged_backend import LLM

    return LLM(MODEL, **ENGINE_ARGS)


def test_completion_and_streamed_chat_in_core_process_mode(server_process, offline):
    from paged_backend import SamplingParams

    server = wait_ready(server_process)
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    assert any("spawn_main" in " ".join(p.cmdline()) for p in procs), "no engine core process"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)

    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert resp.choices[0].text == offline.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text

    want = offline.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)

    # SIGTERM reaches the worker's whole process tree; the core keeps stepping while the worker drains
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    server.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert stop(server), "bentoml serve did not stop on SIGTERM within 60s"
    psutil.wait_procs(procs, timeout=10)
    assert not [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_workers_share_one_engine_core(tmp_path, offline):
    """``--arg workers=2``: two worker processes (front ends), one engine core process (the model loaded
    once); both answer greedy requests as the offline engine; stopping the server leaves no process."""
    from paged_backend import SamplingParams
    from paged_backend.engine.core_client import RUN_DIR_ENV

    with serving(tmp_path, {**ENGINE_ARGS, "workers": 2}, env={RUN_DIR_ENV: str(tmp_path / "run")}) as server:
        cores: dict[int, int] = {}  # worker pid -> its engine core's pid, as /stats reports them
        deadline = time.monotonic() + 300
        while len(cores) < 2 and time.monotonic() < deadline:  # a new connection reaches either worker
            stats = httpx.post(f"{server.url}/stats", json={}, timeout=30).json()
            if "engine_core_pid" in stats.get("model", {}):
                cores[stats["worker_pid"]] = stats["model"]["engine_core_pid"]
            else:
                time.sleep(0.2)  # that worker is still attaching
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        core_procs = [p for p in tree if "paged_backend.engine.core_process" in " ".join(p.cmdline())]
        assert len(cores) == 2, f"/stats answered from {cores}"
        assert [p.pid for p in core_procs] == list(set(cores.values())), "not one engine core for both workers"
        assert stats["engine_core_clients"] == 2
        assert not any("spawn_main" in " ".join(p.cmdline()) for p in tree), "a worker loaded its own engine"

        want = offline.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # one client (connection) each
            texts = list(pool.map(lambda _: openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                                          max_retries=0, timeout=300).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text, range(6)))
        assert texts == [want[0].outputs[0].text] * 6

        # a client leaving mid-stream: its worker aborts the request, the core frees its blocks, every worker sees it
        before = stats
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            next(line for line in resp.iter_lines() if line.startswith("data: "))
        seen = {}
        while set(seen) != set(cores) and time.monotonic() < deadline:  # both workers' views
            stats = httpx.post(f"{server.url}/stats", json={}, timeout=30).json()
            if stats["num_aborted_total"] == before["num_aborted_total"] + 1:
                seen[stats["worker_pid"]] = stats
        assert set(seen) == set(cores)
        for stats in seen.values():
            assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["model"]["num_gpu_blocks"]
    psutil.wait_procs(tree, timeout=15)
    assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
