"""``bench throughput --hf``: transformers beside the engine, on a random-weights (dummy) model.

A config.json-only dir (no weights, no tokenizer), as ``--model-shapes`` writes one: the HF
model is built from the config, pads with id 0, and both transformers modes (padded-batch
``generate`` and paged continuous batching) must give every request exactly its output length.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_fixtures import TINY

from paged_backend.cli import main


def _dummy_dir(tmp_path: Path) -> Path:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
               mlp_bias=False, tie_word_embeddings=True, **{k: v for k, v in TINY.items() if k != "pad_token_id"})
    d = tmp_path / "tiny-dummy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _bench(tmp_path: Path, *extra: str) -> list[dict]:
    res = tmp_path / "bench.jsonl"
    rc = main(["bench", "throughput", "--model", str(_dummy_dir(tmp_path)), "--load-format", "dummy",
               "--dtype", "float32", "--device", "cpu", "--num-prompts", "6", "--input-len", "24",
               "--warmup-prompts", "2", "--kv-cache-memory-bytes", str(16 << 20), "--log-stats-interval", "0",
               "--hf", "--json", str(res), *extra])
    assert rc == 0
    return [json.loads(line) for line in res.read_text().splitlines()]


def test_hf_static_and_continuous_on_a_dummy_model(tmp_path, capsys):
    rows = _bench(tmp_path, "--output-len", "10", "--hf-mode", "both")
    by_engine = {r["engine"]: r for r in rows}
    assert set(by_engine) == {"paged-backend", "transformers generate (batch 6)",
                              "transformers generate_batch (continuous)"}
    for r in rows:
        assert r["prompts"] == 6 and r["input_tokens"] == 6 * 24
        assert r["output_tokens"] == 6 * 10
        assert r["elapsed_s"] > 0 and r["output_tok_s"] > 0
    assert "transformers continuous batching: attention" in capsys.readouterr().out


def test_hf_continuous_gives_each_request_its_own_length(tmp_path):
    rows = _bench(tmp_path, "--output-len", "8", "--random-range-ratio", "0.5", "--hf-mode", "continuous",
                  "--hf-num-blocks", "8", "--hf-max-batch-tokens", "64")
    engine, hf = rows
    assert engine["engine"] == "paged-backend"
    assert hf["engine"] == "transformers continuous batching (per-request lengths)"
    # lengths differ per request (range 4..12); both produced exactly the requested total
    assert hf["output_tokens"] == engine["output_tokens"] != 6 * 8
    assert hf["input_tokens"] == engine["input_tokens"]


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_hf_mode_is_one_row(tmp_path, mode):
    rows = _bench(tmp_path, "--output-len", "4", "--hf-mode", mode, "--hf-batch-size", "4")
    label = "transformers generate (batch 4)" if mode == "static" else "transformers generate_batch (continuous)"
    assert [r["engine"] for r in rows] == ["paged-backend", label]
    assert rows[1]["output_tokens"] == 6 * 4
