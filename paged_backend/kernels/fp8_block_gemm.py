"""Block-scaled FP8 GEMM in Triton (``fp8_block_gemm_ref``'s contract): the fused-MoE kernel's block-FP8 path
(``paged_backend/kernels/fused_moe.py``, QUANT 1) run over one expert with its rows in order (``moe_gemm`` with no
routing), so the dense linears of DeepSeek-V3 / GLM FP8 checkpoints and their experts share one kernel.

Each k-step (BLOCK_K = bk, one activation scale group and one weight-scale block) is one e4m3 MMA
(``fp8_dot_dtype``: FP8 tensor cores from compute capability 8.9; exact fp16 MMAs for fp32 inputs), then
both scales, added to an fp32 accumulator: the partial sums of a block are promoted every bk inputs, as
DeepGEMM and vLLM's ``w8a8_block_fp8_matmul`` do. Tiles by M (``dense_config``): 16-row tiles for decode
batches, 64 and 128 beyond, swizzled for L2 reuse. Activations are quantized per token and bk inputs by
``quantize_fp8_groups`` first.
"""

from __future__ import annotations

import torch

from paged_backend.kernels._launch import check_device, check_tensor, interpreting
from paged_backend.kernels.fp8_quant import quantize_fp8_groups
from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE
from paged_backend.kernels.fused_moe import MoEConfig, moe_gemm


def dense_config(m: int, n: int, bk: int) -> MoEConfig:
    """The tile for M rows x N outputs (BLOCK_K = bk, the scale block)."""
    if interpreting():
        return MoEConfig(BLOCK_M=16, BLOCK_N=max(16, min(128, 1 << (n - 1).bit_length())), BLOCK_K=bk,
                         num_stages=1)
    if m <= 16:
        return MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return MoEConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 256:
        return MoEConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=4, num_stages=3)
    return MoEConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=3)


def fp8_block_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    w: torch.Tensor,  # e4m3 [N, K]
    w_scale: torch.Tensor,  # float32 [ceil(N / bn), ceil(K / bk)]
    block_shape: tuple[int, int],  # (bn, bk)
    bias: torch.Tensor | None = None,
    *,
    config: MoEConfig | None = None,
) -> torch.Tensor:  # [M, N], x's dtype
    """y = act_quant(x) @ dequant(w).T (+ bias), in the MoE kernel's block-FP8 path (module docstring)."""
    check_tensor("w", w, ndim=2, dtypes=(FP8_DTYPE,))
    device = check_device(x, "x")
    m, k = x.shape
    n = w.shape[0]
    bn, bk = (int(b) for b in block_shape)
    if w.shape[1] != k or tuple(w_scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"fp8_block_gemm: x {tuple(x.shape)}, w {tuple(w.shape)} and scales "
                         f"{tuple(w_scale.shape)} do not match ({bn} x {bk} blocks)")
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0:
        return out
    xq, xs = quantize_fp8_groups(x.contiguous(), bk)
    cfg = config or dense_config(m, n, bk)
    moe_gemm(xq, w.unsqueeze(0), out, None, cfg, a_scale=xs, w_scale=w_scale.unsqueeze(0),
             block_shape=(bn, bk), fp8_exact=x.dtype == torch.float32)
    if bias is not None:
        out += bias
    return out
