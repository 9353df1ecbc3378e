"""int4 routed experts (W4A16) of GPTQ and AWQ checkpoints, repacked at load into the fused-MoE kernel's
layout (``paged_backend/kernels/fused_moe_ref.py``: per expert the int4 kernel layout of ``paged_backend/kernels/int4_gemm_ref.py``).

Per-expert checkpoint tensors (``{X}`` = ``model.layers.N.mlp.experts.{e}``; gate and up [.., I] along
their outputs, down [I, ..] along its inputs; G = H / group_size, Gi = I / group_size)::

    GPTQ (AutoGPTQ / GPTQModel, 4 bits, ``desc_act: false``: Qwen3-30B-A3B-GPTQ-Int4)
        {X}.gate_proj.qweight int32 [H/8, I]  .qzeros int32 [G, I/8]  .scales fp16 [G, I]  .g_idx int32 [H]
        {X}.down_proj.qweight int32 [I/8, H]  .qzeros int32 [Gi, H/8] .scales fp16 [Gi, H] .g_idx int32 [I]
    AWQ (AutoAWQ GEMM: 8 output columns per word in AWQ's order)
        {X}.gate_proj.qweight int32 [H, I/8]  .qzeros int32 [G, I/8]  .scales fp16 [G, I]
        {X}.down_proj.qweight int32 [I, H/8]  .qzeros int32 [Gi, H/8] .scales fp16 [Gi, H]

load into per-expert parameters ``w13_qweight`` / ``w13_qzeros`` / ``w13_scales`` (/ ``w13_g_idx``) with
gate and up side by side along the output features (``w2_*`` for down), through ``FusedMoE``'s loaders
(tensor parallelism splits I: this rank's columns of gate/up, its rows and groups of down; expert
parallelism: whole experts). After loading, each expert is unpacked and repacked::

    w13 int32 [E, 2I, H/8]   w13_scale [E, G, 2I]   w13_zeros uint8 [E, G, 2I]
    w2  int32 [E, H, I/8]    w2_scale  [E, Gi, H]   w2_zeros  uint8 [E, Gi, H]

and the MoE op gets the scales, zeros and group size (``op_kwargs``). Act-order (``desc_act``: groups not
contiguous along K) is refused at load: each expert would need its own activation permutation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paged_backend.kernels.int4_gemm_ref import compact_scales, pack_int4_kernel, unpack_int4
from paged_backend.quantization.base import MoEMethod, replace_param
from paged_backend.quantization.int4 import (
    AWQ_ORDER,
    dummy_scales,
    int4_word,
    random_int32,
    unpack_int32_cols,
)

FORMATS = ("gptq", "awq")


class Int4MoEMethod(MoEMethod):
    """GPTQ (``fmt="gptq"``, ``zero_offset`` added to the stored zero points) or AWQ int4 experts."""

    def __init__(self, fmt: str, group_size: int, prefix: str, expert_names: Sequence[str],
                 zero_offset: int = 0) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown int4 expert format {fmt!r} (one of {FORMATS})")
        self.fmt = fmt
        self.group_size = group_size
        self.zero_offset = zero_offset
        self.prefix = prefix
        self.first = expert_names[0]  # the first expert's checkpoint module (gate), for errors
        self.first_down = next((n for n in expert_names if n.endswith(("down_proj", ".w2"))), expert_names[0])

    def _groups(self, features: int, where: str, what: str, note: str = "") -> int:
        gs = self.group_size
        if features % 8:
            raise ValueError(f"{where}: int4 experts need {what} to be a multiple of 8, got {features}{note}")
        if gs == -1:
            return 1
        if features % gs:
            raise ValueError(f"{where}: {what} {features}{note} is not a multiple of group_size={gs}")
        return features // gs

    def create_weights(self, layer: nn.Module) -> None:
        hidden, local, inter = layer.hidden_size, layer.i_local, layer.intermediate_size
        per_rank = "" if local == inter else f" (per rank {local} of {inter}, split over tensor parallelism)"
        g13 = self._groups(hidden, f"{self.first}.qweight", "hidden_size")
        g2 = self._groups(local, f"{self.first_down}.qweight", "moe_intermediate_size", per_rank)
        gs = self.group_size
        g_dim = None if gs == -1 else 0  # down's groups run along the intermediate features
        for name in ("w13", "w2"):  # the float experts are replaced by the checkpoint's packed tensors
            if name in layer._parameters:
                del layer._parameters[name]
        add = layer.add_expert_param
        if self.fmt == "gptq":  # K-packed: 8 input rows a word; zeros 8 output columns a word
            add("w13_qweight", (hidden // 8, 2 * local), torch.int32, "w13", 1)
            add("w2_qweight", (local // 8, hidden), torch.int32, "w2", 0, 8)
            add("w13_g_idx", (hidden,), torch.int32, "w13", None)
            add("w2_g_idx", (local,), torch.int32, "w2", 0)
        else:  # AWQ: N-packed, 8 output columns a word
            add("w13_qweight", (hidden, 2 * local // 8), torch.int32, "w13", 1, 8)
            add("w2_qweight", (local, hidden // 8), torch.int32, "w2", 0)
        add("w13_qzeros", (g13, 2 * local // 8), torch.int32, "w13", 1, 8)
        add("w13_scales", (g13, 2 * local), torch.float32, "w13", 1)
        add("w2_qzeros", (g2, hidden // 8), torch.int32, "w2", g_dim, max(gs, 1))
        add("w2_scales", (g2, hidden), torch.float32, "w2", g_dim, max(gs, 1))

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """Random nibbles, zero point 8 (GPTQ v1 stores 7), positive scales, contiguous groups."""
        for base in ("w13", "w2"):
            qweight, qzeros, scales = (getattr(layer, f"{base}_{n}") for n in ("qweight", "qzeros", "scales"))
            dev = qweight.device
            qweight.data.copy_(random_int32(qweight.shape, gen, dev))
            qzeros.data.fill_(int4_word(8 - self.zero_offset))
            scales.data.copy_(dummy_scales(scales.shape, gen, dev, std))
            g_idx = getattr(layer, f"{base}_g_idx", None)
            if g_idx is not None:
                g_idx.data.copy_(self._contiguous_groups(g_idx.shape[1], layer.i_start if base == "w2" else 0, dev))

    def _contiguous_groups(self, rows: int, first: int, device: torch.device) -> torch.Tensor:
        """The g_idx of ``rows`` input rows from global row ``first`` without act-order."""
        idx = torch.arange(first, first + rows, device=device, dtype=torch.int32)
        return torch.zeros_like(idx) if self.group_size == -1 else idx // self.group_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for base, first_row, where in (("w13", 0, self.first), ("w2", layer.i_start, self.first_down)):
            qweight, qzeros, scales = (getattr(layer, f"{base}_{n}").data for n in ("qweight", "qzeros", "scales"))
            g_idx = getattr(layer, f"{base}_g_idx", None)
            if g_idx is not None:
                want = self._contiguous_groups(g_idx.shape[1], first_row, g_idx.device)
                if not torch.equal(g_idx.data, want.expand_as(g_idx)):
                    raise ValueError(f"{where}.g_idx: the groups are not contiguous along the inputs (act-order); "
                                     "int4 experts need desc_act=false")
            packed, zeros = [], []
            for e in range(qweight.shape[0]):
                if self.fmt == "gptq":
                    q = unpack_int4(qweight[e])
                    z = unpack_int32_cols(qzeros[e]).to(torch.int16) + self.zero_offset  # v1: 15 + 1 = 16 kept
                else:
                    q = unpack_int32_cols(qweight[e], AWQ_ORDER)
                    z = unpack_int32_cols(qzeros[e], AWQ_ORDER)
                packed.append(pack_int4_kernel(q))
                zeros.append(z.to(torch.uint8))
            for n in ("qweight", "qzeros", "scales", "g_idx"):
                replace_param(layer, f"{base}_{n}", None)
            replace_param(layer, base, torch.stack(packed))
            replace_param(layer, f"{base}_scale", compact_scales(scales))
            replace_param(layer, f"{base}_zeros", torch.stack(zeros).contiguous())

    def op_kwargs(self, layer: nn.Module) -> dict:
        return dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale, w13_zeros=layer.w13_zeros,
                    w2_zeros=layer.w2_zeros, group_size=self.group_size)
