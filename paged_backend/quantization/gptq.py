"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them (``quant_method: gptq``, 4 or 8 bits).

    qweight int32 [K/P, N]   P = 32/bits consecutive input rows per word, lowest bits first
                             (4-bit: = the int4 kernel layout)
    qzeros  int32 [G, N/P]   P consecutive output columns per word; v1 format stores zero - 1
    scales  fp16  [G, N]
    g_idx   int32 [K]        group of each input row (act-order: not contiguous)

    W[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]

4-bit weights run the int4 kernel; 8-bit weights are dequantized once at load into the model
dtype (correct numerics, dense speed and memory: no 8-bit kernel yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.quantization.base import (
    MoEMethod,
    QuantizationConfig,
    is_row_parallel,
    num_shards,
    quant_param,
    replace_param,
    tp_world_size,
    unsupported_experts,
)
from paged_backend.quantization.int4 import (
    Int4LinearMethod,
    check_int4_config,
    dummy_g_idx,
    dummy_scales,
    first_input_row,
    group_offset,
    int4_word,
    local_groups,
    random_int32,
    shared_g_idx,
    unpack_int32_cols,
)
from paged_backend.quantization.int4_moe import Int4MoEMethod

# checkpoint_format -> what to add to the stored zero points
_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str, bits: int = 4) -> None:
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format
        self.bits = bits

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> GPTQConfig:
        bits = cfg.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"gptq: bits={bits} is not supported (4 or 8)")
        group_size = check_int4_config("gptq", 4, cfg.get("group_size", 128))
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if fmt not in _ZERO_OFFSET:
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported ({', '.join(_ZERO_OFFSET)})")
        if cfg.get("lm_head"):
            raise ValueError("gptq: a quantized lm_head (lm_head: true) is not supported")
        if cfg.get("dynamic"):
            raise ValueError("gptq: per-module 'dynamic' overrides are not supported")
        return cls(group_size, bool(cfg.get("desc_act", False)), bool(cfg.get("sym", True)), fmt, bits)

    def get_linear_method(self, prefix: str, shard_names: Sequence[str]) -> GPTQLinearMethod | None:
        if prefix == "lm_head":
            return None
        return GPTQLinearMethod(self.group_size, _ZERO_OFFSET[self.checkpoint_format], prefix, self.desc_act,
                                self.bits)

    def get_moe_method(self, prefix: str, expert_names: Sequence[str]) -> MoEMethod:
        """4-bit experts without act-order through the fused-MoE kernel (``int4_moe.py``)."""
        if self.bits != 4:
            raise ValueError(unsupported_experts(expert_names, f"{self.bits}-bit gptq experts are not supported "
                                                              "(4-bit experts are)"))
        if self.desc_act:
            raise ValueError(unsupported_experts(expert_names, "gptq experts with act-order (desc_act: true) are "
                                                              "not supported (each expert would permute its inputs)"))
        return Int4MoEMethod("gptq", self.group_size, prefix, expert_names, _ZERO_OFFSET[self.checkpoint_format])


class GPTQLinearMethod(Int4LinearMethod):
    """GPTQ int4; under tensor parallelism row-parallel layers read their rows of qweight/g_idx and
    their groups of scales/qzeros (act-order: all groups, since any row may use any group)."""

    supports_tensor_parallel = True

    def __init__(self, group_size: int, zero_offset: int, prefix: str, desc_act: bool = False, bits: int = 4) -> None:
        super().__init__(group_size, prefix)
        self.zero_offset = zero_offset
        self.desc_act = desc_act
        self.bits = bits
        self.pack = 32 // bits

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype) -> None:
        k, n, p = in_features, sum(out_sizes), self.pack
        if k % p or any(s % p for s in out_sizes):
            raise ValueError(f"{self.prefix}: {self.bits}-bit gptq needs in/out features divisible by {p}, "
                             f"got {k} x {tuple(out_sizes)}")
        g = local_groups(layer, k, self.group_size, self.prefix)
        # act-order on a row-parallel layer: this rank's rows may use any group -> read every group
        self.all_groups = self.desc_act and is_row_parallel(layer) and self.group_size != -1
        g_dim = None if self.group_size == -1 or self.all_groups else 0
        g_total = g * tp_world_size(layer) if self.all_groups else g
        quant_param(layer, "qweight", (k // p, n), torch.int32, out_dim=1, in_dim=0, in_pack=p)
        quant_param(layer, "qzeros", (g_total, n // p), torch.int32, out_dim=1, pack=p, in_dim=g_dim,
                    in_pack=self.group_size)
        quant_param(layer, "scales", (g_total, n), torch.float32, out_dim=1, in_dim=g_dim, in_pack=self.group_size)
        quant_param(layer, "g_idx", (num_shards(layer), k), torch.int32, out_dim=None, in_dim=0)

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """Random nibbles, zero point 8 (stored as 8 - offset), positive scales; act-order
        (``desc_act``) shuffles the groups of the input rows."""
        dev = layer.qweight.device
        mid = 1 << (self.bits - 1)  # 8 (int4) or 128 (int8)
        layer.qweight.data.copy_(random_int32(layer.qweight.shape, gen, dev))
        layer.qzeros.data.fill_(int4_word(mid - self.zero_offset, self.bits))
        rms = ((4**self.bits - 1) / 12 + 0.25) ** 0.5  # of (q - mid), q uniform in 0 .. 2^bits - 1
        layer.scales.data.copy_(dummy_scales(layer.scales.shape, gen, dev, std, rms))
        k = layer.g_idx.shape[1]
        g_idx = dummy_g_idx(k, first_input_row(layer), self.group_size, self.desc_act, gen, dev)
        layer.g_idx.data.copy_(g_idx.expand_as(layer.g_idx))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from paged_backend.kernels.int4_gemm_ref import unpack_int4

        if self.bits == 8:
            q = unpack_packed(layer.qweight.data, 8, along_rows=True)
            zeros = unpack_packed(layer.qzeros.data, 8, along_rows=False).to(torch.int16) + self.zero_offset
        else:
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
        if self.bits == 8:  # dequantize once: W[k] uses its own group, act-order needs no permutation
            g = g_idx.long()
            w = (q.float() - zeros[g].float()) * scales[g].float()
            layer.register_buffer("w8_dense", w.t().contiguous().to(layer.dtype))
            return
        if self.all_groups:
            self.finalize_sparse_groups(layer, q, zeros.to(torch.uint8), scales, g_idx)
        else:
            self.finalize(layer, q, zeros.to(torch.uint8), scales, g_idx)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.bits == 8:
            return F.linear(x, layer.w8_dense, bias)
        return super().apply(layer, x, bias)


def unpack_packed(packed: torch.Tensor, bits: int, along_rows: bool) -> torch.Tensor:
    """int32 [R, C] -> int [R*P, C] (``along_rows``: P consecutive rows per word) or [R, C*P]
    (P consecutive columns per word), P = 32 / bits, lowest bits first."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, P]
    r, c = packed.shape
    if along_rows:
        return vals.permute(0, 2, 1).reshape(r * per, c)
    return vals.reshape(r, c * per)
