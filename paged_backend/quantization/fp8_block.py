"""Block-wise FP8 weights (``quant_method: fp8`` with ``weight_block_size``), as DeepSeek-V3 / GLM
FP8 checkpoints write them::

    weight            float8_e4m3fn [N, K]
    weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)]    one scale per bn x bk block

    W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]      ("inv": the inverse of the
                                                                      quantization scale)
    y = act_quant(x) @ W.T + bias,   act_quant: dynamic e4m3 per token and per group of bk inputs

The activation quantization is what those models run (and what vLLM does for them): each
token's inputs are quantized in groups of bk with their own scale. Served by dequantize +
matmul on the CPU (``paged_backend/kernels/fp8_block_gemm_ref.py``), by the Triton block-FP8 GEMM on CUDA
(``paged_backend/kernels/fp8_block_gemm.py``: the fused-MoE kernel's block-FP8 path over one expert). Fused shards (q|k|v, gate|up) must start on a block boundary; under tensor parallelism
each rank's slice must be whole blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.kernels.fp8_block_gemm_ref import fp8_block_gemm_ref
from paged_backend.kernels.fp8_quant_ref import (
    FP8_DTYPE,
    FP8_MAX,
    expand_block_scales,
    fp8_scale_from_amax,
)
from paged_backend.models.parallel import shard_for_rank
from paged_backend.quantization.base import LinearMethod, check_shard, quant_param


class Fp8BlockLinearMethod(LinearMethod):
    supports_tensor_parallel = True

    def __init__(self, block: Sequence[int], prefix: str) -> None:
        self.bn, self.bk = (int(b) for b in block)
        self.prefix = prefix

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype) -> None:
        bad = [s for s in out_sizes[:-1] if s % self.bn]
        if bad:
            raise ValueError(f"{self.prefix}: fused shards of {tuple(out_sizes)} outputs do not start on "
                             f"{self.bn}-row blocks (weight_block_size)")
        n = sum(out_sizes)
        quant_param(layer, "weight", (n, in_features), FP8_DTYPE, out_dim=0, in_dim=1)
        scale = quant_param(layer, "weight_scale_inv", (math.ceil(n / self.bn), math.ceil(in_features / self.bk)),
                            torch.float32, out_dim=0)
        scale.weight_loader = self._scale_loader(layer)

    def _scale_loader(self, layer: nn.Module):
        bn, bk = self.bn, self.bk

        def load(param: nn.Parameter, loaded, shard_id=None) -> None:
            check_shard(layer, shard_id)
            loaded = shard_for_rank(layer, loaded, shard_id, out_dim=0, in_dim=1, out_pack=bn, in_pack=bk)
            offset, size = layer.shard_range(shard_id) if shard_id is not None else (0, param.shape[0] * bn)
            rows = math.ceil(size / bn) if shard_id is not None else param.shape[0]
            dst = param.data.narrow(0, offset // bn, rows)
            if tuple(dst.shape) != tuple(loaded.shape):
                raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
                                 f"{'shard ' + repr(shard_id) if shard_id is not None else 'parameter'} expects "
                                 f"{tuple(dst.shape)} ({bn} x {bk} blocks)")
            dst.copy_(loaded)

        return load

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """N(0, std) weights quantized block by block (each block's largest |w| -> 448)."""
        n, k = layer.weight.shape
        w = torch.randn(n, k, generator=gen, device=layer.weight.device) * std
        rows, cols = layer.weight_scale_inv.shape
        blocks = F.pad(w, (0, cols * self.bk - k, 0, rows * self.bn - n)).reshape(rows, self.bn, cols, self.bk)
        scale = fp8_scale_from_amax(blocks.abs().amax(dim=(1, 3)))
        layer.weight_scale_inv.data.copy_(scale)
        full = expand_block_scales(scale, n, k, self.bn, self.bk)
        layer.weight.data.copy_((w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        n, k = layer.weight.shape
        scale = expand_block_scales(layer.weight_scale_inv, n, k, self.bn, self.bk)
        return (layer.weight.float() * scale).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:  # the Triton block-FP8 GEMM (e4m3 MMAs, scales per 128 block)
            from paged_backend.kernels.fp8_block_gemm import fp8_block_gemm as gemm
        else:
            gemm = fp8_block_gemm_ref
        y = gemm(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale_inv, (self.bn, self.bk), bias)
        return y.view(*x.shape[:-1], y.shape[-1])
