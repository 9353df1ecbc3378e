"""``bench throughput --plot``: output tok/s per run beside a peer's results file, and the KV-cache
usage of each timed run (read per engine step), on a tiny random model on the CPU."""

from __future__ import annotations

import json

import pytest
from tiny_llama import write_tiny_llama

from paged_backend.benchmarks.throughput_plot import KVUsageTrace
from paged_backend.cli import main

PEER = (255, 127, 14)  # matplotlib's second colour (C1): the --compare bars


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_throughput_plot_with_a_peer_file(tiny, tmp_path, capsys):
    import matplotlib.image
    import numpy as np

    peer = tmp_path / "peer.jsonl"
    peer.write_text("".join(json.dumps({"engine": "vllm", "temperature": t, "output_tok_s": v}) + "\n"
                            for t, v in ((0, 900.0), (1, 800.0))) + json.dumps({"note": "no rate"}) + "\n")
    png = tmp_path / "runs.png"
    rc = main(["bench", "throughput", "--model", str(tiny), "--load-format", "dummy", "--dtype", "float32",
               "--device", "cpu", "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
               "--warmup-prompts", "1", "--temperatures", "0,1", "--json", str(tmp_path / "ours.jsonl"),
               "--plot", str(png), "--compare", str(peer), "--compare-label", "vllm"])
    assert rc == 0 and f"plot: {png}" in capsys.readouterr().out
    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (500, 1400)  # two panels: the runs and the KV-cache usage
    rgb = (img[..., :3] * 255).round().astype(int)
    assert (np.abs(rgb - np.array(PEER)).max(axis=-1) <= 2).sum() > 100  # the peer's bars are drawn


def test_kv_usage_trace_reads_every_step_and_unhooks(tiny):
    from paged_backend import LLM, SamplingParams

    llm = LLM(str(tiny), load_format="dummy", dtype="float32", device="cpu", max_model_len=128,
              num_gpu_blocks_override=32)
    stats = llm.engine.stats
    with KVUsageTrace(llm.engine) as trace:
        llm.generate([[5, 6, 7, 8] * 8] * 3, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert "on_step" not in vars(stats)  # the engine's own method again
    steps = stats.num_steps
    assert len(trace.samples) == steps >= 6
    times = [t for t, _ in trace.samples]
    usage = [u for _, u in trace.samples]
    assert times == sorted(times) and all(0 <= u <= 1 for u in usage) and max(usage) > 0  # freed at the end
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(trace.samples) == steps  # no longer recording


def test_compare_without_plot_is_refused(tmp_path, capsys):
    assert main(["bench", "throughput", "--compare", str(tmp_path / "x.jsonl")]) == 2
    assert "add --plot PNG" in capsys.readouterr().err
