"""The interface a linear layer's weights go through (vLLM's LinearMethodBase shape).

``models/`` owns it: ``FusedLinear`` and the parallel linears call it; ``quantization/``
implements it once per checkpoint format (the unquantized layers use none)::

    method.create_weights(layer, in_features, out_sizes, dtype)   registers the checkpoint's
        tensors as parameters, each with its own ``weight_loader(param, tensor, shard_id)``
    ... model.load_weights streams tensors through those loaders (fused q|k|v, gate|up too) ...
    method.process_weights_after_loading(layer)                   repack into the kernel layout
    method.apply(layer, x, bias) -> y                             the forward
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn


class LinearMethod(ABC):
    """How one linear layer holds, loads and applies its weights."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype) -> None:
        """Registers the checkpoint-format parameters on ``layer`` (each with a ``weight_loader``)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Converts the loaded parameters into what ``apply`` uses (default: nothing to do)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``y = x @ W.T + bias`` for ``x`` [T, in_features] -> [T, sum(out_sizes)] in x's dtype."""

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """Fills the parameters ``create_weights`` registered with random values a checkpoint could
        hold (dequantized weights of about standard deviation ``std``), for ``load_format="dummy"``."""
        raise NotImplementedError(f"{type(self).__name__} has no dummy weights")


class MoEMethod(ABC):
    """How a layer's routed experts (``models/moe.py`` ``FusedMoE``) hold, load and apply quantized
    weights: the same life cycle as ``LinearMethod``, over the stacked ``w13`` / ``w2``::

        method.create_weights(layer)                  replaces w13 / w2 and adds the scales, each a
            per-expert parameter loaded like them (``FusedMoE.add_expert_param``)
        method.process_weights_after_loading(layer)
        layer.forward -> moe_op(x, w13, w2, weights, ids, **method.op_kwargs(layer))
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Registers the checkpoint-format expert parameters on ``layer``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Converts the loaded parameters into what ``op_kwargs`` hands the MoE op (default: nothing)."""

    @abstractmethod
    def op_kwargs(self, layer: nn.Module) -> dict:
        """The MoE op's keyword arguments for these weights (``paged_backend/kernels/fused_moe_ref.py``: the scales)."""

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """Random expert tensors in the checkpoint's format (``load_format="dummy"``)."""
        raise NotImplementedError(f"{type(self).__name__} has no dummy weights")
