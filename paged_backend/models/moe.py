"""The routed experts of a mixture-of-experts layer as two stacked parameters.

    w13  [E, 2I, H]   per expert: gate rows [0, I), up rows [I, 2I)  (``paged_backend/kernels/fused_moe_ref.py``)
    w2   [E, H, I]    per expert: the down projection

``FusedMoE.forward(x, router_logits)`` = ``select_experts`` (``moe_routing.py``) then the MoE op
(``fused_moe_ref`` by default; the model may pass the Triton kernel as ``moe_op``). The router's
linear and any shared experts (a dense MLP the model builds) sit beside it in ``SparseMoeBlock``. With
``noaux_tc`` routing the module also holds the router's ``e_score_correction_bias`` [E] (float32).

Tensor parallelism: with a ``TPGroup`` each rank holds I / tp of every expert's intermediate
features (its rows of gate and of up in w13, its columns of w2) and the output is all-reduced once
per layer, as ``RowParallelLinear`` does; with ``tp=None`` nothing is split.

Expert parallelism (``TPGroup.expert_parallel``, ``--enable-expert-parallel``): each rank instead
holds whole experts, the contiguous block ``expert_range`` gives it (models/parallel.py: E // tp
each, one more on each of the first E % tp ranks), so w13 / w2 are [E_local, 2I, H] / [E_local, H, I].
The router and ``select_experts`` run on every rank on the same (replicated) hidden states; the
``expert_map`` buffer [E] (global id -> local index, -1 elsewhere) makes the MoE op compute only
the (token, slot) pairs of this rank's experts, and the same one all-reduce per layer sums the
ranks' partial outputs. Loaders read only this rank's experts: per-expert tensors of other ranks are
skipped unread (their shapes still checked), stacks are read through ``narrow`` on dim 0.

Checkpoint layouts (what transformers 5.24's ``save_pretrained`` writes, ``{L}`` = ``model.layers.N``):

    per-expert (the default, ``save_original_format=True``; the hub's own checkpoints)
        Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V2/V3:
            {L}.mlp.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]
        Mixtral:
            {L}.block_sparse_moe.experts.{e}.w1.weight (gate) [I, H], .w3.weight (up) [I, H],
            .w2.weight (down) [H, I]
    stacked (``save_original_format=False``: transformers' in-memory layout, every family,
    Mixtral included, under ``mlp``; no ``.weight`` suffix)
            {L}.mlp.experts.gate_up_proj [E, 2I, H] (gate rows then up rows), {L}.mlp.experts.down_proj [E, H, I]

The router lives beside them: ``{L}.mlp.gate.weight`` [E, H] (Mixtral per-expert:
``{L}.block_sparse_moe.gate.weight``), and for GLM-4.5 / DeepSeek-V3 ``{L}.mlp.gate.e_score_correction_bias`` [E].

Loader shard ids are ``(proj, expert)``: proj ``"gate"`` / ``"up"`` / ``"down"`` for one expert's
tensor, or with expert ``None`` a stack over all experts (``"gate_up"`` [E, 2I, H], ``"down"``
[E, H, I], also ``"gate"`` / ``"up"`` [E, I, H]).

Quantized experts (``set_quant_method``, a ``MoEMethod`` from ``quantization/``): the method replaces
w13 / w2 (e4m3) and adds its scales through ``add_expert_param``, per-expert parameters that the same
``weight_loader`` fills (each says which dim runs along the intermediate features and how many
features an element covers, e.g. a 128-row scale block). Their checkpoint names end in the scale's
suffix: ``{L}.mlp.experts.{e}.gate_proj.weight_scale_inv`` -> ``w13_weight_scale_inv`` (shard
("gate", e)), ``.weight_scale`` -> ``w13_weight_scale``; the forward hands them to the MoE op
(``MoEMethod.op_kwargs``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_backend.kernels.fp8_types import FP8_DTYPE
from paged_backend.kernels.fused_moe_ref import fused_moe_ref
from paged_backend.models.layers import new_param
from paged_backend.models.moe_routing import RoutingConfig, select_experts
from paged_backend.models.parallel import LazyTensor, as_tensor, expert_range, narrow, split

if TYPE_CHECKING:
    from paged_backend.distributed import TPGroup
    from paged_backend.models.linear_method import MoEMethod

MoEShardId = tuple[str, int | None]
MoEOp = Callable[..., torch.Tensor]
PROJS = ("gate", "up", "down", "gate_up")

# layout -> (module under the layer prefix, {checkpoint projection name: proj}); "stacked" has no expert index
EXPERT_LAYOUTS: dict[str, tuple[str, dict[str, str]]] = {
    "gate_up_down": ("mlp", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
    "w1_w3_w2": ("block_sparse_moe", {"w1": "gate", "w3": "up", "w2": "down"}),
    "stacked": ("mlp", {"gate_up_proj": "gate_up", "down_proj": "down"}),
}
# model_type -> the layouts its checkpoints come in (per-expert first)
FAMILY_EXPERT_LAYOUTS: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("gate_up_down", "stacked"),
    "mixtral": ("w1_w3_w2", "stacked"),
    "glm4_moe": ("gate_up_down", "stacked"),
    "glm4_moe_lite": ("gate_up_down", "stacked"),
    "deepseek_v2": ("gate_up_down", "stacked"),
    "deepseek_v3": ("gate_up_down", "stacked"),
}


def _layout(style: str) -> tuple[str, dict[str, str]]:
    if style not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert checkpoint layout {style!r} (one of {tuple(EXPERT_LAYOUTS)})")
    return EXPERT_LAYOUTS[style]


def _param_for(proj: str) -> str:
    return "w2" if proj == "down" else "w13"


# what a per-expert tensor's name ends with: the weight, an fp8 checkpoint's scales, or an int4 one's
# packed tensors (the parameter ``w13`` / ``w2`` gets ``_<suffix>``: ``w13_weight_scale_inv``, ``w2_qzeros``)
EXPERT_SUFFIXES = ("weight", "weight_scale_inv", "weight_scale", "qweight", "qzeros", "scales", "g_idx")


def expert_param_name(base: str, suffix: str = "weight") -> str:
    """The FusedMoE parameter of checkpoint suffix ``suffix`` for ``base`` "w13" | "w2"."""
    return base if suffix == "weight" else f"{base}_{suffix}"


def checkpoint_expert_names(prefix: str, num_experts: int, style: str,
                            suffix: str = "weight") -> Iterator[tuple[str, str, MoEShardId]]:
    """(checkpoint tensor name, parameter "w13" | "w2", shard id) of every expert tensor of the layer
    at ``prefix`` (e.g. ``model.layers.3``) in layout ``style``; another ``suffix`` (per-expert
    layouts only) names that scale of every expert, and its parameter (``expert_param_name``)."""
    module, projs = _layout(style)
    if style == "stacked":
        for name, proj in projs.items():
            yield f"{prefix}.{module}.experts.{name}", _param_for(proj), (proj, None)
        return
    for e in range(num_experts):
        for name, proj in projs.items():
            yield (f"{prefix}.{module}.experts.{e}.{name}.{suffix}", expert_param_name(_param_for(proj), suffix),
                   (proj, e))


def parse_expert_name(name: str, prefix: str, num_experts: int, style: str) -> tuple[str, MoEShardId] | None:
    """(parameter, shard id) of checkpoint tensor ``name`` if it is an expert tensor of the layer at
    ``prefix`` in layout ``style``, else None; ValueError for an expert index out of range."""
    module, projs = _layout(style)
    alternatives = "|".join(re.escape(p) for p in projs)
    head = re.escape(f"{prefix}.{module}.experts.")
    if style == "stacked":
        match = re.fullmatch(f"{head}({alternatives})", name)
        return None if match is None else (_param_for(projs[match[1]]), (projs[match[1]], None))
    suffixes = "|".join(EXPERT_SUFFIXES)
    match = re.fullmatch(rf"{head}(\d+)\.({alternatives})\.({suffixes})", name)
    if match is None:
        return None
    expert = int(match[1])
    if expert >= num_experts:
        raise ValueError(f"checkpoint tensor {name}: expert {expert} is out of range (the layer has "
                         f"{num_experts} experts)")
    return expert_param_name(_param_for(projs[match[2]]), match[3]), (projs[match[2]], expert)


def make_expert_map(num_experts: int, start: int, count: int) -> torch.Tensor:
    """int32 [num_experts]: global expert id -> its index among the ``count`` experts from ``start``
    this rank holds, or -1 for an expert held elsewhere."""
    mapping = torch.full((num_experts,), -1, dtype=torch.int32)
    mapping[start : start + count] = torch.arange(count, dtype=torch.int32)
    return mapping


class FusedMoE(nn.Module):
    """Routed experts ``w13`` [E, 2I/tp, H], ``w2`` [E, H, I/tp] with per-expert weight loaders
    (expert parallelism: [E_local, 2I, H], [E_local, H, I], this rank's experts whole)."""

    def __init__(
        self,
        routing: RoutingConfig,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        moe_op: MoEOp = fused_moe_ref,
    ) -> None:
        super().__init__()
        self.routing = routing
        self.num_experts = routing.num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.tp = tp
        self.moe_op = moe_op
        # expert parallelism: experts [expert_start, + num_local_experts) whole; else all, features split
        self.expert_parallel = tp is not None and tp.expert_parallel
        self.expert_start, self.num_local_experts = expert_range(self.num_experts, tp if self.expert_parallel else None)
        if tp is None or self.expert_parallel:
            start, size = 0, intermediate_size
        else:
            start, size = split(intermediate_size, tp, "moe_intermediate_size")
        self.i_start, self.i_local = start, size
        self.w13 = new_param((self.num_local_experts, 2 * size, hidden_size), dtype, self.weight_loader)
        self.w2 = new_param((self.num_local_experts, hidden_size, size), dtype, self.weight_loader)
        # global expert id -> index in w13 / w2, or -1 (another rank's); None without expert parallelism
        self.register_buffer("expert_map", torch.empty(self.num_experts, dtype=torch.int32)
                             if self.expert_parallel else None, persistent=False)
        self.init_buffers()
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing.uses_correction_bias:
            self.e_score_correction_bias = new_param((self.num_experts,), torch.float32)
        self.w13.is_loaded = self._w13_loaded
        self.w2.is_loaded = self._w2_loaded
        self.quant_method: MoEMethod | None = None  # quantized experts (set_quant_method)

    def set_quant_method(self, method: MoEMethod) -> None:
        """Quantized experts: ``method`` replaces w13 / w2 by its checkpoint-format parameters."""
        self.quant_method = method
        method.create_weights(self)

    def add_expert_param(self, name: str, per_expert: tuple[int, ...], dtype: torch.dtype, kind: str,
                         i_dim: int | None, i_pack: int = 1) -> nn.Parameter:
        """Registers ``name`` [E_local, *per_expert] (replacing a parameter of that name), loaded per
        expert by ``weight_loader`` like ``kind`` ("w13": gate and up, "w2": down): ``i_dim`` is the
        dim of one expert's tensor that runs along the intermediate features (None: none, the tensor
        is whole on every rank), ``i_pack`` features per element there (a block scale's block)."""
        if kind not in ("w13", "w2"):
            raise ValueError(f"expert parameter kind must be 'w13' or 'w2', got {kind!r}")
        if i_dim is not None and self.i_local != self.intermediate_size and (self.i_local % i_pack
                                                                              or self.i_start % i_pack):
            raise ValueError(f"{name}: this rank's {self.i_local} intermediate features are not whole blocks of "
                             f"{i_pack}")
        param = new_param((self.num_local_experts, *per_expert), dtype, self.weight_loader)
        param.moe_kind, param.moe_i_dim, param.moe_i_pack = kind, i_dim, i_pack
        param.is_loaded = self._w2_loaded if kind == "w2" else self._w13_loaded
        if name in self._parameters:
            del self._parameters[name]
        self.register_parameter(name, param)
        return param

    def init_buffers(self) -> None:
        """(Re)fills ``expert_map``; call after ``to_empty`` materialises a meta-built layer."""
        if self.expert_map is not None and self.expert_map.device.type != "meta":
            mapping = make_expert_map(self.num_experts, self.expert_start, self.num_local_experts)
            self.expert_map.copy_(mapping)

    def _w13_loaded(self, shards: set) -> bool:
        """Every expert's gate and up, one by one, or the whole stack at once."""
        per_expert = {(p, e) for p in ("gate", "up") for e in range(self.num_experts)}
        return ("gate_up", None) in shards or {("gate", None), ("up", None)} <= shards or per_expert <= shards

    def _w2_loaded(self, shards: set) -> bool:
        return ("down", None) in shards or {("down", e) for e in range(self.num_experts)} <= shards

    # -- loading ----------------------------------------------------------------------------

    def _check_shard(self, param: nn.Parameter, shard_id: MoEShardId) -> tuple[str, int | None]:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"expert shard id must be (proj, expert), got {shard_id!r}")
        proj, expert = shard_id
        if proj not in PROJS:
            raise ValueError(f"unknown expert projection {proj!r} (one of {PROJS})")
        kind = getattr(param, "moe_kind", None) or ("w2" if param is self.w2 else "w13")
        if (kind == "w2") != (proj == "down"):
            raise ValueError(f"projection {proj!r} does not belong to this parameter")
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range (the layer has {self.num_experts} experts)")
        return proj, expert

    def _parts(self, proj: str) -> list[tuple[int, int]]:
        """(start in the checkpoint tensor's intermediate dim, start in the parameter's) of each
        part of ``proj`` this rank holds (gate_up: one part in the gate rows, one in the up rows)."""
        full, local, start = self.intermediate_size, self.i_local, self.i_start
        parts = {"gate": [(start, 0)], "up": [(start, local)], "down": [(start, 0)],
                 "gate_up": [(start, 0), (full + start, local)]}
        return parts[proj]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | LazyTensor,
                      shard_id: MoEShardId | None = None) -> None:
        """Writes one checkpoint tensor (one expert's, or a stack over experts) into this rank's slice."""
        if shard_id is None:
            raise ValueError("expert parameter needs a shard id (proj, expert)")
        proj, expert = self._check_shard(param, shard_id)
        dims = param.dim() - (expert is not None)
        if loaded_weight.dim() == dims + 1 and loaded_weight.shape[-1] == 1:  # a [N, 1] column of scales
            loaded_weight = as_tensor(loaded_weight).reshape(loaded_weight.shape[:-1])
        # the intermediate-feature dim: rows of gate/up, columns of down (+1 for a stack over experts);
        # a scale parameter says its own (add_expert_param), and how many features an element covers
        per_expert_dim = getattr(param, "moe_i_dim", 1 if proj == "down" else 0)
        pack = getattr(param, "moe_i_pack", 1)
        i_dim = None if per_expert_dim is None else per_expert_dim + (1 if expert is None else 0)
        features = 2 * self.intermediate_size if proj == "gate_up" else self.intermediate_size
        full = -(-features // pack)
        if loaded_weight.dim() != dims or (i_dim is not None and loaded_weight.shape[i_dim] != full):
            raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded_weight.shape)}, expert shard "
                             f"{shard_id!r} expects {full} intermediate features in dim {i_dim} of a "
                             f"{dims}-d tensor")
        if expert is None:  # a stack over all experts: this rank's block of them
            if loaded_weight.shape[0] != self.num_experts:
                raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded_weight.shape)}, expert shard "
                                 f"{shard_id!r} expects {self.num_experts} experts in dim 0")
            dst = param.data
            if self.num_local_experts != self.num_experts:
                loaded_weight = narrow(loaded_weight, 0, self.expert_start, self.num_local_experts)
        elif self.expert_start <= expert < self.expert_start + self.num_local_experts:
            dst = param.data[expert - self.expert_start]
        else:  # another rank's expert: not read, but its shape checked (every rank names a bad tensor)
            want = [*param.shape[1:]]
            if i_dim is not None:
                want[i_dim] = full
            if list(loaded_weight.shape) != want:
                raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded_weight.shape)}, expert shard "
                                 f"{shard_id!r} expects {tuple(want)}")
            return
        if i_dim is None:  # not split over the intermediate features (per-channel scales of down's outputs)
            _copy(dst, as_tensor(loaded_weight), shard_id)
            return
        parts = self._parts(proj)
        if self.i_local == self.intermediate_size:  # the parts are contiguous: one read, one copy
            _copy(dst.narrow(i_dim, parts[0][1] // pack, full), as_tensor(loaded_weight), shard_id)
            return
        local = self.i_local // pack
        for src_start, dst_start in parts:
            src = narrow(loaded_weight, i_dim, src_start // pack, local)
            _copy(dst.narrow(i_dim, dst_start // pack, local), src, shard_id)

    # -- checkpoint names -------------------------------------------------------------------

    def parse_expert_name(self, name: str, prefix: str, style: str) -> tuple[str, MoEShardId] | None:
        """``parse_expert_name`` for this layer's expert count."""
        return parse_expert_name(name, prefix, self.num_experts, style)

    # -- forward ----------------------------------------------------------------------------

    def select(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights, topk_ids) of this layer's routing."""
        return select_experts(router_logits, self.routing, self.e_score_correction_bias)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Routed experts' output [T, H] for ``x`` [T, H] (all-reduced over the TP ranks)."""
        weights, ids = self.select(router_logits)
        quant = {} if self.quant_method is None else self.quant_method.op_kwargs(self)  # fp8: the scales
        if self.expert_map is None:
            out = self.moe_op(x, self.w13, self.w2, weights, ids, **quant)
        else:  # this rank's experts only; the all-reduce sums the ranks' parts
            out = self.moe_op(x, self.w13, self.w2, weights, ids, expert_map=self.expert_map, **quant)
        return out if self.tp is None else self.tp.all_reduce(out)


def _copy(dst: torch.Tensor, src: torch.Tensor, shard_id: MoEShardId) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: checkpoint has {tuple(src.shape)}, expert shard {shard_id!r} expects "
                         f"{tuple(dst.shape)}")
    if (src.dtype == FP8_DTYPE) != (dst.dtype == FP8_DTYPE):  # never a silent cast between fp8 and floats
        raise ValueError(f"dtype mismatch: checkpoint has {src.dtype}, expert shard {shard_id!r} expects {dst.dtype}"
                         + (" (fp8 experts without a quantization_config in config.json)" if src.dtype == FP8_DTYPE
                            else ""))
    dst.copy_(src)


class Router(nn.Module):
    """The router's linear: ``weight`` [E, H] (replicated on every rank), logits in x's dtype."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param((num_experts, hidden_size), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as routed experts: ``gate`` (the router) and ``experts`` (FusedMoE),
    plus the output of ``shared_experts`` (GLM-4.5: a dense MLP every token goes through) if given."""

    def __init__(self, routing: RoutingConfig, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 tp: TPGroup | None = None, moe_op: MoEOp = fused_moe_ref,
                 shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = Router(routing.num_experts, hidden_size, dtype)
        self.experts = FusedMoE(routing, hidden_size, intermediate_size, dtype, tp, moe_op)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        return out if self.shared_experts is None else out + self.shared_experts(x)
