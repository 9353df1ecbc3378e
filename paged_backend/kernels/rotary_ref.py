"""Reference rotary embedding (HF's ``rotate_half``, neox or interleaved), with llama3 scaling.

The cos/sin table is float32 ``[max_positions, rotary_dim]`` (cos in the first half,
sin in the second), built like HF builds it so fp32 results agree bit for bit. The first
``rotary_dim`` dims of each head are rotated, as pairs of dims ``(i, i + rotary_dim/2)``
(neox, Llama's ``rotate_half``) or ``(2i, 2i + 1)`` (``interleaved``: GPT-J style, GLM's),
pair ``i`` by frequency ``i``; dims from ``rotary_dim`` to ``head_dim`` pass through (partial
rotary).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32, with ``linear``, ``llama3`` or ``yarn`` scaling."""
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
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): the frequencies interpolated by ``factor`` below the correction range
    [low, high] of dims (from ``beta_fast`` / ``beta_slow`` rotations over the original context), kept
    above it, blended linearly inside; ``truncate`` (default) rounds the range outwards."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (``attention_factor``, else from ``factor`` and the mscales:
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given); 1 for other types."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    return yarn_mscale(factor)


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0) -> torch.Tensor:
    """[max_positions, R] float32 (R = 2 * len(inv_freq), the rotary dim): cos(p * f) in [:, :R/2],
    sin(p * f) in [:, R/2:], both times ``attention_factor`` (YaRN's; 1 otherwise)."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table if attention_factor == 1.0 else table * attention_factor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The first ``2 * cos.shape[-1]`` dims of ``x`` rotated, the rest as they are (HF's op order)."""
    rot = 2 * cos.shape[-1]
    x_rot = x[..., :rot]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        c, s = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        c, s = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
    out = x_rot * c + rotated * s
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def rotary_ref(
    positions: torch.Tensor,  # int64 [T]
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # float32 [max_positions, rotary_dim], rotary_dim <= D
    q_scale: float | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns rotated (query, key) in their dtype; cos/sin are cast to that dtype first (as HF).
    ``q_scale`` multiplies the whole query after the rotation (one more rounding to its dtype)."""
    cs = cos_sin_cache[positions.long()]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half].to(query.dtype)
    sin = cs[:, None, half:].to(query.dtype)
    q = _rotate(query, cos, sin, interleaved)
    if q_scale is not None:
        q = torch.mul(q, q_scale)
    return q, _rotate(key, cos, sin, interleaved)
