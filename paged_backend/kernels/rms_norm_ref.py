"""Reference RMSNorm, optionally fused with the residual add (as HF's LlamaRMSNorm rounds).

    residual_out = x + residual            (in x's dtype, when residual is given)
    out = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)   with h = residual_out in float32
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new residual); the new residual is None when none was given."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual
