"""SiLU-and-mul in Triton: ``silu(x[:, :I]) * x[:, I:]`` for the fused gate/up projection.

Rounds like the torch reference (silu rounded to the dtype, then the product), so bf16
results match it to the last bit up to the exp implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_backend.kernels._launch import FLOAT_DTYPES, check_device, check_tensor


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    inter,  # I
    stride_xt,
    stride_ot,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * stride_xt
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    silu = silu.to(out_ptr.dtype.element_ty).to(tl.float32)  # torch rounds silu(x) to the dtype
    tl.store(out_ptr + t * stride_ot + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Triton SiLU-and-mul over the last dim (any leading dims, last dim contiguous)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_device(x, "x")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dim (gate | up), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.reshape(*lead, inter)
    block = min(2048, triton.next_power_of_2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.reshape(*lead, inter)
