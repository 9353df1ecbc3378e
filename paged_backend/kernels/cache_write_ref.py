"""Reference cache write: scatter a step's new K/V into their paged-cache slots.

    kv_cache[0 | 1].view(num_blocks * block_size, Hkv, D)[slot_mapping[t]] = key | value[t]

Slots of -1 are skipped. With an fp8 cache the value stored is ``x / scale`` saturated to
the e4m3 range and rounded to nearest even.
"""

from __future__ import annotations

import torch

from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX

__all__ = ["FP8_DTYPE", "FP8_MAX", "quantize_fp8", "write_kv_cache_ref"]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, clamped to +-448, cast to e4m3 (round to nearest even)."""
    y = x.float() / scale.float()
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T]
    k_scale: torch.Tensor | None = None,  # float32 scalar, used when the cache is fp8
    v_scale: torch.Tensor | None = None,
) -> None:
    if key.shape[0] == 0:
        return
    nb, bs = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, nb * bs, kv_cache.shape[3], kv_cache.shape[4])
    slots, k, v = slot_mapping, key, value
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slots, k, v = slot_mapping[keep], key[keep], value[keep]
    if kv_cache.dtype == FP8_DTYPE:
        one = torch.ones((), dtype=torch.float32, device=key.device)
        k = quantize_fp8(k, k_scale if k_scale is not None else one)
        v = quantize_fp8(v, v_scale if v_scale is not None else one)
    else:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.dtype == FP8_DTYPE:  # index_copy_ has no fp8 kernel on the CPU: copy the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)
