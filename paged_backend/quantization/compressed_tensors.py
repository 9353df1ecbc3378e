"""compressed-tensors checkpoints (what llm-compressor writes, ``quant_method: compressed-tensors``).

Two schemes are served:

- W4A16 ``pack-quantized`` (int4 weights, group or channel strategy, optional act-order)::

      weight_packed      int32 [N, K/8]  8 consecutive input columns per word, low nibble
                                         first, stored as q + 8 (signed int4 -> 0..15)
      weight_scale       [N, G]
      weight_zero_point  int32 [N/8, G]  (asymmetric only; packed along N, + 8)
      weight_g_idx       int32 [K]       (actorder "group" only)
      weight_shape       int   [2]       = (N, K)

      W[n, k] = (q[n, k] - zp[n, g(k)]) * scale[n, g(k)]     (zp = 0 when symmetric)

- FP8 ``float-quantized`` (e4m3 weights, tensor or channel scales, optional fp8 activations):
  served by ``Fp8LinearMethod``; routed experts with channel scales and dynamic per-token
  activations (GLM-4.5-FP8's recipe) by ``Fp8MoEMethod``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paged_backend.kernels.int4_gemm_ref import unpack_int4
from paged_backend.quantization.base import (
    MoEMethod,
    QuantizationConfig,
    experts_ignored,
    is_row_parallel,
    num_shards,
    quant_param,
    replace_param,
    tp_world_size,
    unsupported_experts,
)
from paged_backend.quantization.fp8 import Fp8LinearMethod
from paged_backend.quantization.fp8_moe import Fp8MoEMethod
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

INT_FORMATS = ("pack-quantized",)
FLOAT_FORMATS = ("float-quantized", "naive-quantized")


def _matches(target: str, name: str) -> bool:
    """compressed-tensors target syntax: ``re:<regex>``, a class name (``Linear``), or a module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target or name.endswith("." + target)


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[tuple[list[str], dict[str, Any]]], ignore: Sequence[str]) -> None:
        self.schemes = schemes  # (targets, validated scheme) in config order
        self.ignore = tuple(ignore)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> CompressedTensorsConfig:
        status = cfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors: quantization_status {status!r} is not supported (only 'compressed')")
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors: config_groups is empty")
        top_format = cfg.get("format")
        schemes = []
        for gname, group in groups.items():
            targets = list(group.get("targets") or [])
            if not targets:
                raise ValueError(f"compressed-tensors: config_groups.{gname} has no targets")
            schemes.append((targets, _scheme(gname, group, group.get("format") or top_format)))
        return cls(schemes, cfg.get("ignore") or ())

    def scheme_for(self, name: str) -> dict[str, Any] | None:
        if any(_matches(i, name) for i in self.ignore):
            return None
        for targets, scheme in self.schemes:
            if any(_matches(t, name) for t in targets):
                return scheme
        return None

    def get_linear_method(self, prefix: str, shard_names: Sequence[str]):
        found = [self.scheme_for(n) for n in shard_names]
        if any(f is not found[0] for f in found):
            raise ValueError(f"compressed-tensors: the fused shards {list(shard_names)} use different schemes")
        scheme = found[0]
        if scheme is None:
            return None
        if scheme["kind"] == "fp8":
            return Fp8LinearMethod(scheme["act_scheme"], prefix)
        return PackedInt4LinearMethod(scheme["group_size"], scheme["symmetric"], scheme["g_idx"], prefix)

    def get_moe_method(self, prefix: str, expert_names: Sequence[str]) -> MoEMethod | None:
        """FP8 experts with per-channel weight scales and dynamic per-token activations (GLM-4.5-FP8);
        other schemes (int4, per-tensor fp8, static or no fp8 activations) are refused by name."""
        if experts_ignored(expert_names, lambda name: self.scheme_for(name) is None):
            return None
        schemes = [self.scheme_for(n) for n in expert_names]
        if any(s is not schemes[0] for s in schemes):
            raise ValueError(unsupported_experts(expert_names, "the experts of one layer use different schemes"))
        scheme = schemes[0]
        if scheme["kind"] != "fp8":
            raise ValueError(unsupported_experts(expert_names, f"compressed-tensors {scheme['kind']} experts are not "
                                                              "supported (fp8 channel experts are)"))
        if scheme["strategy"] != "channel" or scheme["act_scheme"] != "dynamic_token":
            raise ValueError(unsupported_experts(
                expert_names, f"compressed-tensors fp8 experts with {scheme['strategy']} weight scales and "
                f"{scheme['act_scheme']} activations are not supported (channel weights with dynamic per-token "
                "activations are)"))
        return Fp8MoEMethod(None, prefix, expert_names)


def _scheme(gname: str, group: dict[str, Any], fmt: str | None) -> dict[str, Any]:
    where = f"compressed-tensors config_groups.{gname}"
    w = group.get("weights") or {}
    act = group.get("input_activations")
    wtype, strategy = w.get("type", "int"), w.get("strategy")
    if wtype == "int":
        if fmt not in INT_FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported for int weights ({', '.join(INT_FORMATS)})")
        if act:
            raise ValueError(f"{where}: int weights with quantized activations are not supported (W4A16 only)")
        if strategy == "channel":
            group_size = check_int4_config(where, w.get("num_bits"), -1)
        elif strategy == "group":
            group_size = check_int4_config(where, w.get("num_bits"), w.get("group_size"))
        else:
            raise ValueError(f"{where}: weight strategy {strategy!r} is not supported (group, channel)")
        actorder = w.get("actorder")
        if actorder not in (None, "group", "weight", "static", "dynamic"):
            raise ValueError(f"{where}: actorder {actorder!r} is not supported")
        return {"kind": "int4", "group_size": group_size, "symmetric": bool(w.get("symmetric", True)),
                "g_idx": actorder == "group"}
    if wtype == "float":
        if fmt not in FLOAT_FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported for float weights ({', '.join(FLOAT_FORMATS)})")
        if w.get("num_bits") != 8 or strategy not in ("tensor", "channel"):
            raise ValueError(f"{where}: float weights need num_bits 8 and strategy tensor or channel")
        return {"kind": "fp8", "strategy": strategy, "act_scheme": _act_scheme(where, act)}
    raise ValueError(f"{where}: weight type {wtype!r} is not supported (int, float)")


def _act_scheme(where: str, act: dict[str, Any] | None) -> str:
    if not act:
        return "none"
    if act.get("type") != "float" or act.get("num_bits") != 8:
        raise ValueError(f"{where}: input_activations must be 8-bit float")
    if act.get("dynamic") and act.get("strategy") == "token":
        return "dynamic_token"
    if act.get("dynamic") and act.get("strategy") == "tensor":
        return "dynamic_tensor"
    if not act.get("dynamic") and act.get("strategy") == "tensor":
        return "static_tensor"
    raise ValueError(f"{where}: input_activations strategy {act.get('strategy')!r} (dynamic={act.get('dynamic')}) "
                     "is not supported")


class PackedInt4LinearMethod(Int4LinearMethod):
    """compressed-tensors W4A16 ``pack-quantized``, repacked into the shared int4 kernel layout."""

    supports_tensor_parallel = True

    def __init__(self, group_size: int, symmetric: bool, has_g_idx: bool, prefix: str) -> None:
        super().__init__(group_size, prefix)
        self.symmetric = symmetric
        self.has_g_idx = has_g_idx

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype) -> None:
        k, n, s = in_features, sum(out_sizes), num_shards(layer)
        if k % 8 or (not self.symmetric and any(o % 8 for o in out_sizes)):
            raise ValueError(f"{self.prefix}: pack-quantized needs features divisible by 8, got {k} x {tuple(out_sizes)}")
        g = local_groups(layer, k, self.group_size, self.prefix)
        self.all_groups = self.has_g_idx and is_row_parallel(layer) and self.group_size != -1
        g_dim = None if self.group_size == -1 or self.all_groups else 1
        g_total = g * tp_world_size(layer) if self.all_groups else g
        self.out_sizes = tuple(out_sizes)
        self.in_total = k * tp_world_size(layer) if is_row_parallel(layer) else k
        quant_param(layer, "weight_packed", (n, k // 8), torch.int32, out_dim=0, in_dim=1, in_pack=8)
        quant_param(layer, "weight_scale", (n, g_total), torch.float32, out_dim=0, in_dim=g_dim, in_pack=self.group_size)
        quant_param(layer, "weight_shape", (s, 2), torch.int64, out_dim=None)
        if not self.symmetric:
            quant_param(layer, "weight_zero_point", (n // 8, g_total), torch.int32, out_dim=0, pack=8, in_dim=g_dim,
                        in_pack=self.group_size)
        if self.has_g_idx:
            quant_param(layer, "weight_g_idx", (s, k), torch.int32, out_dim=None, in_dim=0)

    def init_dummy_weights(self, layer: nn.Module, gen: torch.Generator, std: float) -> None:
        """Random nibbles, zero point 0 (stored + 8), positive scales, the checkpoint's weight_shape."""
        dev = layer.weight_packed.device
        layer.weight_packed.data.copy_(random_int32(layer.weight_packed.shape, gen, dev))
        layer.weight_scale.data.copy_(dummy_scales(layer.weight_scale.shape, gen, dev, std))
        spec = getattr(layer, "tp_spec", None)
        if spec is not None and spec.kind == "column":  # a column rank checks only that its rows exist
            rows = [sum(spec.out_ranges[i]) for i in (layer.shard_ids or (None,))]
        else:
            rows = list(self.out_sizes)
        layer.weight_shape.data.copy_(torch.tensor([[r, self.in_total] for r in rows], device=dev))
        if not self.symmetric:
            layer.weight_zero_point.data.fill_(int4_word(8))
        if self.has_g_idx:
            k = layer.weight_g_idx.shape[1]
            g_idx = dummy_g_idx(k, first_input_row(layer), self.group_size, True, gen, dev)
            layer.weight_g_idx.data.copy_(g_idx.expand_as(layer.weight_g_idx))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # the checkpoint's full (N, K); a column-parallel rank holds only part of each shard's N
        want = [[o, self.in_total] for o in self.out_sizes]
        got = layer.weight_shape.data.cpu().tolist()
        spec = getattr(layer, "tp_spec", None)
        if spec is not None and spec.kind == "column":
            ranges = [spec.out_ranges[i] for i in (layer.shard_ids or (None,))]
            ok = all(g[1] == w[1] and g[0] >= start + size for g, w, (start, size) in zip(got, want, ranges, strict=True))
        else:
            ok = got == want
        if not ok:
            raise ValueError(f"{self.prefix}: weight_shape {got} != expected {want}")
        q = unpack_int4(layer.weight_packed.data.t())  # [K, N]
        scales = layer.weight_scale.data.t()  # [G, N]
        if self.symmetric:
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8, device=scales.device)
        else:
            zeros = unpack_int32_cols(layer.weight_zero_point.data.t().contiguous())  # [G, N]
        g_idx = shared_g_idx(layer.weight_g_idx.data, self.prefix, "weight_g_idx") if self.has_g_idx else None
        if g_idx is not None and not self.all_groups:
            g_idx = g_idx - group_offset(layer, self.group_size)  # row-parallel: global -> this rank's groups
        for name in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"):
            replace_param(layer, name, None)
        if self.all_groups:
            self.finalize_sparse_groups(layer, q, zeros, scales, g_idx)
        else:
            self.finalize(layer, q, zeros, scales, g_idx)
