"""Quantization configs and the per-parameter loaders that quantized formats share; the
``LinearMethod`` interface they implement is ``models.linear_method``'s.

A ``QuantizationConfig`` is parsed once from the checkpoint's ``quantization_config`` and
hands each linear layer a ``LinearMethod`` (or None: that layer stays unquantized).

``load_format="dummy"`` replaces the loading step by ``method.init_dummy_weights(layer, gen, std)``:
seeded random tensors in the checkpoint's format, then the same processing.

``layer`` is a ``FusedLinear``: ``layer.shard_range(shard_id)`` gives a shard's
(offset, size) in output features, ``layer.shard_ids`` the shard names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from paged_backend.models.linear_method import LinearMethod, MoEMethod
from paged_backend.models.parallel import shard_for_rank

__all__ = ["LinearMethod", "MoEMethod", "QuantizationConfig"]


class QuantizationConfig(ABC):
    """One checkpoint's quantization settings; picks the linear method of each layer."""

    name: ClassVar[str]  # the ``quant_method`` / ``--quantization`` value

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: dict[str, Any]) -> QuantizationConfig:
        """Parses and validates ``quantization_config`` (ValueError naming the bad key)."""

    @abstractmethod
    def get_linear_method(self, prefix: str, shard_names: Sequence[str]) -> LinearMethod | None:
        """The method for the linear ``prefix`` (our name) whose checkpoint names are ``shard_names``;
        None keeps it unquantized."""

    def get_moe_method(self, prefix: str, expert_names: Sequence[str]) -> MoEMethod | None:
        """The method for the routed experts ``prefix`` (a ``FusedMoE``) whose per-expert checkpoint
        modules are ``expert_names`` (``model.layers.3.mlp.experts.0.gate_proj``, ...); None keeps
        them unquantized. Default: the format has no quantized experts here (ValueError naming them)."""
        raise ValueError(unsupported_experts(expert_names, f"{self.name} quantized experts are not supported "
                                                           "(fp8 experts are: block-wise fp8, compressed-tensors "
                                                           "fp8 with channel weight scales)"))


def unsupported_experts(expert_names: Sequence[str], why: str) -> str:
    """The load error of experts a method cannot serve: the first expert tensor named, and why."""
    return f"routed experts {expert_names[0]} (and the layer's other {len(expert_names) - 1}): {why}"


def experts_ignored(expert_names: Sequence[str], ignored: Callable[[str], bool]) -> bool:
    """True when the config leaves every expert of the layer unquantized, False when none; ValueError
    for a layer with some experts quantized and some not (one stacked tensor cannot mix them)."""
    found = {ignored(n) for n in expert_names}
    if len(found) > 1:
        first = next(n for n in expert_names if ignored(n))
        raise ValueError(f"routed experts: {first} is left unquantized but other experts of its layer are "
                         "quantized (they are stacked into one tensor: all or none)")
    return found == {True}


def quant_param(
    layer: nn.Module,
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    out_dim: int | None,
    pack: int = 1,
    *,
    in_dim: int | None = None,
    in_pack: int = 1,
) -> nn.Parameter:
    """Registers a parameter whose fused shards stack along ``out_dim``; each element there holds
    ``pack`` output features (e.g. 8 int4 zeros per int32). ``out_dim=None``: one row per shard.

    Under tensor parallelism each rank reads its slice (``shard_for_rank``): along ``out_dim`` on
    column-parallel layers, along ``in_dim`` (``in_pack`` input features per element; None: the
    tensor does not run along the input) on row-parallel ones."""
    if out_dim is None:
        loader = _per_shard_loader(layer, in_dim, in_pack)
    else:
        loader = _stacked_loader(layer, out_dim, pack, in_dim, in_pack)
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    param.shard_ids = layer.shard_ids
    layer.register_parameter(name, param)
    return param


def _check(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: checkpoint has {tuple(src.shape)}, {what} expects {tuple(dst.shape)}")


def check_shard(layer: nn.Module, shard_id) -> None:
    if shard_id is None and layer.shard_ids:
        raise ValueError(f"fused parameter needs a shard id (one of {layer.shard_ids})")
    if shard_id is not None and shard_id not in layer.shard_ids:
        raise ValueError(f"unknown shard {shard_id!r} (expected one of {layer.shard_ids})")


def copy_stacked(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id, out_dim: int,
                 pack: int = 1) -> None:
    """Copies this rank's (already sliced) ``loaded`` into its shard's place along ``out_dim``."""
    check_shard(layer, shard_id)
    if shard_id is None:
        _check(param.data, loaded, "parameter")
        param.data.copy_(loaded)
        return
    offset, size = layer.shard_range(shard_id)
    if offset % pack or size % pack:
        raise ValueError(f"shard {shard_id!r} of {size} outputs is not a multiple of the packing ({pack})")
    dst = param.data.narrow(out_dim, offset // pack, size // pack)
    _check(dst, loaded, f"shard {shard_id!r}")
    dst.copy_(loaded)


def _stacked_loader(layer: nn.Module, out_dim: int, pack: int, in_dim: int | None, in_pack: int):
    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        check_shard(layer, shard_id)
        loaded = shard_for_rank(layer, loaded, shard_id, out_dim=out_dim, in_dim=in_dim, out_pack=pack,
                                in_pack=in_pack)
        copy_stacked(layer, param, loaded, shard_id, out_dim, pack)

    return load


def _per_shard_loader(layer: nn.Module, in_dim: int | None, in_pack: int):
    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        check_shard(layer, shard_id)
        loaded = shard_for_rank(layer, loaded, shard_id, in_dim=in_dim, in_pack=in_pack)
        dst = param.data[layer.shard_ids.index(shard_id) if shard_id is not None else 0]
        _check(dst, loaded.reshape(dst.shape) if loaded.numel() == dst.numel() == 1 else loaded, "parameter")
        dst.copy_(loaded.reshape(dst.shape))

    return load


def num_shards(layer: nn.Module) -> int:
    return max(1, len(layer.shard_ids))


def tp_world_size(layer: nn.Module) -> int:
    """Ranks the layer is split over (1 without tensor parallelism)."""
    tp = getattr(layer, "tp", None)
    return 1 if tp is None else tp.world_size


def is_row_parallel(layer: nn.Module) -> bool:
    """Row-parallel layers hold a slice of the input features; their bias is added after the all-reduce."""
    spec = getattr(layer, "tp_spec", None)
    return spec is not None and spec.kind == "row"


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Swaps a loaded checkpoint parameter for its processed form (None deletes it)."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
