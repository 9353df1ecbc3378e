"""Reference W4A16 GEMM: unpack the int4 kernel layout, dequantize, matmul (also the CPU path).

The one layout every int4 format (AWQ, GPTQ, compressed-tensors) is repacked into at load::

    qweight  int32 [N, K/8]   word r of row n holds q[8r + c, n] (0..15) for c = 0..7 at bits
                              4 * (c // 2) + 16 * (c % 2): even c in the low half-word, odd c
                              in the high one (``KERNEL_NIBBLE``), so one mask of 0x000F000F
                              (after a shift by 4i) lifts columns 2i and 2i + 1 into the two
                              halves of a 32-bit register: a 16-bit pair as the tensor cores
                              take it, converted by one OR and one paired subtract
    scales   float [G, N]     G = K / group_size (one group when group_size = K); fp16/bf16 when
                              that holds the checkpoint's scales exactly, else fp32
    zeros    uint8 [G, N]     0..16 (GPTQ v1 checkpoints can encode 16)
    perm     int32 [K] | None row k of W multiplies activation column perm[k] (act-order)

    W[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]   (fp32 math)
    y = x[:, perm] @ W (+ bias)

Each output column's weights are contiguous along K (``qweight[n]`` is one row of packed
words), so a GEMV program streams whole rows with coalesced loads and its reduction over K
stays inside the thread; ``pack_int4``/``unpack_int4`` are the K-packed [K/8, N] words that
GPTQ checkpoints store (the kernel layout is their transpose).
"""

from __future__ import annotations

import torch

PACK = 8  # int4 values per int32
KERNEL_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # kernel layout: column c of a word sits in nibble KERNEL_NIBBLE[c]
_PLAIN = tuple(range(PACK))  # GPTQ's order: row 8r + j in nibble j


def _pack(q: torch.Tensor, nibble: tuple[int, ...]) -> torch.Tensor:
    """int [K, N] values 0..15 -> int32 [K/8, N]: row 8r + c of q in nibble ``nibble[c]`` of word r."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"pack_int4: K={k} is not a multiple of {PACK}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("pack_int4: values must lie in 0..15")
    q = q.to(torch.int32).reshape(k // PACK, PACK, n)
    packed = torch.zeros(k // PACK, n, dtype=torch.int32, device=q.device)
    for c in range(PACK):
        packed |= q[:, c, :] << (4 * nibble[c])
    return packed


def _unpack(qweight: torch.Tensor, nibble: tuple[int, ...]) -> torch.Tensor:
    """int32 [K/8, N] -> uint8 [K, N] (inverse of ``_pack`` with the same ``nibble``)."""
    r, n = qweight.shape
    shifts = torch.tensor([4 * j for j in nibble], dtype=torch.int32, device=qweight.device).view(1, PACK, 1)
    q = (qweight.unsqueeze(1) >> shifts) & 0xF
    return q.reshape(r * PACK, n).to(torch.uint8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] values 0..15 -> int32 [K/8, N], eight consecutive rows per word (low nibble first)."""
    return _pack(q, _PLAIN)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> uint8 [K, N] (inverse of ``pack_int4``)."""
    return _unpack(qweight, _PLAIN)


def pack_int4_kernel(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] values 0..15 -> the kernel's int32 [N, K/8] (contiguous)."""
    return _pack(q, KERNEL_NIBBLE).t().contiguous()


def unpack_int4_kernel(qweight: torch.Tensor) -> torch.Tensor:
    """The kernel's int32 [N, K/8] -> uint8 [K, N] (inverse of ``pack_int4_kernel``)."""
    return _unpack(qweight.t(), KERNEL_NIBBLE)


def compact_scales(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` in fp16 or bf16 when that dtype holds every value exactly (checkpoints store
    fp16 or bf16 scales; the kernel reads fewer bytes and computes in fp32 either way), else fp32."""
    s = scales.to(torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        narrow = s.to(dtype)
        if torch.equal(narrow.to(torch.float32), s):
            return narrow.contiguous()
    return s.contiguous()


def dequantize_int4_ref(
    qweight: torch.Tensor,  # int32 [N, K/8]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # uint8 [G, N]
    group_size: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [K, N] in dtype (default: float32)
    """W = (q - z) * s per group, computed in float32 and rounded once to ``dtype``."""
    q = unpack_int4_kernel(qweight)
    k = q.shape[0]
    group_size = k if group_size == -1 else group_size
    if k % group_size or scales.shape[0] != k // group_size:
        raise ValueError(f"K={k}, group_size={group_size} and scales {tuple(scales.shape)} disagree")
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return ((q.to(torch.float32) - z) * s).to(dtype or torch.float32)


def int4_gemm_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [N, K/8]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # uint8 [G, N]
    group_size: int,
    perm: torch.Tensor | None = None,  # int [K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """``x[:, perm] @ dequantize(W) + bias`` in x's dtype."""
    w = dequantize_int4_ref(qweight, scales, zeros, group_size, x.dtype)
    if perm is not None:
        x = x.index_select(-1, perm.to(torch.long))
    out = x @ w
    return out + bias.to(x.dtype) if bias is not None else out
