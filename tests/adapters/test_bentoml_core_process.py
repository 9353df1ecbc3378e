"""``bentoml serve --arg engine_core_process=true``: the engine steps in a core process of the worker; the
OpenAI API answers as in-process (greedy text equal to the offline engine), and stopping the server leaves
no process behind."""

from __future__ import annotations

import signal

import openai
import psutil
import pytest
from bento_server import MODEL, start, stop, wait_ready

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
