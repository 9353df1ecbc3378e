"""Cache write in Triton: scatter the step's new K/V into their paged-cache slots.

One program per token writes all its KV heads of K and V::

    slot = slot_mapping[t]   (-1: skip)     block = slot // block_size   offset = slot % block_size
    kv_cache[0, block, offset] = key[t]      kv_cache[1, block, offset] = value[t]

Offsets are int64 (block ids * block stride overflow int32 past 2^31 elements). With an
fp8 cache the value stored is ``quantize_fp8`` of the reference: ``x / scale`` (IEEE
division) clamped to +-448, cast to e4m3 round-to-nearest-even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_backend.kernels._launch import FLOAT_DTYPES, check_device, check_tensor, scale_tensor
from paged_backend.kernels.cache_write_ref import FP8_DTYPE, FP8_MAX

FP8_MAX_C = tl.constexpr(FP8_MAX)


@triton.jit
def _quantize(x, scale, FP8: tl.constexpr, out_dtype: tl.constexpr):
    """float32 -> cache dtype (e4m3 of x / scale, saturated, when FP8)."""
    if FP8:
        y = tl.math.div_rn(x, scale)
        y = tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C)
        return y.to(out_dtype)
    else:
        return x.to(out_dtype)


@triton.jit
def _cache_write_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]  (kv_cache[0])
    v_cache_ptr,  # [NB, BS, Hkv, D]  (kv_cache[1])
    slot_ptr,  # int64 [T]
    k_scale_ptr,  # float32 [1]
    v_scale_ptr,  # float32 [1]
    num_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < num_heads) & (d < HEAD_DIM)
    # loads first (independent of the slot), then one masked store per half: no branch to wait on
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ks = 1.0
    vs = 1.0
    if FP8:
        ks = tl.load(k_scale_ptr)
        vs = tl.load(v_scale_ptr)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    keep = mask & ((tl.zeros([H_PAD, D_PAD], dtype=tl.int64) + slot) >= 0)
    cache_dt = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, _quantize(k, ks, FP8, cache_dt), mask=keep)
    tl.store(v_cache_ptr + dst, _quantize(v, vs, FP8, cache_dt), mask=keep)


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T]
    k_scale: torch.Tensor | None = None,  # float32 scalar, used when the cache is fp8
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton twin of ``write_kv_cache_ref`` (same arguments, same stored bits)."""
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    device = check_device(key, "key")
    t, hkv, d = key.shape
    check_tensor("value", value, shape=(t, hkv, d), dtypes=(key.dtype,), device=device)
    check_tensor("kv_cache", kv_cache, shape=(2, None, None, hkv, d), dtypes=(*FLOAT_DTYPES, FP8_DTYPE),
                 device=device)
    check_tensor("slot_mapping", slot_mapping, shape=(t,), dtypes=(torch.int64, torch.int32), device=device)
    fp8 = kv_cache.dtype == FP8_DTYPE
    if not fp8 and kv_cache.dtype != key.dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must be key's ({key.dtype}) or float8_e4m3fn")
    if kv_cache[0].stride() != kv_cache[1].stride():
        raise ValueError("kv_cache K and V halves must have the same strides")
    if t == 0:
        return
    ks = scale_tensor(k_scale, device, "k_scale")
    vs = scale_tensor(v_scale, device, "v_scale")
    kc, vc = kv_cache[0], kv_cache[1]
    d_pad = triton.next_power_of_2(d)
    h_pad = triton.next_power_of_2(hkv)
    _cache_write_kernel[(t,)](
        key,
        value,
        kc,
        vc,
        slot_mapping,
        ks,
        vs,
        hkv,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        HEAD_DIM=d,
        D_PAD=d_pad,
        H_PAD=h_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        FP8=fp8,
        num_warps=4 if h_pad * d_pad <= 2048 else 8,
    )
