"""Rotary embedding in Triton (HF's ``rotate_half``, neox or interleaved), query and key in one launch.

The cos/sin table is the reference's: float32 ``[max_positions, R]``, cos in ``[:, :R/2]``, sin in
``[:, R/2:]`` (llama3/linear scaling are baked into it by ``rope_inv_freq``). The first R dims of
each head (R <= head_dim: partial rotary) are rotated as pairs ``(x1, x2)`` of dims
``(i, i + R/2)`` (neox) or ``(2i, 2i + 1)`` (``interleaved``), pair ``i`` by frequency ``i``::

    x1' = x1 * cos - x2 * sin        x2' = x2 * cos + x1 * sin

and the dims from R on are copied as they are.

``q_scale`` (the attention backend's ``query_scale``: the softmax scale times log2(e) where the
paged-attention kernel takes q pre-scaled) multiplies the whole rotated query, rounded to the dtype
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
def _pair_offsets(HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Offsets in a head of each pair's two dims [1, HALF_PAD] (neox halves or adjacent dims)."""
    i = tl.arange(0, HALF_PAD)[None, :]
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    return i, i + HALF


@triton.jit
def _load_dims(x_ptr, num_heads, stride_h, offs, n, H_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """This token's heads of x at head offsets ``offs`` [1, N_PAD] (the first ``n`` valid) as float32."""
    h = tl.arange(0, H_PAD)[:, None]
    mask = (h < num_heads) & (tl.arange(0, N_PAD)[None, :] < n)
    return tl.load(x_ptr + h * stride_h + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_dims(o_ptr, x, num_heads, offs, n, scale, D: tl.constexpr, H_PAD: tl.constexpr, N_PAD: tl.constexpr,
                SCALE: tl.constexpr):
    """Stores x (values of the dtype) at head offsets ``offs`` of the contiguous [NH, D] row;
    SCALE: times ``scale``, rounded again."""
    dt = o_ptr.dtype.element_ty
    h = tl.arange(0, H_PAD)[:, None]
    mask = (h < num_heads) & (tl.arange(0, N_PAD)[None, :] < n)
    if SCALE:
        x = x.to(tl.float32) * scale
    tl.store(o_ptr + h * D + offs, x.to(dt), mask=mask)


@triton.jit
def _store_rotated(
    o_ptr,  # [NH, D] contiguous (this token's row)
    x1,  # [H_PAD, HALF_PAD] float32: the first dim of each pair
    x2,  # the second
    cos,  # [HALF_PAD] float32, already rounded to the dtype
    sin,
    num_heads,
    scale,  # SCALE: the rounded results times this, rounded again
    HALF: tl.constexpr,
    D: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    SCALE: tl.constexpr,
):
    dt = o_ptr.dtype.element_ty
    first, second = _pair_offsets(HALF, HALF_PAD, INTERLEAVED)
    c = cos[None, :]
    s = sin[None, :]
    a1 = (x1 * c).to(dt).to(tl.float32)
    b1 = (-x2 * s).to(dt).to(tl.float32)
    a2 = (x2 * c).to(dt).to(tl.float32)
    b2 = (x1 * s).to(dt).to(tl.float32)
    _store_dims(o_ptr, (a1 + b1).to(dt), num_heads, first, HALF, scale, D, H_PAD, HALF_PAD, SCALE)
    _store_dims(o_ptr, (a2 + b2).to(dt), num_heads, second, HALF, scale, D, H_PAD, HALF_PAD, SCALE)


@triton.jit
def _copy_rest(x_ptr, o_ptr, num_heads, stride_h, scale, ROT: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr,
               PASS_PAD: tl.constexpr, SCALE: tl.constexpr):
    """Partial rotary: dims [ROT, D) of each head as they are (SCALE: times ``scale``, like the rest of q)."""
    rest = ROT + tl.arange(0, PASS_PAD)[None, :]
    x = _load_dims(x_ptr, num_heads, stride_h, rest, D - ROT, H_PAD, PASS_PAD)
    _store_dims(o_ptr, x, num_heads, rest, D - ROT, scale, D, H_PAD, PASS_PAD, SCALE)


@triton.jit
def _rotary_kernel(
    pos_ptr,  # int [T]
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, Hkv, D]
    cs_ptr,  # float32 [max_positions, ROT]: cos | sin
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
    HALF: tl.constexpr,  # ROT // 2
    ROT: tl.constexpr,  # the rotated dims of each head
    D: tl.constexpr,  # head_dim
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,  # >= D - ROT (at least 1)
    HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    SCALE_Q: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    q_row, k_row = q_ptr + t * stride_qt, k_ptr + t * stride_kt
    qo_row, ko_row = qo_ptr + t * num_q_heads * D, ko_ptr + t * num_k_heads * D
    # every load of the rotated dims first: stores to the outputs could alias them, so nothing moves past one
    first, second = _pair_offsets(HALF, HALF_PAD, INTERLEAVED)
    q1 = _load_dims(q_row, num_q_heads, stride_qh, first, HALF, HQ_PAD, HALF_PAD)
    q2 = _load_dims(q_row, num_q_heads, stride_qh, second, HALF, HQ_PAD, HALF_PAD)
    k1 = _load_dims(k_row, num_k_heads, stride_kh, first, HALF, HK_PAD, HALF_PAD)
    k2 = _load_dims(k_row, num_k_heads, stride_kh, second, HALF, HK_PAD, HALF_PAD)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    imask = i < HALF
    dt = qo_ptr.dtype.element_ty
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=imask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=imask, other=0.0).to(dt).to(tl.float32)
    _store_rotated(qo_row, q1, q2, cos, sin, num_q_heads, q_scale, HALF, D, HQ_PAD, HALF_PAD, INTERLEAVED, SCALE_Q)
    _store_rotated(ko_row, k1, k2, cos, sin, num_k_heads, 1.0, HALF, D, HK_PAD, HALF_PAD, INTERLEAVED, False)
    if ROT < D:
        _copy_rest(q_row, qo_row, num_q_heads, stride_qh, q_scale, ROT, D, HQ_PAD, PASS_PAD, SCALE_Q)
        _copy_rest(k_row, ko_row, num_k_heads, stride_kh, 1.0, ROT, D, HK_PAD, PASS_PAD, False)


def rotary(
    positions: torch.Tensor,  # int [T]
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # float32 [max_positions, R], R even and <= D
    q_scale: float | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns new contiguous rotated (query, key) in their dtype (inputs may be strided views, with
    unit last stride); the first R dims of each head rotated (neox, or ``interleaved`` pairs), the rest
    copied; ``q_scale`` multiplies the rotated query (see the module docstring)."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    device = check_device(query, "query")
    t, h, d = query.shape
    check_tensor("key", key, shape=(t, None, d), dtypes=(query.dtype,), device=device)
    check_tensor("positions", positions, shape=(t,), dtypes=(torch.int32, torch.int64), device=device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,), device=device)
    rot = cos_sin_cache.shape[1]
    if rot % 2 or not 0 < rot <= d:
        raise ValueError(f"cos_sin_cache has {rot} columns: the rotary dim must be even and in (0, head_dim={d}]")
    q_out = torch.empty((t, h, d), dtype=query.dtype, device=device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=device)
    if t == 0:
        return q_out, k_out
    half = rot // 2
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
        ROT=rot,
        D=d,
        HALF_PAD=half_pad,
        PASS_PAD=triton.next_power_of_2(max(1, d - rot)),
        HQ_PAD=hq_pad,
        HK_PAD=hk_pad,
        INTERLEAVED=interleaved,
        SCALE_Q=q_scale is not None,
        num_warps=4 if hq_pad * half_pad <= 2048 else 8,
    )
    return q_out, k_out
