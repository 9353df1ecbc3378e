"""Rotary embedding in Triton, neox style (HF's ``rotate_half``), query and key in one launch.

The cos/sin table is the reference's: float32 ``[max_positions, D]``, cos in ``[:, :D/2]``,
sin in ``[:, D/2:]`` (llama3/linear scaling are baked into it by ``rope_inv_freq``)::

    out[:half] = x1 * cos - x2 * sin        out[half:] = x2 * cos + x1 * sin

``q_scale`` (the attention backend's ``query_scale``: the softmax scale times log2(e) where the
paged-attention kernel takes q pre-scaled) multiplies the rotated query, rounded to the dtype
first and once more after the product, as ``torch.mul`` would: the attention launcher's own
elementwise pass over q, folded into this one.

Every product and sum is rounded to the activation dtype as torch (and HF) round them,
so the interpreter matches the reference bit for bit; compiled, LLVM may narrow a
product and the sum to bf16/fp16 and fuse them into one FMA (one rounding instead of
two), so the GPU can differ from the reference by one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from paged_backend.kernels._launch import FLOAT_DTYPES, check_device, check_tensor


@triton.jit
def _load_halves(x_ptr, num_heads, stride_h, HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """This token's heads of x [NH, D] as float32 halves [H_PAD, HALF_PAD] each."""
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (i < HALF)
    x1 = tl.load(x_ptr + h * stride_h + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + h * stride_h + HALF + i, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_rotated(
    o_ptr,  # [NH, D] contiguous (this token's row)
    x1,  # [H_PAD, HALF_PAD] float32
    x2,
    cos,  # [HALF_PAD] float32, already rounded to the dtype
    sin,
    num_heads,
    scale,  # SCALE: the rounded results times this, rounded again
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    SCALE: tl.constexpr,
):
    dt = o_ptr.dtype.element_ty
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (i < HALF)
    c = cos[None, :]
    s = sin[None, :]
    a1 = (x1 * c).to(dt).to(tl.float32)
    b1 = (-x2 * s).to(dt).to(tl.float32)
    a2 = (x2 * c).to(dt).to(tl.float32)
    b2 = (x1 * s).to(dt).to(tl.float32)
    lo = (a1 + b1).to(dt)
    hi = (a2 + b2).to(dt)
    if SCALE:
        lo = (lo.to(tl.float32) * scale).to(dt)
        hi = (hi.to(tl.float32) * scale).to(dt)
    tl.store(o_ptr + h * (2 * HALF) + i, lo, mask=mask)
    tl.store(o_ptr + h * (2 * HALF) + HALF + i, hi, mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,  # int [T]
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, Hkv, D]
    cs_ptr,  # float32 [max_positions, D]: cos | sin
    qo_ptr,  # [T, H, D] contiguous
    ko_ptr,  # [T, Hkv, D] contiguous
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    q_scale,  # SCALE_Q: multiplies the rotated query
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr,
    SCALE_Q: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    # every load first: stores to the outputs could alias them, so nothing moves past a store
    q1, q2 = _load_halves(q_ptr + t * stride_qt, num_q_heads, stride_qh, HALF, HQ_PAD, HALF_PAD)
    k1, k2 = _load_halves(k_ptr + t * stride_kt, num_k_heads, stride_kh, HALF, HK_PAD, HALF_PAD)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    imask = i < HALF
    dt = qo_ptr.dtype.element_ty
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=imask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=imask, other=0.0).to(dt).to(tl.float32)
    _store_rotated(qo_ptr + t * num_q_heads * (2 * HALF), q1, q2, cos, sin, num_q_heads, q_scale, HALF, HQ_PAD,
                   HALF_PAD, SCALE_Q)
    _store_rotated(ko_ptr + t * num_k_heads * (2 * HALF), k1, k2, cos, sin, num_k_heads, 1.0, HALF, HK_PAD,
                   HALF_PAD, False)


def rotary(
    positions: torch.Tensor,  # int [T]
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # float32 [max_positions, D]
    q_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns new contiguous rotated (query, key) in their dtype (inputs may be strided views);
    ``q_scale`` multiplies the rotated query (see the module docstring)."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    device = check_device(query, "query")
    t, h, d = query.shape
    check_tensor("key", key, shape=(t, None, d), dtypes=(query.dtype,), device=device)
    check_tensor("positions", positions, shape=(t,), dtypes=(torch.int32, torch.int64), device=device)
    check_tensor("cos_sin_cache", cos_sin_cache, shape=(None, d), dtypes=(torch.float32,), device=device)
    if d % 2:
        raise ValueError(f"head_dim must be even for neox rotary, got {d}")
    q_out = torch.empty((t, h, d), dtype=query.dtype, device=device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=device)
    if t == 0:
        return q_out, k_out
    half = d // 2
    half_pad = triton.next_power_of_2(half)
    hq_pad = triton.next_power_of_2(h)
    hk_pad = triton.next_power_of_2(key.shape[1])
    _rotary_kernel[(t,)](
        positions,
        query,
        key,
        cos_sin_cache,
        q_out,
        k_out,
        h,
        key.shape[1],
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        float(q_scale) if q_scale is not None else 1.0,
        HALF=half,
        HALF_PAD=half_pad,
        HQ_PAD=hq_pad,
        HK_PAD=hk_pad,
        SCALE_Q=q_scale is not None,
        num_warps=4 if hq_pad * half_pad <= 2048 else 8,
    )
    return q_out, k_out
