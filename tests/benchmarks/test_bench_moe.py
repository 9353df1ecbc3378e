"""``bench moe`` is a ``paged-backend bench`` subcommand; without a GPU it says so and exits 2."""

from __future__ import annotations

import pytest
import torch

from paged_backend.benchmarks import moe as bench_moe
from paged_backend.cli import build_parser


def test_bench_moe_is_a_bench_subcommand() -> None:
    """The CLI parses bench moe's grid into the benchmark's own arguments."""
    args = build_parser().parse_args(["bench", "moe", "--m", "1,16", "--experts", "64", "--intermediate", "1408"])
    assert (args.m, args.experts, args.intermediate, args.top_k, args.dtype) == ("1,16", 64, 1408, 2, "bfloat16")
    assert args.func is bench_moe.run


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_bench_moe_without_a_gpu_says_so(capsys) -> None:
    """No CUDA device: exit code 2 and a message, not a traceback."""
    assert bench_moe.main(["--m", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
