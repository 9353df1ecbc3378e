"""Reference rotary embedding, neox style (HF's ``rotate_half``), with llama3 scaling.

The cos/sin table is float32 ``[max_positions, rotary_dim]`` (cos in the first half,
sin in the second), built like HF builds it so fp32 results agree bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32, with ``linear`` or ``llama3`` scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos(p * f) in [:, :D/2], sin(p * f) in [:, D/2:]."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = torch.cat([cos, cos], dim=-1)
    s = torch.cat([sin, sin], dim=-1)
    return x * c + torch.cat([-x2, x1], dim=-1) * s


def rotary_ref(
    positions: torch.Tensor,  # int64 [T]
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # float32 [max_positions, D]
    q_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns rotated (query, key) in their dtype; cos/sin are cast to that dtype first (as HF).
    ``q_scale`` multiplies the rotated query (one more rounding to its dtype)."""
    cs = cos_sin_cache[positions.long()]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half].to(query.dtype)
    sin = cs[:, None, half:].to(query.dtype)
    q = _rotate(query, cos, sin)
    if q_scale is not None:
        q = torch.mul(q, q_scale)
    return q, _rotate(key, cos, sin)
