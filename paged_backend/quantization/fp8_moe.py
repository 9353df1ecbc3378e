"""FP8 (e4m3) routed experts: the two formats MoE checkpoints ship, stacked into ``FusedMoE``'s
``w13`` [E, 2I, H] / ``w2`` [E, H, I] in e4m3 beside float32 scales::

    block-wise (``quant_method: fp8`` + ``weight_block_size`` [bn, bk]: DeepSeek-V3, Qwen3-FP8)
        experts.{e}.gate_proj.weight float8_e4m3fn [I, H], .weight_scale_inv float32 [ceil(I/bn), ceil(H/bk)]
        (up_proj the same, down_proj [H, I] / [ceil(H/bn), ceil(I/bk)])
        -> w13_weight_scale_inv [E, 2I/bn, ceil(H/bk)]   w2_weight_scale_inv [E, ceil(H/bn), ceil(I/bk)]
        activations: dynamic e4m3 per token and per group of bk inputs
    per output channel (compressed-tensors ``float-quantized``, weights ``strategy: channel``, inputs
        dynamic ``strategy: token``: GLM-4.5-FP8's format)
        experts.{e}.gate_proj.weight float8_e4m3fn [I, H], .weight_scale float32 [I, 1] (down_proj [H, 1])
        -> w13_weight_scale [E, 2I]   w2_weight_scale [E, H]
        activations: dynamic e4m3 per token

The MoE op (``paged_backend/kernels/fused_moe.py`` on CUDA, ``fused_moe_ref`` elsewhere) takes the scales as
``w13_scale`` / ``w2_scale`` (+ ``block_shape``); its contract is in ``paged_backend/kernels/fused_moe_ref.py``.
Gate and up stack into one [2I, H] tensor, so block scales need I % bn == 0; under tensor
parallelism each rank's I / tp must be whole blocks of bn (w13's rows) and of bk (w2's inputs), and
per-token scales of the intermediate take the max over the ranks (each holds part of the row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, FP8_MAX, expand_block_scales, fp8_scale_from_amax
from paged_backend.quantization.base import MoEMethod


class Fp8MoEMethod(MoEMethod):
    """e4m3 experts with block-wise (``block`` = (bn, bk)) or per-output-channel (``block`` None) scales."""

    def __init__(self, block: tuple[int, int] | None, prefix: str, expert_names: Sequence[str]) -> None:
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.prefix = prefix
        self.first = expert_names[0]  # the first expert's checkpoint module, for errors

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.block is not None else "weight_scale"

    def create_weights(self, layer: nn.Module) -> None:
        inter, local, hidden = layer.intermediate_size, layer.i_local, layer.hidden_size
        split = local != inter
        layer.add_expert_param("w13", (2 * local, hidden), FP8_DTYPE, "w13", 0)
        layer.add_expert_param("w2", (hidden, local), FP8_DTYPE, "w2", 1)
        if self.block is None:
            layer.add_expert_param("w13_weight_scale", (2 * local,), torch.float32, "w13", 0)
            layer.add_expert_param("w2_weight_scale", (hidden,), torch.float32, "w2", None)
            return
        bn, bk = self.block
        where = f"{self.first}.{self.scale_suffix}"
        if local % bn:
            per_rank = f" (per rank {local} of {inter})" if split else ""
            raise ValueError(f"{where}: moe_intermediate_size {inter}{per_rank} is not a multiple of "
                             f"weight_block_size[0]={bn}: gate and up rows cannot stack on whole scale blocks")
        if split and local % bk:
            raise ValueError(f"{where}: the per-rank intermediate size {local} ({inter} split over tensor "
                             f"parallelism) is not a multiple of weight_block_size[1]={bk} (down_proj's inputs)")
        layer.add_expert_param("w13_weight_scale_inv", (2 * local // bn, math.ceil(hidden / bk)), torch.float32,
                               "w13", 0, bn)
        layer.add_expert_param("w2_weight_scale_inv", (math.ceil(hidden / bn), math.ceil(local / bk)), torch.float32,
                               "w2", 1, bk)

    def op_kwargs(self, layer: nn.Module) -> dict:
        if self.block is not None:
            return dict(w13_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv,
                        block_shape=self.block)
        kwargs = dict(w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale)
        if layer.i_local != layer.intermediate_size:  # each rank holds part of every intermediate row
            kwargs["intermediate_amax"] = lambda amax: layer.tp.all_reduce_max(amax.contiguous())
        return kwargs

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """N(0, std) experts quantized as the format does: each block's (row's) largest |w| -> 448."""
        for name in ("w13", "w2"):
            param = getattr(layer, name)
            w = torch.randn(param.shape, generator=gen, device=param.device) * std
            scale = getattr(layer, f"{name}_{self.scale_suffix}")
            if self.block is None:
                s = fp8_scale_from_amax(w.abs().amax(-1))
                full = s[..., None]
            else:
                bn, bk = self.block
                e, n, k = w.shape
                rows, cols = scale.shape[1:]
                blocks = F.pad(w, (0, cols * bk - k, 0, rows * bn - n)).reshape(e, rows, bn, cols, bk)
                s = fp8_scale_from_amax(blocks.abs().amax(dim=(2, 4)))
                full = torch.stack([expand_block_scales(s[i], n, k, bn, bk) for i in range(e)])
            scale.data.copy_(s)
            param.data.copy_((w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
