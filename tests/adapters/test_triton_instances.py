"""A real ``tritonserver`` with two instances of one model (``instance_group`` count 2): two Python backend
stub processes, front ends of one shared engine core process (the model loaded once); both serve greedy
requests as the offline engine, the engine's counters are published once over both instances' metrics, and
stopping the server leaves no process."""

from __future__ import annotations

import concurrent.futures

import httpx
import psutil
import pytest
from paged_backend.adapters.triton_local import TritonServer
from paged_backend.adapters.triton_repo import DEFAULT_ENGINE_ARGS, write_model_repository

from paged_backend.engine.core_client import RUN_DIR_ENV

pytestmark = pytest.mark.slow

MODEL = "paged_llm_two"
ENGINE_ARGS = {**DEFAULT_ENGINE_ARGS, "max_model_len": 256, "num_gpu_blocks_override": 96}
PROMPTS = ["The capital of France is", "The three primary colors are", "def fibonacci(n):"]
GREEDY = {"max_tokens": 10, "temperature": 0}
N = 8


def _metric(text: str, name: str, series: tuple[int, ...] = (2,)) -> float:
    """The sum over the model's instances (each instance's series has its ``instance`` label)."""
    lines = [ln for ln in text.splitlines() if ln.startswith(name + "{") and f'model="{MODEL}"' in ln]
    assert len(lines) in series and len({ln.split('instance="')[1].split('"')[0] for ln in lines}) == len(lines), lines
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_two_model_instances_share_one_engine_core(tmp_path, monkeypatch):
    from paged_backend import LLM, SamplingParams

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))  # tritonserver and its stubs inherit it
    write_model_repository(tmp_path / "repo", model_name=MODEL, engine_args=ENGINE_ARGS, instance_count=2)
    server = TritonServer(tmp_path / "repo", workdir=tmp_path / "work").launch()
    try:
        offline = LLM(ENGINE_ARGS["model"], max_model_len=256, num_gpu_blocks_override=96)
        want = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]
        server.wait_ready(600)
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        cores = [p for p in tree if "paged_backend.engine.core_process" in " ".join(p.cmdline())]
        stubs = [p for p in tree if "triton_python_backend_stub" in " ".join(p.cmdline())]
        assert len(stubs) == 2 and len(cores) == 1, (stubs, cores)
        assert cores[0].ppid() in {s.pid for s in stubs}  # started by the first instance
        assert "2 attached" in server.log_file.read_text(errors="replace")

        url = f"http://{server.http_url}/v2/models/{MODEL}/generate"

        def generate(i: int) -> str:
            resp = httpx.post(url, json={"text_input": PROMPTS[i % 3], "exclude_input_in_output": True,
                                         "parameters": GREEDY}, timeout=300)
            assert resp.status_code == 200, resp.text
            return resp.json()["text_output"]

        with concurrent.futures.ThreadPoolExecutor(N) as pool:
            texts = list(pool.map(generate, range(N)))
        assert texts == [want[i % 3] for i in range(N)]
        metrics = httpx.get(server.metrics_url, timeout=30).text
        # per request, by the instance that served it; the engine's counters once
        # (a request_success series appears with an instance's first finished request)
        assert _metric(metrics, "vllm:request_success_total", (1, 2)) == N
        assert _metric(metrics, "vllm:generation_tokens_total") == N * GREEDY["max_tokens"]
    finally:
        rc = server.stop()
    assert rc == 0, server.log_tail()
    psutil.wait_procs(tree, timeout=15)
    assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
