"""Reference FP8 (e4m3) activation quantization for ``torch._scaled_mm`` (also the CPU path).

    dynamic per token:   scale[m] = max(amax(|x[m, :]|), 1e-12) / 448     -> scale [M, 1]
    dynamic per tensor:  scale    = max(amax(|x|), 1e-12) / 448           -> scale [1]
    static:              scale given ([1] per tensor, or [M, 1] per row)
    q = saturate(x / scale) rounded to e4m3 (nearest even);  x ~= q * scale

The division (not a multiplication by 1/scale) and the clamp before the cast are what
``quantization/fp8.py``'s fake quantization does, so both give the same e4m3 values.
"""

from __future__ import annotations

import torch

from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX

MIN_AMAX = 1e-12  # all-zero rows get a tiny positive scale (q = 0), never a division by zero


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 scale that maps ``amax`` onto the largest e4m3 value.

    A tensor divisor, not the Python float: CUDA torch turns a division by a scalar into a
    multiplication by its reciprocal, which can differ in the last bit from the IEEE division
    that the CPU and the Triton kernel do (seen on the H200: scales 1 ulp apart).
    """
    amax = amax.float().clamp_min(MIN_AMAX)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_fp8_ref(
    x: torch.Tensor,  # [M, K] float
    scale: torch.Tensor | None = None,  # [1] or [M, 1] float32; None: dynamic
    per_token: bool = True,  # dynamic only: one scale per row (else one for the tensor)
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [M, K], float32 scale [M, 1] or [1])
    """Quantizes ``x`` to e4m3 with the given or a dynamic scale; returns the values and the scale."""
    if scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax().reshape(1)
        scale = fp8_scale_from_amax(amax)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(torch.float32)


def dequantize_fp8_ref(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in float32, rounded once to ``dtype``."""
    return (q.float() * scale).to(dtype)


def quantize_fp8_groups_ref(
    x: torch.Tensor,  # [..., K] float
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [..., K], float32 scale [..., ceil(K / group)])
    """Dynamic e4m3 quantization with one scale per row and per ``group`` consecutive inputs (the
    last group may be shorter): what DeepSeek-V3-style block-fp8 models do to every linear's input."""
    k = x.shape[-1]
    pad = -k % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    xg = xf.reshape(*xf.shape[:-1], -1, group)
    scale = fp8_scale_from_amax(xg.abs().amax(-1, keepdim=True))
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(xf.shape)
    return (q[..., :k] if pad else q), scale.squeeze(-1)


def dequantize_fp8_groups_ref(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 ``q * scale`` of ``quantize_fp8_groups_ref``'s output."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., : q.shape[-1]]


def expand_block_scales(scale: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] block scales -> [N, K] (one per weight element)."""
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
