"""Reference SiLU-and-mul: ``silu(x[:, :I]) * x[:, I:]`` for the fused gate/up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]
