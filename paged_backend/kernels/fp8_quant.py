"""FP8 (e4m3) activation quantization in Triton: one program per row, amax then quantize.

Same math as ``fp8_quant_ref.quantize_fp8_ref`` (bit-exact: division by the scale, clamp, then a
round-to-nearest-even cast). The dynamic per-token case is one launch (row amax and quantization
fused); per-tensor and static scales are computed by the caller and passed in.

``quantize_fp8_groups`` (``quantize_fp8_groups_ref``): one scale per row and per group of inputs
(block-fp8 models' 1 x 128 activation groups), a program per row and run of groups.
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


@triton.jit
def _fp8_group_quant_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # e4m3 [M, K]
    scale_ptr,  # float32 [M, G]
    K,
    num_groups,
    stride_xm,
    stride_qm,
    stride_sm,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of two
    GROUPS: tl.constexpr,  # groups per program
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, GROUP_P2)
    cols = g[:, None] * GROUP + j[None, :]
    mask = (g[:, None] < num_groups) & (j[None, :] < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), FP8_MAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + g, scale, mask=g < num_groups)


def quantize_fp8_groups(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32, last dim contiguous
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [M, K], float32 [M, ceil(K / group)], contiguous)
    """Triton twin of ``quantize_fp8_groups_ref`` (dynamic, per row and per ``group`` inputs)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = check_device(x, "x")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=device)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=device)
    if m == 0 or k == 0:
        return q, scale
    group_p2 = triton.next_power_of_2(group)
    groups = max(1, min(triton.next_power_of_2(num_groups), 4096 // group_p2))
    _fp8_group_quant_kernel[(m, triton.cdiv(num_groups, groups))](
        x, q, scale, k, num_groups, x.stride(0), q.stride(0), scale.stride(0),
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, GROUP=group, GROUP_P2=group_p2, GROUPS=groups,
        num_warps=4 if groups * group_p2 <= 1024 else 8,
    )
    return q, scale
