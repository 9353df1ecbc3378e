"""The block-scaled FP8 GEMM (the MoE kernel's block-FP8 path over one expert) under the CPU interpreter
(compiled on CUDA), against ``fp8_block_gemm_ref``: M tails, N and K not multiples of the 128 x 128 blocks,
bias, fp32 / bf16 activations, poisoned outputs; the quantized linear's CUDA path through it."""

from __future__ import annotations

import pytest
import torch

from paged_backend.kernels.fp8_block_gemm import dense_config, fp8_block_gemm
from paged_backend.kernels.fp8_block_gemm_ref import fp8_block_gemm_ref
from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, FP8_MAX, fp8_scale_from_amax
from paged_backend.kernels.fused_moe import MoEConfig

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def _weights(n: int, k: int, block=(128, 128), seed=0, device="cpu"):
    """e4m3 [n, k] and its block scales, quantized block by block from N(0, 0.05)."""
    bn, bk = block
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n)).reshape(rows, bn, cols, bk)
    scale = fp8_scale_from_amax(padded.abs().amax(dim=(1, 3)))
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.to(device), scale.to(device)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (5, 200, 256), (33, 64, 300), (17, 130, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(m, n, k, dtype):
    w, ws = _weights(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    bias = torch.randn(n).to(dtype)
    got = fp8_block_gemm(x, w, ws, (128, 128), bias)
    want = fp8_block_gemm_ref(x, w, ws, (128, 128), bias)
    assert got.shape == (m, n) and got.dtype == dtype and not got.isnan().any()
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_tiles_of_several_rows_and_a_swizzle():
    w, ws = _weights(96, 256, seed=3)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(1))
    cfg = MoEConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, GROUP_M=2, num_stages=1)
    got = fp8_block_gemm(x, w, ws, (128, 128), config=cfg)
    assert _rel(got, fp8_block_gemm_ref(x, w, ws, (128, 128))) < 1e-5


def test_mismatched_scales_and_empty_batches():
    w, ws = _weights(64, 256)
    with pytest.raises(ValueError, match="do not match"):
        fp8_block_gemm(torch.randn(2, 256), w, ws[:, :1], (128, 128))
    assert fp8_block_gemm(torch.randn(0, 256), w, ws, (128, 128)).shape == (0, 64)
    assert dense_config(4, 64, 128).BLOCK_K == 128


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 64, 300, 1024])
def test_compiled_deepseek_v3_shapes(m):
    """q_a_proj's (1536 x 7168) and kv_a_proj's (576 x 7168, N not a multiple of 128) shapes on the GPU."""
    for n, k in [(1536, 7168), (576, 7168), (7168, 2048)]:
        w, ws = _weights(n, k, seed=m, device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got = fp8_block_gemm(x, w, ws, (128, 128))
        want = fp8_block_gemm_ref(x.float(), w, ws, (128, 128))
        assert _rel(got.float(), want) < 1e-2
        exact = fp8_block_gemm(x.float(), w, ws, (128, 128))
        assert _rel(exact, want) < 1e-5
