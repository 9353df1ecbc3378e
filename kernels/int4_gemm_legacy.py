"""The previous W4A16 kernel (K-packed int32 [K/8, N] weights, act-order gathered per element),
kept only as the baseline that ``bench quant --sweep`` times beside ``int4_gemm.py`` in the same
run; nothing in the engine uses it. ``legacy_layout`` converts the kernel layout to its own.

Original description:

Weights in the layout of ``int4_gemm_ref`` (int32 [K/8, N] packed along K, per-group scales and
uint8 zeros, optional act-order permutation of the activation columns). Each program owns a
BLOCK_M x BLOCK_N tile of y and one of ``split_k`` slices of K::

    for k-block in its slice:  x tile [BM, BK] (gathered through perm)   w = (q - z) * s  [BK, BN]
                               acc += x @ w        (tl.dot; BLOCK_M < 16: broadcast-multiply-sum)
    split_k = 1: y = acc + bias          split_k > 1: partial[split] = acc
                                         then one reduce kernel: y = sum(partial) + bias

Split-K is the small-M (decode) path: with few rows there are too few (M, N) tiles to keep
enough weight bytes in flight, so K is cut into slices that run in parallel; the fp32 partials
are summed afterwards in a fixed order (deterministic, no atomics).

Two compile-time variants of the weight load, both exact (``Int4Config.packed``):

- per-row: every row of the [BK, BN] tile loads its int32 word and shifts out its nibble
  (8 rows share one word; the cache serves the repeats);
- packed: the [BK/8, BN] words are loaded once and expanded to [BK/8, 8, BN] nibbles, then
  reshaped to [BK, BN] (8x fewer load instructions).

When ``group_size`` is a multiple of BLOCK_K a k-block lies in one group, so its scales and
zeros are one [BN] row each instead of a [BK, BN] gather. ``Int4Config`` holds the tile
choice; ``default_config`` picks it from M (the bench's ``--sweep`` is how it was chosen).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from paged_backend.kernels._launch import FLOAT_DTYPES, check_device, check_tensor, dot_dtype, interpreting


@dataclass(frozen=True)
class Int4Config:
    """One launch configuration of the W4A16 kernel (``split_k=None``: chosen from the grid)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    packed: bool = False

    def label(self) -> str:
        sk = "auto" if self.split_k is None else str(self.split_k)
        return (f"bm{self.block_m} bn{self.block_n} bk{self.block_k} sk{sk} w{self.num_warps} "
                f"s{self.num_stages}{' packed' if self.packed else ''}")


@triton.jit
def _int4_gemm_kernel(
    x_ptr,  # [M, K]
    qw_ptr,  # int32 [K/8, N]
    s_ptr,  # [G, N]
    z_ptr,  # uint8 [G, N]
    perm_ptr,  # int32 [K]  (unused without HAS_PERM)
    bias_ptr,  # [N]  (unused without HAS_BIAS)
    out_ptr,  # [split_k, M, N]: fp32 partials when PARTIALS, else y [M, N] in x's dtype
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
    PARTIALS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,  # group_size % BLOCK_K == 0: one group per k-block
    PACKED: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 activations: full-precision tl.dot (not TF32)
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
        if PACKED:
            offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # packed rows: 8 k each
            words = tl.load(
                qw_ptr + offs_r.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                mask=(offs_r * 8 < k_end)[:, None] & mask_n[None, :],
                other=0,
            )
            shifts = tl.arange(0, 8) * 4
            q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        else:
            packed = tl.load(
                qw_ptr + (offs_k // 8).to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0,
            )
            q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if GROUP_ALIGNED:
            g0 = (k0 // group_size).to(tl.int64)
            s = tl.load(s_ptr + g0 * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g0 * stride_zg + offs_n, mask=mask_n, other=0).to(tl.int32)
            w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
        else:
            mask_w = mask_k[:, None] & mask_n[None, :]
            g = (offs_k // group_size).to(tl.int64)
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask_w, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=mask_w, other=0).to(tl.int32)
            w = ((q - z).to(tl.float32) * s).to(x_ptr.dtype.element_ty)  # rounded like the reference
        if USE_DOT and IEEE:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), out_dtype=tl.float32, input_precision="ieee")
        elif USE_DOT:
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), out_dtype=tl.float32)
        else:  # few rows: a broadcast multiply-sum (tl.dot needs 16 rows)
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    out_mask = mask_m[:, None] & mask_n[None, :]
    out_offs = pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    if PARTIALS:
        tl.store(out_ptr + out_offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,  # fp32 [S, M*N]
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M*N] in the output dtype
    total,  # M * N
    N,
    splits,
    stride_ps,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):  # fixed order: deterministic
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm_count(device_index: int | None) -> int:
    if device_index is None:
        return 8  # the interpreter
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def pick_split_k(m: int, k: int, m_tiles: int, n_tiles: int, k_blocks: int, sms: int) -> int:
    """K slices for a memory-bound launch: about four programs per SM (enough weight bytes in
    flight), each slice at least two k-blocks, at most 16 slices, and the fp32 partials
    (written and read back: 8 * splits * M * N bytes) at most the weight's K * N / 2 bytes."""
    tiles = m_tiles * n_tiles
    if tiles >= 4 * sms:
        return 1
    cap = min(16, k_blocks // 2, k // (16 * max(1, m)))
    return max(1, min(triton.cdiv(4 * sms, tiles), cap))


def default_config(m: int, n: int, k: int, group_size: int) -> Int4Config:
    """The launch configuration for an [m, k] x [k, n] product (split-K left to ``pick_split_k``)."""
    if interpreting():  # small tiles keep the CPU interpreter fast
        return Int4Config(block_m=16, block_n=64 if n > 32 else 32, block_k=32, num_stages=1)
    if m <= 16:
        return Int4Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if m <= 32:
        return Int4Config(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if m <= 64:
        return Int4Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
    return Int4Config(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, group_size: int, device_index: int | None,
          config: Int4Config | None) -> tuple[Int4Config, int, int, tuple[int, int, int]]:
    """(config, split_k, k_per_split, grid) for one problem; cached (the decode loop repeats shapes)."""
    cfg = config or default_config(m, n, k, group_size)
    m_tiles, n_tiles = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    k_blocks = triton.cdiv(k, cfg.block_k)
    split_k = cfg.split_k
    if split_k is None:
        split_k = pick_split_k(m, k, m_tiles, n_tiles, k_blocks, _sm_count(device_index))
    split_k = max(1, min(int(split_k), k_blocks))
    k_per_split = triton.cdiv(k_blocks, split_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slices
    return cfg, split_k, k_per_split, (m_tiles, n_tiles, split_k)


def check_int4_weights(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> int:
    """Validates the kernel layout of one weight (ValueError/TypeError naming the tensor); returns
    the effective group size. Layers call this once at load and launch with ``check=False``."""
    device = qweight.device
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
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
    return group_size


def legacy_layout(qweight: torch.Tensor) -> torch.Tensor:
    """The kernel layout's int32 [N, K/8] -> this kernel's [K/8, N] (GPTQ's plain nibble order)."""
    from paged_backend.kernels.int4_gemm_ref import pack_int4, unpack_int4_kernel

    return pack_int4(unpack_int4_kernel(qweight))


def int4_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    qweight: torch.Tensor,  # int32 [K/8, N]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # uint8 [G, N]
    group_size: int,
    perm: torch.Tensor | None = None,  # int32 [K]
    bias: torch.Tensor | None = None,  # [N]
    split_k: int | None = None,
    config: Int4Config | None = None,
    check: bool = True,
) -> torch.Tensor:  # [M, N], x.dtype
    """``x[:, perm] @ W + bias`` with W dequantized on the fly (see ``int4_gemm_ref``).

    ``config=None`` uses ``default_config``; ``split_k`` overrides the config's (None: chosen
    from the grid). ``check=False`` skips the argument checks (weights checked at load with
    ``check_int4_weights``; x must then be a contiguous [M, K] float tensor on their device).
    """
    if check:
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
        device = check_device(x, "x")
        if x.shape[1] % 8:
            raise ValueError(f"K={x.shape[1]} must be a multiple of 8")
        check_tensor("qweight", qweight, shape=(x.shape[1] // 8, None), dtypes=(torch.int32,), device=device)
        group_size = check_int4_weights(qweight, scales, zeros, group_size, perm, bias)
    m, k = x.shape
    n = qweight.shape[1]
    if group_size == -1:
        group_size = k
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    if split_k is not None:
        config = replace(config or default_config(m, n, k, group_size), split_k=split_k)
    cfg, splits, k_per_split, grid = _plan(m, n, k, group_size, _device_index(x.device), config)
    dst = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    _int4_gemm_kernel[grid](
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
        dst.stride(0) if splits > 1 else 0,
        dst.stride(-2),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PARTIALS=splits > 1,
        HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None,
        GROUP_ALIGNED=group_size % cfg.block_k == 0,
        PACKED=cfg.packed,
        USE_DOT=cfg.block_m >= 16,
        DOT_DTYPE=dot_dtype(x.dtype),
        IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        total, block = m * n, 1024
        _split_k_reduce_kernel[(triton.cdiv(total, block),)](
            dst, bias if bias is not None else scales, out, total, n, splits, dst.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return out
