"""``paged-backend bench quant`` end to end as a CPU smoke run (Triton interpreter, tiny shapes):
every variant is checked and recorded, the sweep finds and ranks configs, the JSON and the
table come out. The timings are meaningless here; the device run is what they are for."""

from __future__ import annotations

import json

import pytest

from paged_backend.benchmarks import quant as bench_quant
from paged_backend.benchmarks import quant_sweep
from paged_backend.cli import build_parser
from paged_backend.kernels.int4_gemm import Int4Config


@pytest.fixture
def small_sweep(monkeypatch):
    monkeypatch.setattr(quant_sweep, "sweep_candidates", lambda m: [
        Int4Config("dot", block_m=16, block_n=32, block_k=64, swap_ab=True),
        Int4Config("gemv", block_m=1 if m == 1 else 4, block_n=32, block_k=32)])
    monkeypatch.setattr(quant_sweep, "split_candidates", lambda m: [1, 2])


def test_bench_quant_smoke_on_cpu(tmp_path, capsys, small_sweep):
    out = tmp_path / "q.json"
    args = build_parser().parse_args(["bench", "quant", "--device", "cpu", "--m", "1,16", "--shapes", "128x64",
                                      "--sweep", "--json", str(out)])
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["failures"] == []
    variants = {(r["variant"], r["M"]) for r in data["rows"]}
    for m in (1, 16):
        for v in ("bf16 cuBLAS", "int4", "int4 act-order", "fp8 token", "fp8 tensor", "fp8 token nopad",
                  "fp8 tensor nopad", "fp8 gemm only"):
            assert (v, m) in variants, (v, m)
    int4 = next(r for r in data["rows"] if r["variant"] == "int4" and r["M"] == 1)
    assert int4["us"] > 0 and int4["speedup"] > 0 and "split" in int4["config"]
    sweep = data["sweep"]
    assert {r["M"] for r in sweep} == {1, 16} and all(r["us"] > 0 for r in sweep)
    # the candidates, then split counts and the reduce kernel on the two best; duplicates timed once
    labels = [r["config"] for r in sweep if r["M"] == 1]
    assert len(labels) == len(set(labels)) >= 5
    assert set(data["suggested"]) == {"1", "16"}
    Int4Config(**data["suggested"]["1"]["config"])  # a valid config
    text = capsys.readouterr().out
    assert "| K x N | M | bf16 | int4 | int4 act-order | fp8 token |" in text
    assert text.rstrip().splitlines()[-1].startswith("| 128 x 64 | 16 |")  # the table comes last
    assert "suggested int4 default_config per M" in text


def test_bench_quant_needs_cuda_unless_asked_for_cpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert bench_quant.main(["--m", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
