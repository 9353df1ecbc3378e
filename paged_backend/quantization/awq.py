"""AutoAWQ GEMM checkpoints (``quant_method: awq``, ``version: gemm``).

    qweight int32 [K, N/8]   8 output columns per word in AWQ's interleaved order:
                             nibble i holds column 8c + AWQ_ORDER[i]
    qzeros  int32 [G, N/8]   same packing (no offset)
    scales  fp16  [G, N]     groups contiguous along K (no act-order)

    W[k, n] = (q[k, n] - zero[k // group_size, n]) * scales[k // group_size, n]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paged_backend.quantization.base import (
    MoEMethod,
    QuantizationConfig,
    experts_ignored,
    quant_param,
    replace_param,
)
from paged_backend.quantization.int4 import (
    AWQ_ORDER,
    Int4LinearMethod,
    check_int4_config,
    dummy_scales,
    int4_word,
    local_groups,
    random_int32,
    unpack_int32_cols,
)
from paged_backend.quantization.int4_moe import Int4MoEMethod


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: Sequence[str]) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = tuple(modules_to_not_convert)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> AWQConfig:
        group_size = check_int4_config("awq", cfg.get("bits", cfg.get("w_bit")), cfg.get("group_size", cfg.get("q_group_size")))
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported (only 'gemm')")
        if not cfg.get("zero_point", True):
            raise ValueError("awq: zero_point=false is not supported")
        return cls(group_size, cfg.get("modules_to_not_convert") or ())

    def get_linear_method(self, prefix: str, shard_names: Sequence[str]) -> AWQLinearMethod | None:
        if prefix == "lm_head" or any(m in name for m in self.modules_to_not_convert for name in shard_names):
            return None
        return AWQLinearMethod(self.group_size, prefix)

    def get_moe_method(self, prefix: str, expert_names: Sequence[str]) -> MoEMethod | None:
        """int4 experts through the fused-MoE kernel (``int4_moe.py``), unless ``modules_to_not_convert``
        leaves them out."""
        if experts_ignored(expert_names, lambda name: any(m in name for m in self.modules_to_not_convert)):
            return None
        return Int4MoEMethod("awq", self.group_size, prefix, expert_names)


class AWQLinearMethod(Int4LinearMethod):
    supports_tensor_parallel = True

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype) -> None:
        k, n = in_features, sum(out_sizes)
        if k % 8 or any(s % 8 for s in out_sizes):
            raise ValueError(f"{self.prefix}: awq needs in/out features divisible by 8, got {k} x {tuple(out_sizes)}")
        g = local_groups(layer, k, self.group_size, self.prefix)
        g_dim = None if self.group_size == -1 else 0
        quant_param(layer, "qweight", (k, n // 8), torch.int32, out_dim=1, pack=8, in_dim=0)
        quant_param(layer, "qzeros", (g, n // 8), torch.int32, out_dim=1, pack=8, in_dim=g_dim, in_pack=self.group_size)
        quant_param(layer, "scales", (g, n), torch.float32, out_dim=1, in_dim=g_dim, in_pack=self.group_size)

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """Random nibbles, zero point 8, positive scales."""
        dev = layer.qweight.device
        layer.qweight.data.copy_(random_int32(layer.qweight.shape, gen, dev))
        layer.qzeros.data.fill_(int4_word(8))
        layer.scales.data.copy_(dummy_scales(layer.scales.shape, gen, dev, std))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32_cols(layer.qweight.data, AWQ_ORDER)
        zeros = unpack_int32_cols(layer.qzeros.data, AWQ_ORDER)
        scales = layer.scales.data
        for name in ("qweight", "qzeros", "scales"):
            replace_param(layer, name, None)
        self.finalize(layer, q, zeros, scales, None)
