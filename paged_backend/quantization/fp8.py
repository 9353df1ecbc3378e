"""FP8 (e4m3) weights: ``quant_method: fp8`` and compressed-tensors ``float-quantized``.

    weight        float8_e4m3fn [N, K]
    weight_scale  fp32 []/[1] per tensor (one per fused shard) or [N]/[N, 1] per output channel
    input_scale   fp32 []/[1] per tensor, only for static activation quantization

    W = weight * weight_scale (per row);  y = act_quant(x) @ W.T + bias

Activations are fake-quantized exactly as the schemes say (none, dynamic per tensor, dynamic
per token, static per tensor), so the dequantized path reproduces what the tools compute.
Per-tensor scales of fused shards are expanded to per-channel at load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.models.parallel import as_tensor, shard_for_rank
from paged_backend.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    check_shard,
    copy_stacked,
    is_row_parallel,
    num_shards,
    quant_param,
    replace_param,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
ACT_SCHEMES = ("none", "dynamic_tensor", "dynamic_token", "static_tensor")


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round ``x / scale`` to e4m3 (saturating) and back, in x's dtype."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).to(x.dtype)


class Fp8Config(QuantizationConfig):
    """vLLM's serialized-fp8 format: per-tensor (or per-channel) weight scales."""

    name = "fp8"

    def __init__(self, act_scheme: str, ignored: Sequence[str]) -> None:
        self.act_scheme = act_scheme
        self.ignored = tuple(ignored)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Fp8Config:
        if cfg.get("weight_block_size"):
            raise ValueError("fp8: block-wise scales (weight_block_size) are not supported")
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8: activation_scheme {scheme!r} is not supported (static, dynamic)")
        ignored = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or ()
        return cls("static_tensor" if scheme == "static" else "dynamic_tensor", ignored)

    def get_linear_method(self, prefix: str, shard_names: Sequence[str]) -> Fp8LinearMethod | None:
        if prefix == "lm_head" or any(i in name for i in self.ignored for name in shard_names):
            return None
        return Fp8LinearMethod(self.act_scheme, prefix)


class Fp8LinearMethod(LinearMethod):
    """FP8 weights dequantized per use (CPU path; a ``torch._scaled_mm`` path is future work).

    Row-parallel ranks see only part of each activation row: dynamic activation scales take the
    max over all ranks, so every rank quantizes exactly as the unsplit layer would."""

    supports_tensor_parallel = True

    def __init__(self, act_scheme: str, prefix: str) -> None:
        if act_scheme not in ACT_SCHEMES:
            raise ValueError(f"unknown activation scheme {act_scheme!r}")
        self.act_scheme = act_scheme
        self.prefix = prefix

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype) -> None:
        n = sum(out_sizes)
        quant_param(layer, "weight", (n, in_features), FP8_DTYPE, out_dim=0, in_dim=1)
        scale = quant_param(layer, "weight_scale", (n,), torch.float32, out_dim=0)
        scale.weight_loader = _channel_scale_loader(layer)
        if self.act_scheme == "static_tensor":
            quant_param(layer, "input_scale", (num_shards(layer),), torch.float32, out_dim=None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.act_scheme == "static_tensor":  # one scale for the shared input: the largest (as vLLM)
            replace_param(layer, "input_scale", layer.input_scale.data.max().reshape(1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype)
        if self.act_scheme == "static_tensor":
            x = fake_quant_fp8(x, layer.input_scale)
        elif self.act_scheme == "dynamic_tensor":
            x = fake_quant_fp8(x, _global_amax(layer, x.abs().amax().float()).clamp_min(1e-12) / FP8_MAX)
        elif self.act_scheme == "dynamic_token":
            amax = _global_amax(layer, x.abs().amax(-1, keepdim=True).float())
            x = fake_quant_fp8(x, amax.clamp_min(1e-12) / FP8_MAX)
        return F.linear(x, w, bias)


def _global_amax(layer: nn.Module, amax: torch.Tensor) -> torch.Tensor:
    """A row-parallel rank's activation max taken over the whole (split) input row."""
    return layer.tp.all_reduce_max(amax.contiguous()) if is_row_parallel(layer) else amax


def _channel_scale_loader(layer: nn.Module):
    """Per-tensor scales (one element) fill their shard's rows; per-channel ones load as stacked."""

    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        if math.prod(loaded.shape) == 1:
            loaded = as_tensor(loaded)
            if shard_id is None:
                if layer.shard_ids:
                    raise ValueError(f"fused parameter needs a shard id (one of {layer.shard_ids})")
                param.data.fill_(float(loaded.reshape(())))
                return
            offset, size = layer.shard_range(shard_id)
            param.data.narrow(0, offset, size).fill_(float(loaded.reshape(())))
            return
        check_shard(layer, shard_id)
        loaded = shard_for_rank(layer, loaded, shard_id, out_dim=0)
        if loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        copy_stacked(layer, param, loaded, shard_id, out_dim=0)

    return load
