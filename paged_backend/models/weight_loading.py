"""Checkpoint tensors into a model's parameters, by HF name (the Llama family and its MoE kin).

    q_proj | k_proj | v_proj      -> qkv_proj (shards "q", "k", "v")
    gate_proj | up_proj           -> gate_up_proj (shards 0, 1)
    mlp.gate_up_proj [2I, H]      -> gate_up_proj, split in halves (shards 0, 1): GLM and GLM-4 store gate|up
                                     fused (``fused_gate_up_checkpoint``; dense weights and biases only)
    mlp.experts.{e}.<proj>        -> mlp.experts.w13 | w2 (shards (proj, e); models/moe.py's layouts)
    mlp.experts.{e}.<proj>.weight_scale_inv | weight_scale
                                  -> mlp.experts.w13_weight_scale_inv | ... (fp8 experts' scales, same shards)
    block_sparse_moe.gate         -> mlp.gate (Mixtral's router)
    mlp.gate.e_score_correction_bias -> mlp.experts.e_score_correction_bias (GLM-4.5's routing bias)
    mlp.shared_experts.<proj>     -> as a dense MLP's (GLM-4.5)
    model.layers.{L + i}.*        -> mtp.layers.{i}.* (then as above): the i-th multi-token-prediction
                                     layer after the L decoder layers (num_nextn_predict_layers), when the
                                     model has them (speculative decoding's "mtp", models/mtp.py; its
                                     embed_tokens copy is not loaded, the model's is shared); else skipped
    *.k_scale / v_scale / kv_scale -> the attention's fp8 KV-scale buffers

Each tensor goes through its parameter's ``weight_loader``; unknown names and shape mismatches
raise ``ValueError`` naming the checkpoint tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_backend.models.model_info import ModelInfo
from paged_backend.models.moe import (
    EXPERT_SUFFIXES,
    FAMILY_EXPERT_LAYOUTS,
    MoEShardId,
    checkpoint_expert_names,
    parse_expert_name,
)
from paged_backend.models.parallel import LazyTensor, narrow

if TYPE_CHECKING:
    from paged_backend.distributed import PPStage

# (fused parameter, HF checkpoint name, shard id)
STACKED_PARAMS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
# checkpoint names of per-layer KV-cache scales -> our buffer names (kv_scale sets both)
_KV_SCALE = re.compile(
    r"^(?P<prefix>.*\.self_attn)\.(?:attn\.|k_proj\.|v_proj\.)?(?P<which>k|v|kv)_scale$"
    r"|^(?P<prefix2>.*\.self_attn)\.(?P<which2>k|v)_proj\.output_scale$"
)
_IGNORED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_LAYER_PREFIX = re.compile(r"^(?:model|mtp)\.layers\.(\d+)\.")  # a decoder or an MTP layer
_MTP_CHECKPOINT = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_PARAM = re.compile(r"^mtp\.layers\.(\d+)\.")
_CORRECTION_BIAS = (".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias")
_FUSED_GATE_UP = ".gate_up_proj."
_EXPERT_SCALE = re.compile(rf"^((?:model|mtp)\.layers\.\d+)\.mlp\.experts\.(w13|w2)_({'|'.join(EXPERT_SUFFIXES[1:])})$")


def expert_checkpoint_modules(info: ModelInfo, prefix: str) -> list[str]:
    """The checkpoint module names (``model.layers.3.mlp.experts.0.gate_proj``, ...) of the routed experts
    of the layer at ``prefix`` in the family's per-expert layout: what a quantization config matches."""
    style = FAMILY_EXPERT_LAYOUTS[info.model_type][0]
    return [_mtp_checkpoint_name(info, name).removesuffix(".weight")
            for name, _, _ in checkpoint_expert_names(prefix, info.num_experts, style)]


def checkpoint_names(param_name: str, info: ModelInfo) -> list[str]:
    """The HF tensor names that load ``param_name`` (several for a fused parameter)."""
    return [_mtp_checkpoint_name(info, n) for n in _checkpoint_names(param_name, info)]


def _checkpoint_names(param_name: str, info: ModelInfo) -> list[str]:
    if info.fused_gate_up_checkpoint and _FUSED_GATE_UP in param_name:
        return [param_name]
    scale = _EXPERT_SCALE.match(param_name) if info.is_moe else None
    if scale:  # an fp8 expert scale: that tensor of every expert (per-expert layouts only)
        prefix, base, suffix = scale.groups()
        style = FAMILY_EXPERT_LAYOUTS[info.model_type][0]
        return [n for n, p, _ in checkpoint_expert_names(prefix, info.num_experts, style, suffix)
                if p == f"{base}_{suffix}"]
    if info.mla is not None and ".self_attn." in param_name:
        return [param_name]
    names = [param_name.replace(fused, orig) for fused, orig, _ in STACKED_PARAMS if fused in param_name]
    if param_name.endswith(_CORRECTION_BIAS[1]):
        names = [param_name.replace(_CORRECTION_BIAS[1], _CORRECTION_BIAS[0])]
    return names or [param_name]


def load_checkpoint_tensors(model: nn.Module, info: ModelInfo, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Loads HF-named tensors; returns the names of the parameters (and KV-scale buffers) fully
    loaded (a fused parameter counts once all its shards were seen)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    seen: dict[str, set] = {}
    has_mtp = getattr(model, "mtp", None) is not None
    for name, tensor in weights:
        if any(s in name for s in _IGNORED):
            continue
        if info.tie_word_embeddings and name.startswith("lm_head."):
            continue  # the tied lm_head is embed_tokens
        if _is_mtp_layer(info, name):  # a multi-token-prediction layer: run only as speculative decoding's proposer
            if not has_mtp or name.endswith(".embed_tokens.weight"):
                continue  # not run, or its copy of the model's embedding (the model's is shared)
            name = _MTP_CHECKPOINT.sub(lambda m: f"mtp.layers.{int(m[1]) - info.num_layers}.", name, count=1)
        m = _KV_SCALE.match(name)
        if m:
            prefix, which = m["prefix"] or m["prefix2"], m["which"] or m["which2"]
            for kind in ("k", "v") if which == "kv" else (which,):
                seen.setdefault(_load_scale(buffers, f"{prefix}.{kind}_scale", name, tensor), set())
            continue
        if info.fused_gate_up_checkpoint and _FUSED_GATE_UP in name:  # one tensor, both shards
            for shard, part in enumerate(_gate_up_halves(name, tensor)):
                _load_into(params, seen, name, name, shard, part)
            continue
        pname, shard = _target(info, name)
        _load_into(params, seen, name, pname, shard, tensor)
    loaded = {n for n, shards in seen.items() if n in buffers or _fully_loaded(params[n], shards)}
    if has_mtp:  # an MTP layer stored without its head shares the model's
        model.mtp.share_missing_heads(loaded, model.lm_head)
    return loaded


def stage_weights(info: ModelInfo, stage: PPStage, weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors a pipeline stage loads: its decoder layers', the embedding on the first
    stage (and on the last when the LM head is tied to it), the final norm and LM head on the last."""
    embeds = stage.is_first or (stage.is_last and info.tie_word_embeddings)
    for name, tensor in weights:
        layer = _LAYER_PREFIX.match(name)
        if layer is not None:
            i = int(layer[1])
            if i < info.num_layers and not stage.start <= i < stage.end:
                continue  # another stage's layer (MTP layers past the decoder go on, to be skipped as before)
        elif name.startswith("model.embed_tokens."):
            if not embeds:
                continue
        elif name.startswith(("model.norm.", "lm_head.")) and not stage.is_last:
            continue
        yield name, tensor


def _target(info: ModelInfo, name: str) -> tuple[str, object]:
    """The parameter a checkpoint tensor loads, and its shard id there."""
    expert = _expert_shard(info, name)
    if expert is not None:
        return expert
    if info.is_moe:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's router
        if name.endswith(_CORRECTION_BIAS[0]):  # the router's bias is FusedMoE's (it only selects)
            return name.replace(*_CORRECTION_BIAS), None
    if info.mla is not None and ".self_attn." in name:  # latent attention: its own modules, none fused
        return name, None
    for fused, orig, shard_id in STACKED_PARAMS:
        if orig in name:
            return name.replace(orig, fused), shard_id
    return name, None


def _expert_shard(info: ModelInfo, name: str) -> tuple[str, MoEShardId] | None:
    """(parameter, shard id) of a routed expert's checkpoint tensor, else None."""
    if not info.is_moe or ".experts." not in name:
        return None
    layer = _LAYER_PREFIX.match(name)
    if layer is None:
        return None
    prefix = layer[0].rstrip(".")
    for style in FAMILY_EXPERT_LAYOUTS[info.model_type]:
        found = parse_expert_name(name, prefix, info.num_experts, style)
        if found is not None:
            return f"{prefix}.mlp.experts.{found[0]}", found[1]
    return None


def _gate_up_halves(name: str, tensor: torch.Tensor | LazyTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate rows and the up rows of a fused gate|up weight or bias (a LazyTensor reads each alone)."""
    if not name.endswith((".weight", ".bias")):
        raise ValueError(f"tensor {name!r}: a fused gate_up_proj is only supported as dense weight and bias")
    rows = tensor.shape[0]
    if rows % 2:
        raise ValueError(f"tensor {name!r}: a fused gate|up tensor needs an even number of rows, got {rows}")
    return narrow(tensor, 0, 0, rows // 2), narrow(tensor, 0, rows // 2, rows // 2)


def _is_mtp_layer(info: ModelInfo, name: str) -> bool:
    """A tensor of one of the multi-token-prediction layers stored after the decoder layers."""
    layer = _LAYER_PREFIX.match(name) if info.num_mtp_layers else None
    return layer is not None and info.num_layers <= int(layer[1]) < info.num_layers + info.num_mtp_layers


def _mtp_checkpoint_name(info: ModelInfo, name: str) -> str:
    """``mtp.layers.{i}.*`` -> ``model.layers.{L + i}.*`` (other names unchanged)."""
    return _MTP_PARAM.sub(lambda m: f"model.layers.{info.num_layers + int(m[1])}.", name, count=1)


def _load_into(params: dict[str, nn.Parameter], seen: dict[str, set], name: str, pname: str, shard,
               tensor: torch.Tensor) -> None:
    param = params.get(pname)
    if param is None:
        raise ValueError(f"unexpected tensor {name!r}: the model has no parameter {pname!r}")
    try:
        param.weight_loader(param, tensor, shard)
    except ValueError as e:
        raise ValueError(f"tensor {name!r}: {e}") from None
    seen.setdefault(pname, set()).add(shard)


def _fully_loaded(param: nn.Parameter, shards: set) -> bool:
    """Every shard of a fused parameter seen (a parameter may say itself: ``is_loaded``)."""
    check = getattr(param, "is_loaded", None)
    if check is not None:
        return check(shards)
    return set(getattr(param, "shard_ids", ()) or (None,)) <= shards


def _load_scale(buffers: dict[str, torch.Tensor], bname: str, name: str, tensor: torch.Tensor) -> str:
    buf = buffers.get(bname)
    if buf is None:
        raise ValueError(f"unexpected tensor {name!r}: the model has no buffer {bname!r}")
    if tensor.numel() != 1:
        raise ValueError(f"tensor {name!r}: only per-tensor KV scales are supported, got {tuple(tensor.shape)}")
    buf.copy_(tensor.reshape(()).float())
    return bname
