"""FP8 (e4m3) activation quantization in Triton: one program per row, amax then quantize.

Same math as ``fp8_quant_ref.quantize_fp8_ref`` (bit-exact: division by the scale, clamp, then a
round-to-nearest-even cast). The dynamic per-token case is one launch (row amax and quantization
fused); per-tensor and static scales are computed by the caller and passed in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from paged_backend.kernels._launch import FLOAT_DTYPES, check_device, check_tensor
from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, FP8_MAX, MIN_AMAX


@triton.jit
def _fp8_quant_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # e4m3 [M, K]
    scale_ptr,  # float32: [M] written (DYNAMIC), else read ([M] if PER_ROW else [1])
    K,
    stride_xm,
    stride_qm,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    DYNAMIC: tl.constexpr,
    PER_ROW: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if DYNAMIC:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
        tl.store(scale_ptr + row, scale)
    elif PER_ROW:
        scale = tl.load(scale_ptr + row)
    else:
        scale = tl.load(scale_ptr)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)  # IEEE division, as torch
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32, last dim contiguous
    scale: torch.Tensor | None = None,  # float32 [1] or [M, 1]; None: dynamic per token
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [M, K], float32 [M, 1] or the given scale)
    """Triton twin of ``quantize_fp8_ref`` (dynamic: per token only; per-tensor callers pass the scale)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = check_device(x, "x")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=device)
    if scale is None:
        out_scale = torch.empty((m, 1), dtype=torch.float32, device=device)
        per_row = True
    else:
        check_tensor("scale", scale, dtypes=(torch.float32,), device=device, contiguous=True)
        if scale.numel() not in (1, m) or (scale.numel() == m and m != 1 and scale.dim() != 2):
            raise ValueError(f"scale must have 1 or M={m} elements ([M, 1]), got shape {tuple(scale.shape)}")
        out_scale = scale
        per_row = scale.numel() == m and scale.numel() != 1
    if m == 0 or k == 0:
        return q, out_scale if scale is not None else out_scale.fill_(MIN_AMAX / FP8_MAX)
    block_k = min(4096, triton.next_power_of_2(k))
    _fp8_quant_kernel[(m,)](
        x, q, out_scale, k, x.stride(0), q.stride(0),
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, DYNAMIC=scale is None, PER_ROW=per_row, BLOCK_K=block_k,
        num_warps=4 if block_k <= 1024 else 8,
    )
    return q, out_scale
