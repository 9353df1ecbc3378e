"""``bentoml serve`` going away: SIGTERM drains for at most ``drain_timeout`` (503s meanwhile),
then aborts what is left and exits; SIGKILL of ``bentoml serve`` takes its worker with it."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from bento_server import MODEL, start, wait_ready

pytestmark = pytest.mark.slow

ARGS = {"max_model_len": 1024, "num_gpu_blocks_override": 384}
DRAIN_S = 3.0


def _stream(url: str, results: list, started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story:", "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    finish, chunks = None, 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    started.set()
                    if '"finish_reason":"' in line.replace(" ", ""):
                        finish = line.split('"finish_reason":')[1].split('"')[1]
    except httpx.HTTPError as exc:
        finish = f"error: {exc!r}"
    results.append((finish, chunks))


def test_sigterm_drains_for_at_most_drain_timeout_then_aborts_and_exits(tmp_path):
    srv = wait_ready(start(tmp_path, {**ARGS, "drain_timeout": DRAIN_S}))
    results: list = []
    started = [threading.Event() for _ in range(8)]
    threads = [threading.Thread(target=_stream, args=(srv.url, results, e)) for e in started]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), srv.log_tail()
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    # draining: the server still answers, at once, with a 503
    ready = httpx.get(f"{srv.url}/readyz", timeout=5)
    assert ready.status_code == 503
    refused = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                         timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
    srv.proc.wait(DRAIN_S + 30)
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert took < DRAIN_S + 30, took
    assert len(results) == 8
    assert all(finish == "abort" for finish, _ in results), results  # cut by the drain, told so
    assert all(chunks < 300 for _, chunks in results)


def test_sigkill_of_bentoml_serve_takes_the_worker_with_it(tmp_path):
    srv = wait_ready(start(tmp_path, ARGS))
    workers = psutil.Process(srv.proc.pid).children(recursive=True)
    assert workers, "no worker process found"
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    gone, alive = psutil.wait_procs(workers, timeout=30)
    try:
        assert not alive, f"orphaned workers still running: {alive}"
    finally:
        for p in alive:
            p.kill()
