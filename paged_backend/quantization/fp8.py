"""FP8 (e4m3) weights: ``quant_method: fp8`` and compressed-tensors ``float-quantized``.

    weight        float8_e4m3fn [N, K]
    weight_scale  fp32 []/[1] per tensor (one per fused shard) or [N]/[N, 1] per output channel
    input_scale   fp32 []/[1] per tensor, only for static activation quantization

    W = weight * weight_scale (per row);  y = act_quant(x) @ W.T + bias

Two forwards with the same activation quantization (none, dynamic per tensor, dynamic per
token, static per tensor):

- CUDA (compute capability >= 8.9): ``torch._scaled_mm`` on e4m3 activations (quantized by
  ``paged_backend/kernels/fp8_quant.py``) and the e4m3 weight, fp32 accumulation, output in the model dtype;
  tensor-wise scales when both are one number, else row-wise (per token x per channel).
- elsewhere (CPU, K or N not a multiple of 16, ``act_scheme="none"``): activations
  fake-quantized exactly as the schemes say and the weight dequantized per use, so this path
  reproduces what the tools compute.

Per-tensor scales of fused shards are expanded to per-channel at load.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, FP8_MAX, fp8_scale_from_amax, quantize_fp8_ref
from paged_backend.models.parallel import as_tensor, shard_for_rank
from paged_backend.quantization.base import (
    LinearMethod,
    MoEMethod,
    QuantizationConfig,
    check_shard,
    copy_stacked,
    experts_ignored,
    is_row_parallel,
    num_shards,
    quant_param,
    replace_param,
    unsupported_experts,
)
from paged_backend.quantization.fp8_block import Fp8BlockLinearMethod
from paged_backend.quantization.fp8_moe import Fp8MoEMethod

logger = logging.getLogger(__name__)

ACT_SCHEMES = ("none", "dynamic_tensor", "dynamic_token", "static_tensor")
KERNELS = ("auto", "torch", "scaled_mm")
# torch._scaled_mm: K and N multiples of 16 (M is free). Fewer rows than this are padded with
# zero rows: vLLM measured cuBLAS's fp8 GEMM faster at M > 16 (bench quant times both).
SCALED_MM_MIN_ROWS = 17
_ALIGN = 16

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Config", "Fp8LinearMethod", "fake_quant_fp8", "fp8_linear",
           "scaled_mm_support"]


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round ``x / scale`` to e4m3 (saturating) and back, in x's dtype."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).to(x.dtype)


@functools.cache
def scaled_mm_support(device_index: int) -> tuple[bool, bool]:
    """(tensor-wise, row-wise) ``torch._scaled_mm`` work on this GPU: probed once on 16 x 32 x 16."""
    if torch.cuda.get_device_capability(device_index) < (8, 9):
        return False, False
    dev = torch.device("cuda", device_index)
    a = torch.zeros(16, 32, device=dev).to(FP8_DTYPE)
    b = torch.zeros(16, 32, device=dev).to(FP8_DTYPE).t()  # column-major [K, N]
    one = torch.ones(1, device=dev)
    ok = []
    for sa, sb in ((one, one), (torch.ones(16, 1, device=dev), torch.ones(1, 16, device=dev))):
        try:
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            ok.append(True)
        except (RuntimeError, NotImplementedError) as e:
            logger.info("torch._scaled_mm %s scaling unavailable: %s", "tensor-wise" if sa is one else "row-wise", e)
            ok.append(False)
    return ok[0], ok[1]


def quantize_activations(
    x: torch.Tensor,  # [M, K]
    act_scheme: str,
    input_scale: torch.Tensor | None = None,  # [1] (static_tensor)
    global_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,  # row-parallel: max over ranks
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [M, K], float32 scale [1] or [M, 1])
    """e4m3 activations for ``torch._scaled_mm``: Triton on CUDA, the torch reference elsewhere."""
    if act_scheme == "static_tensor":
        scale = input_scale.reshape(1).float()
    elif act_scheme == "dynamic_tensor":
        amax = x.abs().amax().reshape(1)
        scale = fp8_scale_from_amax(global_amax(amax) if global_amax else amax)
    elif act_scheme == "dynamic_token" and global_amax is not None:
        scale = fp8_scale_from_amax(global_amax(x.abs().amax(-1, keepdim=True)))
    elif act_scheme == "dynamic_token":
        scale = None  # fused per-row amax in the kernel
    else:
        raise ValueError(f"activation scheme {act_scheme!r} has no e4m3 activations")
    if not x.is_cuda:
        return quantize_fp8_ref(x, scale, per_token=True)
    from paged_backend.kernels.fp8_quant import quantize_fp8

    return quantize_fp8(x, scale.contiguous() if scale is not None else None)


def fp8_linear(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32 on CUDA
    weight: torch.Tensor,  # e4m3 [N, K], contiguous
    scale_row: torch.Tensor,  # float32 [1, N]: the weight's per-channel scales
    scale_one: torch.Tensor | None,  # float32 [1] when every channel has the same scale, else None
    act_scheme: str,
    bias: torch.Tensor | None = None,  # [N]
    input_scale: torch.Tensor | None = None,
    global_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    min_rows: int = SCALED_MM_MIN_ROWS,
    rowwise: bool = True,  # False: this torch/GPU lacks row-wise _scaled_mm (scales applied after)
) -> torch.Tensor:  # [M, N] in x's dtype
    """``act_quant(x) @ (weight * scale).T + bias`` through ``torch._scaled_mm``."""
    m, out_dtype = x.shape[0], x.dtype
    xq, xs = quantize_activations(x.contiguous(), act_scheme, input_scale, global_amax)
    if m < min_rows:  # zero rows (scale 1) up to min_rows; the output is cut back to m rows
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, min_rows - m)).view(FP8_DTYPE)
        if xs.numel() > 1:
            xs = F.pad(xs, (0, 0, 0, min_rows - m), value=1.0)
    rows = xq.shape[0]
    fuse_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
    if xs.numel() == 1 and scale_one is not None:
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale_one, bias=bias if fuse_bias else None,
                             out_dtype=out_dtype)
    elif rowwise:
        sa = xs.expand(rows, 1).contiguous() if xs.numel() == 1 else xs
        y = torch._scaled_mm(xq, weight.t(), scale_a=sa, scale_b=scale_row, bias=bias if fuse_bias else None,
                             out_dtype=out_dtype)
    else:
        one = torch.ones(1, dtype=torch.float32, device=x.device)
        acc = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = (acc * xs * scale_row).to(out_dtype)
        fuse_bias = False
    if rows != m:
        y = y[:m]
    if bias is not None and not fuse_bias:
        y = y + bias.to(out_dtype)
    return y


class Fp8Config(QuantizationConfig):
    """vLLM's serialized-fp8 format: per-tensor (or per-channel) weight scales, or block-wise
    ``weight_scale_inv`` when ``weight_block_size`` is set (DeepSeek / GLM FP8 checkpoints)."""

    name = "fp8"

    def __init__(self, act_scheme: str, ignored: Sequence[str], block: tuple[int, int] | None = None) -> None:
        self.act_scheme = act_scheme
        self.ignored = tuple(ignored)
        self.block = block

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Fp8Config:
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8: activation_scheme {scheme!r} is not supported (static, dynamic)")
        fmt = str(cfg.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8: fmt {fmt!r} is not supported (only e4m3)")
        block = cfg.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"fp8: weight_block_size must be two positive ints [block_n, block_k], got {block!r}")
            if scheme != "dynamic":
                raise ValueError("fp8: block-wise weights (weight_block_size) need activation_scheme 'dynamic'")
            block = (block[0], block[1])
        ignored = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or ()
        return cls("static_tensor" if scheme == "static" else "dynamic_tensor", ignored, block)

    def get_linear_method(self, prefix: str, shard_names: Sequence[str]) -> LinearMethod | None:
        if prefix == "lm_head" or any(i in name for i in self.ignored for name in shard_names):
            return None
        if self.block is not None:
            return Fp8BlockLinearMethod(self.block, prefix)
        return Fp8LinearMethod(self.act_scheme, prefix)

    def get_moe_method(self, prefix: str, expert_names: Sequence[str]) -> MoEMethod | None:
        """Block-wise fp8 experts (``weight_block_size``); per-tensor fp8 experts are refused."""
        if experts_ignored(expert_names, lambda name: any(i in name for i in self.ignored)):
            return None
        if self.block is None:
            raise ValueError(unsupported_experts(
                expert_names, "fp8 experts with per-tensor weight_scale (quant_method fp8 without "
                "weight_block_size) are not supported; block-wise fp8 experts are"))
        return Fp8MoEMethod(self.block, prefix, expert_names)


class Fp8LinearMethod(LinearMethod):
    """FP8 weights: ``torch._scaled_mm`` on capable GPUs, dequantize + matmul elsewhere.

    Row-parallel ranks see only part of each activation row: dynamic activation scales take the
    max over all ranks, so every rank quantizes exactly as the unsplit layer would."""

    supports_tensor_parallel = True

    def __init__(self, act_scheme: str, prefix: str, kernel: str = "auto") -> None:
        if act_scheme not in ACT_SCHEMES:
            raise ValueError(f"unknown activation scheme {act_scheme!r}")
        if kernel not in KERNELS:
            raise ValueError(f"unknown fp8 kernel {kernel!r} ({', '.join(KERNELS)})")
        self.act_scheme = act_scheme
        self.prefix = prefix
        self.kernel = kernel
        self.rowwise = True

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype) -> None:
        n = sum(out_sizes)
        quant_param(layer, "weight", (n, in_features), FP8_DTYPE, out_dim=0, in_dim=1)
        scale = quant_param(layer, "weight_scale", (n,), torch.float32, out_dim=0)
        scale.weight_loader = _channel_scale_loader(layer)
        if self.act_scheme == "static_tensor":
            quant_param(layer, "input_scale", (num_shards(layer),), torch.float32, out_dim=None)

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """N(0, std) weights quantized per output channel (as the tools do); static input scale 8/448."""
        w = torch.randn(layer.weight.shape, generator=gen, device=layer.weight.device) * std
        scale = fp8_scale_from_amax(w.abs().amax(dim=1))
        layer.weight.data.copy_((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
        layer.weight_scale.data.copy_(scale)
        if self.act_scheme == "static_tensor":
            layer.input_scale.data.fill_(8.0 / FP8_MAX)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.act_scheme == "static_tensor":  # one scale for the shared input: the largest (as vLLM)
            replace_param(layer, "input_scale", layer.input_scale.data.max().reshape(1))
        n, k = layer.weight.shape
        if not self._scaled_mm_ok(layer.weight.device, n, k):
            return
        ws = layer.weight_scale.data
        layer.register_buffer("fp8_scale_row", ws.reshape(1, n).contiguous())
        uniform = bool((ws == ws[0]).all()) if n else False
        layer.register_buffer("fp8_scale_one", ws[:1].clone() if uniform else None)
        self.rowwise = scaled_mm_support(_device_index(layer.weight.device))[1]

    def _scaled_mm_ok(self, device: torch.device, n: int, k: int) -> bool:
        if self.kernel == "torch" or self.act_scheme == "none" or device.type != "cuda":
            if self.kernel == "scaled_mm":
                raise ValueError(f"{self.prefix}: kernel='scaled_mm' needs CUDA and fp8 activations")
            return False
        tensorwise, rowwise = scaled_mm_support(_device_index(device))
        if not tensorwise or n % _ALIGN or k % _ALIGN:
            if self.kernel == "scaled_mm":
                raise ValueError(f"{self.prefix}: torch._scaled_mm cannot run [{n}, {k}] e4m3 weights here")
            return False
        return True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda and getattr(layer, "fp8_scale_row", None) is not None and self.act_scheme != "none":
            lead = x.shape[:-1]
            y = fp8_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.fp8_scale_row, layer.fp8_scale_one,
                           self.act_scheme, bias, getattr(layer, "input_scale", None),
                           (lambda a: _global_amax(layer, a)) if is_row_parallel(layer) else None,
                           rowwise=self.rowwise)
            return y.reshape(*lead, y.shape[-1])
        w = (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype)
        if self.act_scheme == "static_tensor":
            x = fake_quant_fp8(x, layer.input_scale)
        elif self.act_scheme == "dynamic_tensor":
            x = fake_quant_fp8(x, _global_amax(layer, x.abs().amax().float()).clamp_min(1e-12) / FP8_MAX)
        elif self.act_scheme == "dynamic_token":
            amax = _global_amax(layer, x.abs().amax(-1, keepdim=True).float())
            x = fake_quant_fp8(x, amax.clamp_min(1e-12) / FP8_MAX)
        return F.linear(x, w, bias)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


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
