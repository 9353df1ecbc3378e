"""GPTQ int4 checkpoints as AutoGPTQ / GPTQModel write them (``quant_method: gptq``).

    qweight int32 [K/8, N]   8 consecutive input rows per word, low nibble first (= kernel layout)
    qzeros  int32 [G, N/8]   8 consecutive output columns per word; v1 format stores zero - 1
    scales  fp16  [G, N]
    g_idx   int32 [K]        group of each input row (act-order: not contiguous)

    W[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paged_backend.quantization.base import (
    QuantizationConfig,
    is_row_parallel,
    num_shards,
    quant_param,
    replace_param,
    tp_world_size,
)
from paged_backend.quantization.int4 import (
    Int4LinearMethod,
    check_int4_config,
    group_offset,
    local_groups,
    shared_g_idx,
    unpack_int32_cols,
)

# checkpoint_format -> what to add to the stored zero points
_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str) -> None:
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> GPTQConfig:
        group_size = check_int4_config("gptq", cfg.get("bits"), cfg.get("group_size", 128))
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if fmt not in _ZERO_OFFSET:
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported ({', '.join(_ZERO_OFFSET)})")
        if cfg.get("lm_head"):
            raise ValueError("gptq: a quantized lm_head (lm_head: true) is not supported")
        if cfg.get("dynamic"):
            raise ValueError("gptq: per-module 'dynamic' overrides are not supported")
        return cls(group_size, bool(cfg.get("desc_act", False)), bool(cfg.get("sym", True)), fmt)

    def get_linear_method(self, prefix: str, shard_names: Sequence[str]) -> GPTQLinearMethod | None:
        if prefix == "lm_head":
            return None
        return GPTQLinearMethod(self.group_size, _ZERO_OFFSET[self.checkpoint_format], prefix, self.desc_act)


class GPTQLinearMethod(Int4LinearMethod):
    """GPTQ int4; under tensor parallelism row-parallel layers read their rows of qweight/g_idx and
    their groups of scales/qzeros (act-order: all groups, since any row may use any group)."""

    supports_tensor_parallel = True

    def __init__(self, group_size: int, zero_offset: int, prefix: str, desc_act: bool = False) -> None:
        super().__init__(group_size, prefix)
        self.zero_offset = zero_offset
        self.desc_act = desc_act

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype) -> None:
        k, n = in_features, sum(out_sizes)
        if k % 8 or any(s % 8 for s in out_sizes):
            raise ValueError(f"{self.prefix}: gptq needs in/out features divisible by 8, got {k} x {tuple(out_sizes)}")
        g = local_groups(layer, k, self.group_size, self.prefix)
        # act-order on a row-parallel layer: this rank's rows may use any group -> read every group
        self.all_groups = self.desc_act and is_row_parallel(layer) and self.group_size != -1
        g_dim = None if self.group_size == -1 or self.all_groups else 0
        g_total = g * tp_world_size(layer) if self.all_groups else g
        quant_param(layer, "qweight", (k // 8, n), torch.int32, out_dim=1, in_dim=0, in_pack=8)
        quant_param(layer, "qzeros", (g_total, n // 8), torch.int32, out_dim=1, pack=8, in_dim=g_dim,
                    in_pack=self.group_size)
        quant_param(layer, "scales", (g_total, n), torch.float32, out_dim=1, in_dim=g_dim, in_pack=self.group_size)
        quant_param(layer, "g_idx", (num_shards(layer), k), torch.int32, out_dim=None, in_dim=0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from paged_backend.kernels.int4_gemm_ref import unpack_int4

        q = unpack_int4(layer.qweight.data)
        zeros = unpack_int32_cols(layer.qzeros.data).to(torch.int16) + self.zero_offset  # v1: 15 + 1 = 16 kept
        g_idx = shared_g_idx(layer.g_idx.data, self.prefix, "g_idx")
        if not self.all_groups:
            g_idx = g_idx - group_offset(layer, self.group_size)  # row-parallel: global -> this rank's groups
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= zeros.shape[0]:
            raise ValueError(f"{self.prefix}: g_idx values outside 0..{zeros.shape[0] - 1}")
        scales = layer.scales.data
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            replace_param(layer, name, None)
        if self.all_groups:
            self.finalize_sparse_groups(layer, q, zeros.to(torch.uint8), scales, g_idx)
        else:
            self.finalize(layer, q, zeros.to(torch.uint8), scales, g_idx)
