"""README's adapter-API example, run as written: a plain FastAPI app around EngineAdapter."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def _example_source() -> str:
    text = README.read_text()
    section = text.split("\n## Adapter API", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "README's Adapter API section has no python example"
    return blocks[0]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    path = tmp_path_factory.mktemp("example") / "example.py"
    path.write_text(_example_source())
    spec = importlib.util.spec_from_file_location("readme_adapter_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_example_serves_its_endpoint_and_the_openai_routes(example):
    text = "Paged attention splits the KV cache into fixed-size blocks, like virtual memory pages."
    with TestClient(example.app) as client:  # runs the lifespan: loads the model, then shuts it down
        assert example.adapter.is_ready
        resp = client.post("/summarize", json={"text": text, "max_tokens": 12})
        assert resp.status_code == 200, resp.text
        summary = resp.json()["summary"]
        assert summary and 0.0 <= resp.json()["kv_cache_usage"] <= 1.0
        chat = client.post("/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": f"Summarize in one sentence: {text}"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] == summary  # same engine, same greedy answer
        bad = client.post("/summarize", json={"text": text, "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["detail"]["param"] == "max_tokens"
    assert not example.adapter.is_ready  # shut down with the app
