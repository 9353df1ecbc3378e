"""``bench serve`` sweeps (``--concurrency`` / ``--request-rate`` lists), their table and plot,
``--compare`` and ``--num-clients``, against a real ``bentoml serve`` of a tiny random model on the
CPU (a 2-layer, hidden-64 Llama with SmolLM2's tokenizer: every sampled id detokenizes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from bento_server import start, stop, wait_ready
from tiny_llama import write_tiny_llama

from paged_backend.benchmarks.serve_multi import merge_results, merged_duration, split_load
from paged_backend.benchmarks.serve_requests import RequestResult, SampleRequest
from paged_backend.cli import main

LENGTHS = ["--random-input-len", "16", "--random-output-len", "6", "--disable-tqdm"]
OURS, PEER = (31, 119, 180), (255, 127, 14)  # matplotlib's first two line colours (C0, C1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, tiny_model):
    srv = start(tmp_path_factory.mktemp("bentoml"), {"model": tiny_model, "load_format": "dummy", "device": "cpu",
                                                     "dtype": "float32", "max_model_len": 128, "max_num_seqs": 16,
                                                     "num_gpu_blocks_override": 64, "log_stats_interval": 0})
    try:
        yield wait_ready(srv).url
    finally:
        stop(srv)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _has_colour(png, rgb: tuple[int, int, int]) -> bool:
    import matplotlib.image

    img = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int)
    return bool((np.abs(img - np.array(rgb)).max(axis=-1) <= 2).sum() > 20)


@pytest.fixture(scope="module")
def sweep(server_url, tmp_path_factory):
    """A 3-point concurrency sweep: (exit status, stdout, JSON rows, PNG path)."""
    import contextlib
    import io

    d = tmp_path_factory.mktemp("sweep")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "serve", "--base-url", server_url, "--concurrency", "1,2,4", "--prompts-per-concurrency",
                   "2", "--num-warmups", "2", *LENGTHS, "--goodput", "ttft:60000", "--json", str(d / "ours.jsonl"),
                   "--plot", str(d / "curve.png")])
    return rc, out.getvalue(), _rows(d / "ours.jsonl"), d / "curve.png"


def test_sweep_prints_a_row_per_point_and_saves_them(sweep):
    rc, out, rows, _ = sweep
    assert rc == 0 and "warm-up: 2 requests" in out and "0 failed (not counted)" in out
    assert [r["max_concurrency"] for r in rows] == [1, 2, 4] and [r["num_prompts"] for r in rows] == [2, 4, 8]
    assert len({r["seed"] for r in rows}) == 3  # fresh prompts at every point
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert "output tok/s" in table[0] and "TTFT p50 / p99 ms" in table[0] and "goodput (req/s)" in table[0]
    assert [line.split("|")[1].strip() for line in table[2:]] == ["1", "2", "4"]
    for r in rows:
        assert r["completed"] == r["num_prompts"] and r["failed"] == 0
        assert r["total_output_tokens"] == 6 * r["num_prompts"]
        assert r["output_throughput"] > 0 and r["request_throughput"] > 0
        assert 0 < r["request_goodput"] <= r["request_throughput"]
        for key in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < r[f"p50_{key}_ms"] <= r[f"p99_{key}_ms"], key
        assert r["p99_ttft_ms"] <= r["p99_e2el_ms"]


def test_sweep_plot_is_a_png_of_one_series(sweep):
    import matplotlib.image

    _, out, _, png = sweep
    assert f"plot: {png}" in out
    assert matplotlib.image.imread(png).shape[:2] == (500, 1200)
    assert _has_colour(png, OURS) and not _has_colour(png, PEER)


def test_compare_overlays_a_saved_run(server_url, sweep, tmp_path, capsys):
    *_, png = sweep
    peer = png.with_name("ours.jsonl")
    rc = main(["bench", "serve", "--base-url", server_url, "--request-rate", "50,inf", "--max-concurrency", "2",
               "--num-prompts", "4", *LENGTHS, "--plot", str(tmp_path / "both.png"), "--compare", str(peer),
               "--compare-label", "saved"])
    out = capsys.readouterr().out
    assert rc == 0 and [line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| 2 ")] == \
        ["50", "inf"]
    assert _has_colour(tmp_path / "both.png", OURS) and _has_colour(tmp_path / "both.png", PEER)


def test_two_client_processes_merge_every_request(server_url, tmp_path):
    path = tmp_path / "two.jsonl"
    rc = main(["bench", "serve", "--base-url", server_url, "--num-clients", "2", "--max-concurrency", "4",
               "--num-prompts", "8", *LENGTHS, "--json", str(path), "--save-detailed"])
    (m,) = _rows(path)
    assert rc == 0 and m["num_clients"] == 2
    assert m["completed"] == 8 and m["failed"] == 0 and m["total_output_tokens"] == 48 and len(m["ttfts"]) == 8
    # percentiles over every request's samples, not the clients' percentiles averaged
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile(np.array(m["ttfts"]) * 1000, 99))
    assert m["p50_itl_ms"] == pytest.approx(np.percentile(np.concatenate(m["itls"]) * 1000, 50))
    assert 0 < m["duration"] and m["output_throughput"] == pytest.approx(48 / m["duration"])
    assert 1 <= m["max_concurrent_requests"] <= 4


def test_soak_takes_its_one_request_rate(server_url, tmp_path):
    path = tmp_path / "soak.jsonl"
    rc = main(["bench", "serve", "--base-url", server_url, "--duration", "2", "--interval", "1",
               "--max-concurrency", "2", "--request-rate", "20", "--num-prompts", "4", *LENGTHS, "--json", str(path)])
    rows = _rows(path)
    assert rc == 0 and [r["kind"] for r in rows][-1] == "soak" and rows[-1]["request_rate"] == 20.0
    assert rows[-1]["completed"] > 0 and rows[-1]["failed"] == 0


# -- without a server --------------------------------------------------------------------


def test_load_is_split_between_clients_and_merged_back_in_order():
    reqs = [SampleRequest(prompt=str(i), prompt_len=i, output_len=1) for i in range(7)]
    shares = split_load(reqs, 3, max_concurrency=8, request_rate=6.0, seed=1)
    assert [s.max_concurrency for s in shares] == [3, 3, 2] and [s.request_rate for s in shares] == [2.0] * 3
    assert [[r.prompt_len for r in s.requests] for s in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert len({s.seed for s in shares}) == 3
    assert len(split_load(reqs, 4, max_concurrency=2, request_rate=math.inf, seed=0)) == 2  # one stream each
    assert split_load(reqs, 2, None, math.inf, 0)[0].max_concurrency is None
    parts = [[RequestResult(prompt_len=r.prompt_len) for r in s.requests] for s in shares]
    assert [r.prompt_len for r in merge_results(parts)] == list(range(7))
    a, b = [RequestResult(start=10.0), RequestResult(start=10.5)], [RequestResult(start=11.0)]
    assert merged_duration([(a, 2.0), (b, 3.0)]) == pytest.approx(4.0)  # 10 .. 14
    assert merged_duration([([], 0.0)]) == 0.0


def test_sweep_flags_are_checked(tmp_path, capsys):
    assert main(["bench", "serve", "--model", "m", "--compare", str(tmp_path / "x.jsonl")]) == 2
    assert "add --plot PNG" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "m", "--duration", "5", "--max-concurrency", "2",
                 "--concurrency", "1,2"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "m", "--concurrency", "1,2", "--max-concurrency", "2"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--model", "m", "--concurrency", "1,0"])


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    """matplotlib made unimportable in a fresh interpreter: the run's results print, then one line
    saying how to install the plot's extra, no traceback."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from paged_backend.cli import main\n"
            f"sys.exit(main(['bench', 'serve', '--base-url', 'http://127.0.0.1:9', '--model', 'm', '--tokenizer', "
            f"'SmolLM2-135M-Instruct', '--num-prompts', '2', '--random-input-len', '8', '--random-output-len', '2', "
            f"'--disable-tqdm', '--plot', {str(tmp_path / 'p.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Serving Benchmark Result" in proc.stdout
    assert "pip install 'paged-backend[bench]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "p.png").exists()
