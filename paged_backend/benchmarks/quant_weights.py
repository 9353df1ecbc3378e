"""The quantized weights ``bench quant`` (and ``bench peer``'s int4 cells) time: random int4
weights in the kernel layout, fp8 weights from a dense one, and how many copies a graph replay
rotates over.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from paged_backend.benchmarks.timing import copies_to_touch

TOUCH_BYTES = 256 << 20  # bytes of weights read per graph replay (>> the H200's 50 MB L2)
MAX_COPIES = 32


def copies_for(nbytes: int, cuda: bool = True) -> int:
    """Weight copies rotated per replay so the L2 cannot serve reruns (1 on the CPU)."""
    return copies_to_touch(nbytes, TOUCH_BYTES, MAX_COPIES) if cuda else 1


@dataclasses.dataclass
class Int4Weight:
    qweight: Any  # int32 [N, K/8], the kernel layout
    scales: Any
    zeros: Any
    perm: Any
    group_size: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros)
                   if t is not None) + (self.perm.numel() * 4 if self.perm is not None else 0)


def make_int4(k: int, n: int, group_size: int, act_order: bool, seed: int, dev) -> Int4Weight:
    """Random nibbles, zero points near 8, fp16 scales ~ 1 / (8 sqrt(K)) (outputs of order one)."""
    import torch

    from paged_backend.quantization.int4 import random_int32

    gen = torch.Generator(device=dev).manual_seed(seed)
    g = k // (k if group_size == -1 else group_size)
    qweight = random_int32((n, k // 8), gen, dev)
    zeros = torch.randint(6, 11, (g, n), generator=gen, device=dev, dtype=torch.uint8)
    scales = ((torch.rand(g, n, generator=gen, device=dev) + 0.5) / (8 * math.sqrt(k))).to(torch.float16)
    perm = torch.randperm(k, generator=gen, device=dev).to(torch.int32) if act_order else None
    return Int4Weight(qweight, scales, zeros, perm, group_size)


def make_fp8(w_bf16, uniform: bool):
    """e4m3 [N, K] with per-channel scales (or one scale when ``uniform``) from a dense weight."""
    import torch

    from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, FP8_MAX, fp8_scale_from_amax

    w = w_bf16.float()
    amax = w.abs().amax() * torch.ones(w.shape[0], device=w.device) if uniform else w.abs().amax(dim=1)
    scale = fp8_scale_from_amax(amax)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(1, -1).contiguous(), (scale[:1].clone() if uniform else None)
