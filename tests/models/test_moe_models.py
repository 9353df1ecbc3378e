"""Mixture-of-experts families end to end: tiny random Qwen3-MoE, Mixtral and GLM-4.5 MoE checkpoints
saved by transformers itself; the engine's greedy tokens equal transformers' ``generate`` in fp32, whatever
the batching, chunking, prefix caching, preemption, tensor or expert parallelism; bad checkpoints fail at
load naming the tensor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from family_fixtures import (
    SCHEDULES,
    check_cuda_triton_greedy,
    check_greedy_equals_transformers,
    check_prefix_cache_and_preemption,
    check_tensor_parallel_2,
    hf_greedy,
    rewrite_checkpoint,
    scale_routers,
    tiny_llm,
)
from model_fixtures import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from paged_backend.attention.torch_attn import TorchAttentionBackend
from paged_backend.distributed import TPGroup
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.moe import FusedMoE
from paged_backend.models.parallel import check_tp_compatible
from paged_backend.worker.model_loader import load_model

pytestmark = pytest.mark.slow

FAMILIES = {
    # a dense first layer (mlp_only_layers), then routed layers; 8 experts, top-2, renormalized
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=3)),
    # every layer routed; 8 experts, top-2
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    # a dense first layer, then sigmoid routing with a correction bias over 2 groups (1 kept), a shared
    # expert, half of each head rotated, q/k norm, q/k/v bias and one (skipped) MTP layer
    "glm4_moe": ("Glm4MoeForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                            n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1,
                                            first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True,
                                            attention_bias=True, num_nextn_predict_layers=1)),
}
ROUTED = {"qwen3_moe": (False, True, True), "mixtral": (True, True), "glm4_moe": (False, True)}


def _add_mtp_layer(path: Path) -> None:
    """A multi-token-prediction layer's tensors after the decoder layers, as GLM-4.5 checkpoints store
    them (transformers' save_pretrained writes none); the engine skips them."""
    tensors = load_file(path / "model.safetensors")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    last = f"model.layers.{layers - 1}."
    mtp = {f"model.layers.{layers}." + n.removeprefix(last): t.clone() for n, t in tensors.items() if n.startswith(last)}
    mtp[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    arch, overrides = FAMILIES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    scale_routers(path)
    expected = hf_greedy(path)
    if overrides.get("num_nextn_predict_layers"):
        _add_mtp_layer(path)
    return path, expected


def test_model_info_reads_the_experts(family) -> None:
    """config.json's expert count, top-k, expert size and routed layers reach ModelInfo."""
    path, _ = family
    info = ModelInfo.from_dir(path)
    assert (info.num_experts, info.num_experts_per_tok, info.moe_intermediate_size) == (8, 2, 32)
    cfg = json.loads((path / "config.json").read_text())
    assert info.moe_layers == ROUTED[cfg["model_type"]] and info.routing is not None and info.routing.norm_topk_prob


@pytest.mark.parametrize("family", ["glm4_moe"], indirect=True)
def test_glm4_moe_reads_shared_experts_partial_rotary_and_mtp(family) -> None:
    """GLM-4.5's extras reach ModelInfo: the shared experts' size, half of each head rotated, q/k norm,
    q/k/v bias without o_proj bias, the routing bias and the MTP layer count."""
    path, _ = family
    info = ModelInfo.from_dir(path)
    assert (info.shared_expert_intermediate_size, info.rope_dim, info.head_dim, info.num_mtp_layers) == (32, 8, 16, 1)
    assert info.qk_norm and info.attention_bias and not info.o_proj_bias and info.rope_scaling is None
    assert info.routing is not None and info.routing.uses_correction_bias
    assert (info.routing.n_group, info.routing.topk_group, info.routing.routed_scaling_factor) == (2, 1, 2.5)
    assert any(n.startswith(f"model.layers.{info.num_layers}.") for n in load_file(path / "model.safetensors"))


@pytest.mark.parametrize("kw", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_greedy_equals_transformers(family, kw) -> None:
    """Greedy tokens equal transformers' generate token for token, batched, alone or chunked."""
    check_greedy_equals_transformers(*family, **kw)


def test_prefix_cache_and_preemption_keep_the_tokens(family) -> None:
    """A second pass served from the prefix cache, and a cache so small that requests are
    preempted, give the same tokens."""
    check_prefix_cache_and_preemption(*family)


def test_a_missing_expert_fails_at_load_naming_it(family, tmp_path) -> None:
    """A checkpoint without one expert's tensor is refused, the missing tensor named."""
    path, _ = family
    name = next(n for n in load_file(path / "model.safetensors") if ".experts.3." in n)
    bad = rewrite_checkpoint(path, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match="missing tensor"):
        tiny_llm(bad)


def test_an_expert_beyond_the_config_fails_at_load_naming_it(family, tmp_path) -> None:
    """An expert index the config does not have (more experts in the checkpoint) is refused by name."""
    path, _ = family

    def extra(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = next(n for n in t if ".experts.7." in n)
        return {**t, name.replace(".experts.7.", ".experts.8."): t[name].clone()}

    bad = rewrite_checkpoint(path, tmp_path / "bad", extra)
    with pytest.raises(ValueError, match=r"experts\.8\..*expert 8 is out of range"):
        tiny_llm(bad)


def test_tensor_parallel_2_equals_1(family) -> None:
    """Split over 2 ranks (each holds half of every expert's intermediate features, gloo on the CPU),
    the greedy tokens are those of one rank and of transformers."""
    check_tensor_parallel_2(*family)


def _experts(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_expert_parallel_2_equals_1(family) -> None:
    """Whole experts per rank (4 of the 8 each, gloo on the CPU): the greedy tokens are those of one
    rank and of transformers, and rank 0 holds experts 0..3 only; at tensor_parallel_size 1 the flag
    changes nothing."""
    path, expected = family
    check_greedy_equals_transformers(path, expected, enable_expert_parallel=True)
    llm = check_tensor_parallel_2(path, expected, enable_expert_parallel=True)
    experts = _experts(llm.engine.runner.local.model)
    assert experts and all(e.expert_parallel and e.w13.shape[0] == e.w2.shape[0] == 4 for e in experts)
    assert all(e.expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1] for e in experts)


def test_expert_parallel_ranks_load_only_their_experts_and_name_bad_tensors(family, tmp_path) -> None:
    """Each of 2 ranks (built without processes: loading runs no collective) holds 4 whole experts of
    every routed layer; a checkpoint missing an expert of the other rank still fails on rank 0 (naming
    the expert parameter), and one misshaping it names the tensor."""
    path, _ = family
    info = ModelInfo.from_dir(path)

    def load(src, rank: int = 0):
        tp = TPGroup(rank, 2, torch.device("cpu"), expert_parallel=True)
        return load_model(src, info, torch.float32, "cpu", TorchAttentionBackend(), tp=tp)

    for rank in (0, 1):
        experts = _experts(load(path, rank))
        assert len(experts) == sum(info.moe_layers)
        for e in experts:
            assert e.w13.shape == (4, 2 * info.moe_intermediate_size, info.hidden_size)
            assert e.w2.shape == (4, info.hidden_size, info.moe_intermediate_size)
            assert e.expert_start == 4 * rank
    names = load_file(path / "model.safetensors")
    name = next(n for n in names if ".experts.6." in n)  # rank 1's
    missing = rewrite_checkpoint(path, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=r"missing tensor.*\.mlp\.experts\.w(13|2)\b"):
        load(missing)
    bad = rewrite_checkpoint(path, tmp_path / "shape", lambda t: {**t, name: t[name][:-1]})
    with pytest.raises(ValueError, match=rf"{name}.*shape mismatch"):
        load(bad)


@pytest.mark.parametrize("family", ["glm4_moe"], indirect=True)
def test_expert_parallel_sizes_are_checked_before_any_process(family) -> None:
    """With whole experts per rank the expert size need not divide by the ranks, the expert count must
    cover them; the dense layers and shared experts still split their features."""
    info = ModelInfo.from_dir(family[0])
    odd = dataclasses.replace(info, moe_intermediate_size=30, shared_expert_intermediate_size=30)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\) is not divisible"):
        check_tp_compatible(odd, 4)
    with pytest.raises(ValueError, match=r"shared experts' intermediate size \(30\) is not divisible"):
        check_tp_compatible(odd, 4, expert_parallel=True)
    check_tp_compatible(dataclasses.replace(odd, shared_expert_intermediate_size=32), 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"num_experts \(2\) is smaller than tensor_parallel_size \(4\)"):
        check_tp_compatible(dataclasses.replace(info, num_experts=2), 4, expert_parallel=True)


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}], ids=["batched", "chunked"])
def test_cuda_triton_kernels_equal_transformers(family, kw) -> None:
    """The fused-MoE, attention, rotary and norm kernels compiled on the GPU keep the tokens."""
    check_cuda_triton_greedy(*family, **kw)
