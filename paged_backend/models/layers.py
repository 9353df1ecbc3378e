"""Building blocks of the Llama-family decoder: pluggable elementwise ops, fused linears whose
parameters carry per-shard weight loaders, RMSNorm and the rotary embedding.

Every parameter has a ``weight_loader(param, loaded_weight, shard_id=None)`` attribute: the
one hook through which checkpoint tensors reach it, so tensor-parallel slicing and quantized
formats can change how a tensor is loaded without touching the model's ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.kernels.activation_ref import silu_and_mul_ref
from paged_backend.kernels.fused_moe_ref import fused_moe_ref
from paged_backend.kernels.rms_norm_ref import rms_norm_ref
from paged_backend.kernels.rotary_ref import (
    rope_attention_factor,
    rope_cos_sin_cache,
    rope_inv_freq,
    rotary_ref,
)

if TYPE_CHECKING:
    from paged_backend.models.linear_method import LinearMethod

ShardId = str | int


@dataclass(frozen=True)
class ModelOps:
    """The elementwise ops of a decoder layer, chosen once per model (same signatures as the refs).

    rms_norm(x, weight, eps, residual) -> (normed, new_residual)
    silu_and_mul(x [T, 2I]) -> [T, I]
    rotary(positions, q [T, H, D], k [T, Hkv, D], cos_sin_cache [P, R <= D], q_scale=None, interleaved=False)
        -> (q, k): the first R dims of each head rotated (neox halves or interleaved pairs), the rest copied
    fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K], *, expert_map=None)
        -> [T, H]; expert_map [E_global]: global id -> index in w13 / w2, -1 = held elsewhere (skipped);
        fp8 experts: e4m3 w13 / w2 with ``w13_scale``, ``w2_scale`` (+ ``block_shape``; fused_moe_ref.py)
    """

    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_moe: Callable[..., torch.Tensor] = fused_moe_ref


def reference_ops() -> ModelOps:
    """The pure-torch references: the CPU path (a Triton set with the same signatures serves CUDA)."""
    return ModelOps(rms_norm=rms_norm_ref, silu_and_mul=silu_and_mul_ref, rotary=rotary_ref)


def _check_shape(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(src.shape)}, {what} expects {tuple(dst.shape)}"
        )


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
    """Copies a whole tensor (cast to the parameter's dtype and device)."""
    if shard_id is not None:
        raise ValueError(f"parameter has no shards, got shard {shard_id!r}")
    _check_shape(param.data, loaded_weight, "parameter")
    param.data.copy_(loaded_weight)


def register_kv_scales(module: nn.Module) -> None:
    """An attention layer's KV-cache quantization scales ``k_scale`` / ``v_scale`` (float32 scalars, 1.0 unless
    the checkpoint has them or ``calibrate_kv_scales`` sets them from the first batch)."""
    module.register_buffer("k_scale", torch.empty((), dtype=torch.float32), persistent=False)
    module.register_buffer("v_scale", torch.empty((), dtype=torch.float32), persistent=False)
    module.calibrate_kv_scales = False  # set by --calculate-kv-scales
    reset_kv_scales(module)


def reset_kv_scales(module: nn.Module) -> None:
    """``register_kv_scales``' buffers back to 1.0 (nothing on the meta device)."""
    if not module.k_scale.is_meta:
        module.k_scale.fill_(1.0)
        module.v_scale.fill_(1.0)


def new_param(shape: Sequence[int], dtype: torch.dtype, loader: Callable = default_weight_loader) -> nn.Parameter:
    """An uninitialised inference parameter (no grad) carrying its ``weight_loader``."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


class FusedLinear(nn.Module):
    """``y = x @ W.T (+ b)`` where W stacks shards by rows (q|k|v, gate|up); one shard per HF tensor.

        W rows:  [ shard 0: out_sizes[0] | shard 1: out_sizes[1] | ... ]

    With a ``linear_method`` (quantized checkpoints) the method owns the weight parameters and
    the matmul; without one (the default) this is a dense ``F.linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        shard_ids: Sequence[ShardId] = (),
        linear_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        if shard_ids and len(shard_ids) != len(out_sizes):
            raise ValueError("one shard id per output size")
        self.in_features = in_features
        self.out_sizes = tuple(out_sizes)
        self.shard_ids = tuple(shard_ids)
        self.dtype = dtype
        self.linear_method: LinearMethod | None = None
        self.weight = new_param((sum(out_sizes), in_features), dtype, self.weight_loader)
        self.weight.shard_ids = self.shard_ids
        self.bias = None
        if bias:
            self.bias = new_param((sum(out_sizes),), dtype, self.weight_loader)
            self.bias.shard_ids = self.shard_ids
        if linear_method is not None:
            self.set_linear_method(linear_method)

    def set_linear_method(self, method: LinearMethod) -> None:
        """Replaces the dense ``weight`` by the parameters ``method`` registers (bias stays dense)."""
        del self.weight
        self.linear_method = method
        method.create_weights(self, self.in_features, self.out_sizes, self.dtype)

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        """(offset, size) of a shard in output features."""
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {self.shard_ids})")
        i = self.shard_ids.index(shard_id)
        return sum(self.out_sizes[:i]), self.out_sizes[i]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
        if shard_id is None:
            if self.shard_ids:
                raise ValueError(f"fused parameter needs a shard id (one of {self.shard_ids})")
            default_weight_loader(param, loaded_weight)
            return
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {self.shard_ids})")
        i = self.shard_ids.index(shard_id)
        dst = param.data.narrow(0, sum(self.out_sizes[:i]), self.out_sizes[i])
        _check_shape(dst, loaded_weight, f"shard {shard_id!r}")
        dst.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear_method is not None:
            return self.linear_method.apply(self, x, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding ``[vocab, hidden]``."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param((num_embeddings, dim), dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm through ``ops.rms_norm``; with ``residual`` it first adds it (vLLM's fused pattern)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: ModelOps) -> None:
        super().__init__()
        self.weight = new_param((size,), dtype)
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """RoPE through ``ops.rotary`` with a float32 cos/sin table built once (on the table's device).

    ``rotary_dim`` < ``head_dim`` (partial rotary: GLM, GLM-4, GLM-4.5) rotates only the first
    ``rotary_dim`` dims of each head (the table's width) and passes the rest through. ``interleaved``
    rotates pairs of adjacent dims (2i, 2i+1) (GPT-J style: GLM, GLM-4) instead of neox halves
    (i, i + rotary_dim/2).
    """

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, ops: ModelOps,
        rotary_dim: int | None = None, interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.interleaved = interleaved
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.ops = ops
        self.register_buffer(
            "cos_sin_cache", torch.empty(max_positions, self.rotary_dim, dtype=torch.float32), persistent=False
        )
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)computes the table; call after ``to_empty`` materialises a meta-built model."""
        device = self.cos_sin_cache.device
        if device.type == "meta":  # nothing to compute yet (and meta-device math is slow)
            return
        with torch.device("cpu"):  # inverse frequencies on the CPU, as HF computes them
            inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling)
        with torch.device(device):
            self.cos_sin_cache.copy_(rope_cos_sin_cache(inv_freq.to(device), self.max_positions,
                                                        rope_attention_factor(self.scaling)))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_scale: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k); ``q_scale`` also multiplies q (the attention backend's ``query_scale``)."""
        return self.ops.rotary(positions, q, k, self.cos_sin_cache, q_scale, interleaved=self.interleaved)
