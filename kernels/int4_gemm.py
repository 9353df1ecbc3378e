"""W4A16 GEMM in Triton: int4 weights dequantized in registers, fp32 accumulation.

Weights in the layout of ``int4_gemm_ref`` (int32 [K/8, N] packed along K, per-group scales and
uint8 zeros, optional act-order permutation of the activation columns). Each program owns a
BLOCK_M x BLOCK_N tile of y and one of SPLIT_K slices of K::

    for k-block in its slice:  x tile [BM, BK] (gathered through perm)   w = (q - z) * s  [BK, BN]
                               acc += x @ w
    SPLIT_K = 1: y = acc + bias          SPLIT_K > 1: partial[split] = acc; y = sum(partial) + bias

Split-K is the small-M (decode) path: with few rows there are too few (M, N) tiles to fill the
GPU, so K is cut into slices that run in parallel; the fp32 partials are summed afterwards
(deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from paged_backend.kernels._launch import FLOAT_DTYPES, check_device, check_tensor, dot_dtype, interpreting

_SM_COUNT: dict[int, int] = {}


@triton.jit
def _int4_gemm_kernel(
    x_ptr,  # [M, K]
    qw_ptr,  # int32 [K/8, N]
    s_ptr,  # [G, N]
    z_ptr,  # uint8 [G, N]
    perm_ptr,  # int32 [K]  (unused without HAS_PERM)
    bias_ptr,  # [N]  (unused without HAS_BIAS)
    out_ptr,  # [SPLIT_K, M, N]: fp32 partials when SPLIT_K > 1, else y in x's dtype
    M,
    N,
    K,
    group_size,
    k_per_split,  # multiple of BLOCK_K
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        if HAS_PERM:
            x_cols = tl.load(perm_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)
        else:
            x_cols = offs_k.to(tl.int64)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + x_cols[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        mask_w = mask_k[:, None] & mask_n[None, :]
        packed = tl.load(qw_ptr + (offs_k // 8).to(tl.int64)[:, None] * stride_qk + offs_n[None, :], mask=mask_w, other=0)
        q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
        g = (offs_k // group_size).to(tl.int64)
        s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask_w, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=mask_w, other=0).to(tl.int32)
        w = ((q - z).to(tl.float32) * s).to(x_ptr.dtype.element_ty)  # rounded like the reference
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), out_dtype=tl.float32)
    out_mask = mask_m[:, None] & mask_n[None, :]
    out_offs = pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + out_offs, acc, mask=out_mask)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pick_split_k(m_tiles: int, n_tiles: int, k_blocks: int, device: torch.device) -> int:
    """Enough K slices to give every SM a program when M is small; 1 when tiles already fill it."""
    tiles = m_tiles * n_tiles
    sms = _sm_count(device)
    if tiles >= sms:
        return 1
    return max(1, min(16, sms // tiles, k_blocks // 2))


def int4_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    qweight: torch.Tensor,  # int32 [K/8, N]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # uint8 [G, N]
    group_size: int,
    perm: torch.Tensor | None = None,  # int32 [K]
    bias: torch.Tensor | None = None,  # [N]
    split_k: int | None = None,
) -> torch.Tensor:  # [M, N], x.dtype
    """``x[:, perm] @ W + bias`` with W dequantized on the fly (see ``int4_gemm_ref``).

    ``split_k=None`` picks the number of K slices from M (split-K only for small M).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = check_device(x, "x")
    m, k = x.shape
    if k % 8:
        raise ValueError(f"K={k} must be a multiple of 8")
    check_tensor("qweight", qweight, shape=(k // 8, None), dtypes=(torch.int32,), device=device)
    n = qweight.shape[1]
    group_size = k if group_size == -1 else int(group_size)
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide K={k}")
    groups = k // group_size
    check_tensor("scales", scales, shape=(groups, n), dtypes=FLOAT_DTYPES, device=device)
    check_tensor("zeros", zeros, shape=(groups, n), dtypes=(torch.uint8,), device=device)
    if perm is not None:
        check_tensor("perm", perm, shape=(k,), dtypes=(torch.int32,), device=device, contiguous=True)
    if bias is not None:
        check_tensor("bias", bias, shape=(n,), dtypes=FLOAT_DTYPES, device=device, contiguous=True)
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))

    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if n <= 64 or m <= 16 else 128
    block_k = 32 if interpreting() else (128 if m <= 16 else 64)
    m_tiles, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = _pick_split_k(m_tiles, n_tiles, k_blocks, device)
    split_k = max(1, min(int(split_k), k_blocks))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slices
    dst = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=device)
    _int4_gemm_kernel[(m_tiles, n_tiles, split_k)](
        x,
        qweight,
        scales,
        zeros,
        perm if perm is not None else qweight,
        bias if bias is not None else scales,
        dst,
        m,
        n,
        k,
        group_size,
        k_per_split,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        dst.stride(0) if split_k > 1 else 0,
        dst.stride(-2),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None,
        DOT_DTYPE=dot_dtype(x.dtype),
        num_warps=4,
        num_stages=3 if m <= 16 else 2,
    )
    if split_k == 1:
        return out
    acc = dst.sum(0)
    if bias is not None:
        acc += bias.float()
    return out.copy_(acc)
