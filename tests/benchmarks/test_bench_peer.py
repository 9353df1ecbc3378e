"""``paged-backend bench peer`` wiring (the benchmark itself needs a GPU and vLLM: H200 only)."""

from __future__ import annotations

import pytest
import torch

from paged_backend.benchmarks import peer as bench_peer
from paged_backend.cli import build_parser


def test_bench_peer_is_a_bench_subcommand_with_the_kernel_grids():
    args = build_parser().parse_args(["bench", "peer", "--only", "int4", "--m", "1,64", "--shapes", "4096x4096"])
    assert args.only == ["int4"] and args.m == "1,64" and args.shapes == "4096x4096"
    assert args.func is not None
    # the defaults are bench kernels' decode grid and bench quant's int4 cells
    d = bench_peer.build_parser().parse_args([])
    assert (d.batches, d.contexts, d.prefill_lens) == ("1,8,64,256", "512,4096,32768", "2048,8192")
    assert (d.m, d.shapes) == ("1,16,64,256", "4096x4096,4096x14336,14336x4096")


def test_bench_peer_has_the_latent_attention_and_block_fp8_grids():
    args = build_parser().parse_args(["bench", "peer", "--only", "mla", "fp8", "--mla-heads", "16", "--mla-fp8",
                                      "--fp8-m", "1,4096"])
    assert args.only == ["mla", "fp8"] and args.mla_heads == "16" and args.mla_fp8 and args.fp8_m == "1,4096"
    d = bench_peer.build_parser().parse_args([])
    assert (d.mla_heads, d.mla_contexts, d.mla_fp8) == ("16,128", "1024,8192,32768", False)
    assert d.fp8_shapes.split(",")[0] == "2112x7168"  # DeepSeek-V3's fused q_a + kv_a projection


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_bench_peer_without_a_gpu_says_so(capsys):
    assert bench_peer.main(["--only", "decode"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
