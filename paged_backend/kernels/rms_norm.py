"""RMSNorm in Triton, optionally fused with the residual add (one pass over the row).

Rounds as the reference (and HF's LlamaRMSNorm) does::

    residual_out = round_dtype(x + residual)
    out = round_out(weight * round_dtype(h * rsqrt(mean(h^2) + eps)))    h = residual_out in fp32
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_backend.kernels._launch import FLOAT_DTYPES, check_device, check_tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H]  (unused without HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [T, H]
    res_out_ptr,  # [T, H]  (unused without HAS_RESIDUAL)
    hidden,  # H
    eps,
    stride_xt,
    stride_rt,
    stride_ot,
    stride_rot,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # before any store: no alias wait
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_rot + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / hidden
    normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H], shape and dtype of x
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, x + residual); the new residual is None when none was given.

    ``normed`` has dtype ``promote(weight, x)`` as in the reference.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    device = check_device(x, "x")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    hidden = x.shape[-1]
    check_tensor("weight", weight, shape=(hidden,), dtypes=FLOAT_DTYPES, device=device)
    if residual is not None:
        check_tensor("residual", residual, shape=tuple(x.shape), dtypes=(x.dtype,), device=device)
    x2 = x.reshape(-1, hidden)
    r2 = residual.reshape(-1, hidden) if residual is not None else x2
    t = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=device) if residual is not None else None
    if t == 0 or hidden == 0:
        return out, res_out
    r_out = res_out if res_out is not None else out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(t,)](
        x2,
        r2,
        weight,
        out,
        r_out,
        hidden,
        float(eps),
        x2.stride(0),
        r2.stride(0),
        hidden,
        hidden,
        BLOCK_H=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=4 if block <= 4096 else (8 if block <= 16384 else 16),
    )
    return out, res_out
