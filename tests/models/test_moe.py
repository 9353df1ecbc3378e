"""Mixture-of-experts building blocks against naive math and transformers' own MoE modules:
``fused_moe_ref`` (the CPU MoE op), ``select_experts`` / ``RoutingConfig`` (routing of Qwen3-MoE,
Mixtral, GLM-4.5, DeepSeek-V2/V3), and ``FusedMoE`` loaded from transformers-saved checkpoints, whole
or split over ranks (features under tensor parallelism, whole experts under expert parallelism)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from paged_backend.distributed import TPGroup
from paged_backend.kernels.fused_moe_ref import fused_moe_ref
from paged_backend.models.moe import (
    FAMILY_EXPERT_LAYOUTS,
    FusedMoE,
    checkpoint_expert_names,
    make_expert_map,
    parse_expert_name,
)
from paged_backend.models.moe_routing import RoutingConfig, select_experts
from paged_backend.models.parallel import LazyTensor, expert_range
from paged_backend.worker.model_loader import materialize

H, INTER = 64, 32
ATTN = {"hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 64}
MLA = {"kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}


# -- fused_moe_ref ------------------------------------------------------------------------------


def _naive_moe(x, w13, w2, weights, ids, on_input: bool = False) -> torch.Tensor:
    """Token by token in float64: every expert on the token, mixed by its dense weight row (0 for
    experts not chosen; an expert's output on a zero input is zero, so on-input weighting works too)."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    gate, up = w13.chunk(2, dim=1)
    rows = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float64).scatter_(1, ids.long(), weights.double())
    out = []
    for token, row in zip(x, rows, strict=True):
        inputs = row[:, None] * token if on_input else token.expand(len(row), -1)  # [E, H]
        h = F.silu(torch.einsum("eih,eh->ei", gate, inputs)) * torch.einsum("eih,eh->ei", up, inputs)
        y = torch.einsum("ehi,ei->eh", w2, h)
        out.append(y.sum(0) if on_input else row @ y)
    return torch.stack(out)


def _moe_inputs(m: int, e: int, k: int, gen: torch.Generator, used: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(m, H, generator=gen)
    w13 = torch.randn(e, 2 * INTER, H, generator=gen) / H**0.5
    w2 = torch.randn(e, H, INTER, generator=gen) / INTER**0.5
    ids = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(m)])  # experts >= used get none
    weights = torch.rand(m, k, generator=gen)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("m", [1, 2, 5, 16, 37])
@pytest.mark.parametrize("on_input", [False, True])
def test_fused_moe_ref_equals_naive_loop(m: int, on_input: bool) -> None:
    """fused_moe_ref (fp32) equals the float64 per-token loop, also with experts that get no token."""
    gen = torch.Generator().manual_seed(m)
    x, w13, w2, weights, ids = _moe_inputs(m, 8, 2, gen, used=5)
    got = fused_moe_ref(x, w13, w2, weights, ids, apply_router_weight_on_input=on_input)
    assert got.dtype == x.dtype and got.shape == (m, H)
    torch.testing.assert_close(got.double(), _naive_moe(x, w13, w2, weights, ids, on_input), atol=1e-5, rtol=1e-5)


def test_fused_moe_ref_float64_and_bf16() -> None:
    """float64 inputs are computed in float64; bf16 inputs return bf16 close to the exact result."""
    gen = torch.Generator().manual_seed(7)
    x, w13, w2, weights, ids = _moe_inputs(9, 8, 2, gen, used=8)
    want = _naive_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe_ref(x.double(), w13.double(), w2.double(), weights, ids), want,
                               atol=1e-12, rtol=1e-12)
    got = fused_moe_ref(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.1, rtol=0.05)


def test_fused_moe_ref_rejects_bad_ids_and_shapes() -> None:
    """Expert ids outside [0, E) and w13/w2 shapes that do not match x raise ValueError."""
    gen = torch.Generator().manual_seed(1)
    x, w13, w2, weights, ids = _moe_inputs(3, 8, 2, gen, used=8)
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        fused_moe_ref(x, w13, w2, weights, ids + 8)
    with pytest.raises(ValueError, match="do not match"):
        fused_moe_ref(x, w13, w2[:, :, :-1], weights, ids)


@pytest.mark.parametrize("on_input", [False, True])
def test_fused_moe_ref_expert_map_computes_only_the_local_experts(on_input: bool) -> None:
    """With an expert_map, one rank's block of whole experts gives the naive loop with every other
    expert's weight 0, and the ranks' outputs sum to the whole layer's; a map pointing past the
    local experts raises ValueError."""
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, weights, ids = _moe_inputs(13, 8, 2, gen, used=8)
    total = torch.zeros_like(x)
    for start, count in ((0, 3), (3, 3), (6, 2)):
        got = fused_moe_ref(x, w13[start:start + count], w2[start:start + count], weights, ids,
                            apply_router_weight_on_input=on_input, expert_map=make_expert_map(8, start, count))
        local = (ids >= start) & (ids < start + count)
        torch.testing.assert_close(got.double(), _naive_moe(x, w13, w2, weights * local, ids, on_input),
                                   atol=1e-5, rtol=1e-5)
        total += got
    whole = fused_moe_ref(x, w13, w2, weights, ids, apply_router_weight_on_input=on_input)
    torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"expert_map values must lie in \[-1, 3\)"):
        fused_moe_ref(x, w13[:3], w2[:3], weights, ids, expert_map=make_expert_map(8, 0, 4))


# -- select_experts against transformers' routers -----------------------------------------------


def _router_case(name: str):
    """(transformers config, its router module) for one routing variant, E 16 unless Mixtral."""
    moe = {"num_experts_per_tok": 4, "moe_intermediate_size": INTER, **ATTN}
    cases = {
        "qwen3_moe": lambda: Qwen3MoeConfig(num_experts=16, norm_topk_prob=False, **moe),
        "qwen3_moe_norm": lambda: Qwen3MoeConfig(num_experts=16, norm_topk_prob=True, **moe),
        "mixtral": lambda: MixtralConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=INTER, **ATTN),
        "glm4_moe": lambda: Glm4MoeConfig(n_routed_experts=16, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                          **moe),
        "glm4_moe_ungrouped": lambda: Glm4MoeConfig(n_routed_experts=16, norm_topk_prob=False, **moe),
        "deepseek_v2_greedy": lambda: DeepseekV2Config(n_routed_experts=16, routed_scaling_factor=1.5, **moe, **MLA),
        "deepseek_v2_group": lambda: DeepseekV2Config(n_routed_experts=16, topk_method="group_limited_greedy",
                                                      n_group=4, topk_group=2, routed_scaling_factor=1.5, **moe,
                                                      **MLA),
        "deepseek_v3": lambda: DeepseekV3Config(n_routed_experts=16, n_group=4, topk_group=2, **moe, **MLA),
    }
    routers = {"qwen3": Qwen3MoeTopKRouter, "mixtral": MixtralTopKRouter, "glm4": Glm4MoeTopkRouter,
               "deepseek_v2": DeepseekV2TopkRouter, "deepseek_v3": DeepseekV3TopkRouter}
    config = cases[name]()
    router_cls = next(cls for prefix, cls in routers.items() if name.startswith(prefix))
    return config, router_cls(config)


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id (selection order is not part of the contract)."""
    ids, order = ids.long().sort(dim=-1)
    return weights.float().gather(1, order), ids


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_norm", "mixtral", "glm4_moe", "glm4_moe_ungrouped",
                                  "deepseek_v2_greedy", "deepseek_v2_group", "deepseek_v3"])
def test_select_experts_matches_transformers_router(name: str) -> None:
    """Same expert sets per row and same weights (atol 1e-6) as the family's transformers router."""
    config, router = _router_case(name)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.5)  # spread logits: no near-ties
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.rand(bias.shape, generator=gen) * 0.1)
        hidden = torch.randn(29, H, generator=gen)
        logits, want_w, want_ids = router(hidden)
    cfg = RoutingConfig.from_hf_config(config.to_dict())
    got_w, got_ids = select_experts(logits, cfg, bias)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert got_ids.shape == (29, cfg.top_k)
    got_w, got_ids = _by_id(got_w, got_ids)
    want_w, want_ids = _by_id(want_w, want_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=0)


def test_routing_config_family_defaults() -> None:
    """Absent keys take each family's defaults; Mixtral always renormalizes; key aliases agree."""
    v3 = RoutingConfig.from_hf_config({"model_type": "deepseek_v3"})
    assert (v3.num_experts, v3.top_k, v3.scoring_func, v3.topk_method, v3.n_group, v3.topk_group,
            v3.routed_scaling_factor, v3.norm_topk_prob) == (256, 8, "sigmoid", "noaux_tc", 8, 4, 2.5, True)
    mixtral = RoutingConfig.from_hf_config({"model_type": "mixtral", "norm_topk_prob": False})
    assert mixtral.norm_topk_prob and (mixtral.num_experts, mixtral.top_k) == (8, 2)
    qwen = RoutingConfig.from_hf_config({"model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 4})
    assert (qwen.num_experts, qwen.norm_topk_prob, qwen.scoring_func) == (16, False, "softmax")
    v2 = RoutingConfig.from_hf_config({"model_type": "deepseek_v2", "n_routed_experts": 64, "num_experts_per_tok": 6,
                                       "n_group": None, "topk_method": "greedy", "scoring_func": "softmax"})
    assert (v2.topk_method, v2.n_group, v2.norm_topk_prob, v2.grouped) == ("greedy", 1, False, False)


@pytest.mark.parametrize(("cfg", "key"), [
    ({"model_type": "deepseek_v2", "n_routed_experts": 8, "num_experts_per_tok": 2,
      "topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 8, "n_group": 2, "topk_group": 3, "num_experts_per_tok": 2},
     "topk_group"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"model_type": "glm4_moe", "n_routed_experts": 8, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     "num_experts_per_tok"),
    ({"model_type": "deepseek_v2", "n_routed_experts": 8}, "num_experts_per_tok"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_local_experts": 16}, "expert counts"),
    ({"model_type": "deepseek_v3", "scoring_func": "tanh"}, "scoring_func"),
    ({"model_type": "deepseek_v3", "topk_method": "random"}, "topk_method"),
    ({"model_type": "deepseek_v3", "n_group": "8"}, "n_group"),
])
def test_routing_config_rejects_bad_switches(cfg: dict, key: str) -> None:
    """An inconsistent or invalid routing key raises a ValueError that names it."""
    with pytest.raises(ValueError, match=key):
        RoutingConfig.from_hf_config(cfg)


# -- FusedMoE from transformers-saved checkpoints ----------------------------------------------

FAMILIES = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": INTER, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": INTER},
    "glm4_moe": {"n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": INTER,
                 "intermediate_size": 2 * INTER, "first_k_dense_replace": 0, "n_group": 2, "topk_group": 1,
                 "routed_scaling_factor": 2.5},
}


def _save_tiny(model_type: str, path: Path, original_format: bool):
    """A seeded one-layer model of the family with spread router weights, saved to ``path``."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **ATTN, **FAMILIES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.5)
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.uniform_(0.0, 0.1)
    model.save_pretrained(path, save_original_format=original_format)
    return config, block


def _load_fused_moe(model_type: str, path: Path, config, tp: TPGroup | None = None) -> tuple[FusedMoE, torch.Tensor]:
    """A meta-built, materialized FusedMoE loaded through its weight loaders; also the router weight."""
    routing = RoutingConfig.from_hf_config(config.to_dict())
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    with torch.device("meta"):
        moe = FusedMoE(routing, H, inter, torch.float32, tp=tp)
    materialize(moe, torch.device("cpu"))
    moe.init_buffers()
    router, loaded = None, set()
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        for name in f.keys():
            tensor = LazyTensor(f.get_slice(name))
            if name.endswith(".gate.weight"):
                router = tensor.full()
            elif name.endswith("gate.e_score_correction_bias"):
                moe.e_score_correction_bias.weight_loader(moe.e_score_correction_bias, tensor)
                loaded.add(name)
            for style in FAMILY_EXPERT_LAYOUTS[model_type]:
                hit = moe.parse_expert_name(name, "model.layers.0", style)
                if hit is not None:
                    param = getattr(moe, hit[0])
                    param.weight_loader(param, tensor, hit[1])
                    loaded.add(name)
    assert loaded and router is not None
    return moe, router


@pytest.mark.parametrize("original_format", [True, False], ids=["per_expert", "stacked"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_fused_moe_equals_transformers_block(model_type: str, original_format: bool, tmp_path: Path) -> None:
    """FusedMoE loaded from a transformers-saved checkpoint equals transformers' routed experts in fp32."""
    config, block = _save_tiny(model_type, tmp_path, original_format)
    moe, router = _load_fused_moe(model_type, tmp_path, config)
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        want = block.experts(x, ids, weights)  # routed part only (GLM's shared experts are outside)
        got = moe(x, F.linear(x, router))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_checkpoint_names_cover_every_saved_expert_tensor(tmp_path: Path) -> None:
    """checkpoint_expert_names lists exactly the expert tensors transformers writes, per layout."""
    for original_format, style in ((True, "w1_w3_w2"), (False, "stacked")):
        _save_tiny("mixtral", tmp_path / style, original_format)
        with safe_open(str(next((tmp_path / style).glob("*.safetensors"))), "pt") as f:
            saved = {n for n in f.keys() if ".experts." in n}
        names = {name for name, _, _ in checkpoint_expert_names("model.layers.0", 8, style)}
        assert names == saved


# -- tensor parallelism (slicing only, no processes) ---------------------------------------------


class _FakeTP(TPGroup):
    """A TPGroup whose all-reduce is the identity (one rank's partial sum, to be summed by the test)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("original_format", [True, False], ids=["per_expert", "stacked"])
def test_tp_slices_reconstruct_the_full_stack(original_format: bool, tmp_path: Path) -> None:
    """Two ranks' w13 gate/up rows and w2 columns concatenate to the tp=None stacks; partials sum to it."""
    config, _ = _save_tiny("qwen3_moe", tmp_path, original_format)
    full, router = _load_fused_moe("qwen3_moe", tmp_path, config)
    ranks = [_load_fused_moe("qwen3_moe", tmp_path, config, _FakeTP(r, 2, torch.device("cpu")))[0] for r in (0, 1)]
    half = INTER // 2
    assert all(r.w13.shape == (8, 2 * half, H) and r.w2.shape == (8, H, half) for r in ranks)
    gates = torch.cat([r.w13[:, :half] for r in ranks], dim=1)
    ups = torch.cat([r.w13[:, half:] for r in ranks], dim=1)
    assert torch.equal(torch.cat([gates, ups], dim=1), full.w13)
    assert torch.equal(torch.cat([r.w2 for r in ranks], dim=2), full.w2)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(2))
    logits = F.linear(x, router)
    torch.testing.assert_close(sum(r(x, logits) for r in ranks), full(x, logits), atol=1e-5, rtol=1e-5)


def test_tp_refuses_an_indivisible_intermediate_size() -> None:
    """moe_intermediate_size not divisible by the TP size raises ValueError naming it."""
    routing = RoutingConfig(num_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        FusedMoE(routing, H, 30, torch.float32, tp=_FakeTP(0, 4, torch.device("cpu")))


# -- expert parallelism (placement and loading only, no processes) --------------------------------

CPU = torch.device("cpu")


def test_expert_placement_is_contiguous_blocks_with_the_remainder_first() -> None:
    """Rank r holds experts [start, start + count): E // N each, one more on the first E % N ranks;
    expert_map sends the global ids of its experts to 0..count-1 and every other id to -1."""
    def ranges(e: int, n: int) -> list[tuple[int, int]]:
        return [expert_range(e, _FakeTP(r, n, CPU, expert_parallel=True)) for r in range(n)]

    assert ranges(8, 2) == [(0, 4), (4, 4)]
    assert ranges(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert ranges(8, 3) == [(0, 3), (3, 3), (6, 2)]
    assert ranges(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert expert_range(8, None) == (0, 8)
    assert make_expert_map(8, 4, 4).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert make_expert_map(10, 3, 3).tolist() == [-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]
    assert make_expert_map(8, 0, 4).dtype == torch.int32
    routing = RoutingConfig(num_experts=10, num_experts_per_tok=2)
    with torch.device("meta"):  # as the model loader builds it: the map is filled after materialize
        moe = FusedMoE(routing, H, INTER, torch.float32, tp=_FakeTP(1, 4, CPU, expert_parallel=True))
    materialize(moe, CPU)
    moe.init_buffers()
    assert (moe.expert_start, moe.num_local_experts) == (3, 3)
    assert moe.expert_map.tolist() == [-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]
    assert moe.w13.shape == (3, 2 * INTER, H) and moe.w2.shape == (3, H, INTER)
    assert FusedMoE(routing, H, INTER, torch.float32, tp=_FakeTP(1, 4, CPU)).expert_map is None  # plain TP


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("original_format", [True, False], ids=["per_expert", "stacked"])
def test_ep_ranks_hold_their_experts_whole_and_sum_to_the_layer(ranks: int, original_format: bool,
                                                                tmp_path: Path) -> None:
    """Under expert parallelism rank r holds only its block of experts, every feature of each (w13
    [E_r, 2I, H], w2 [E_r, H, I]: those rows of the tp=None stacks; 8 experts over 2 ranks: 4 + 4,
    over 3: 3 + 3 + 2); the ranks' partial outputs sum to the whole layer's."""
    config, _ = _save_tiny("qwen3_moe", tmp_path, original_format)
    full, router = _load_fused_moe("qwen3_moe", tmp_path, config)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(2))
    logits = F.linear(x, router)
    total, start = torch.zeros_like(x), 0
    for r in range(ranks):
        moe = _load_fused_moe("qwen3_moe", tmp_path, config, _FakeTP(r, ranks, CPU, expert_parallel=True))[0]
        count = 8 // ranks + (r < 8 % ranks)
        assert moe.w13.shape == (count, 2 * INTER, H) and moe.w2.shape == (count, H, INTER)
        assert torch.equal(moe.w13, full.w13[start:start + count]) and torch.equal(moe.w2, full.w2[start:start + count])
        total += moe(x, logits)
        start += count
    assert start == 8
    torch.testing.assert_close(total, full(x, logits), atol=1e-5, rtol=1e-5)


class _Unreadable:
    """A safetensors slice whose shape is known but whose every read fails."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index):
        raise AssertionError("an expert of another rank was read")


def test_ep_loader_reads_nothing_of_another_ranks_experts_but_checks_their_shapes() -> None:
    """Rank 0 of 2 skips experts 4..7 without reading them; a bad shape there, or a stack over the
    wrong number of experts, still raises ValueError."""
    moe = FusedMoE(RoutingConfig(num_experts=8, num_experts_per_tok=2), H, INTER, torch.float32,
                   tp=_FakeTP(0, 2, CPU, expert_parallel=True))
    moe.w13.weight_loader(moe.w13, LazyTensor(_Unreadable(INTER, H)), ("gate", 5))
    moe.w13.weight_loader(moe.w13, LazyTensor(_Unreadable(INTER, H)), ("up", 4))
    moe.w2.weight_loader(moe.w2, LazyTensor(_Unreadable(H, INTER)), ("down", 7))
    with pytest.raises(ValueError, match=r"shape mismatch.*\('down', 7\) expects \(64, 32\)"):
        moe.w2.weight_loader(moe.w2, LazyTensor(_Unreadable(H + 1, INTER)), ("down", 7))
    with pytest.raises(ValueError, match="shape mismatch"):
        moe.w13.weight_loader(moe.w13, LazyTensor(_Unreadable(INTER + 1, H)), ("gate", 6))
    with pytest.raises(ValueError, match="expects 8 experts in dim 0"):
        moe.w13.weight_loader(moe.w13, torch.zeros(9, 2 * INTER, H), ("gate_up", None))
    with pytest.raises(ValueError, match="expects 8 experts in dim 0"):
        moe.w2.weight_loader(moe.w2, torch.zeros(7, H, INTER), ("down", None))
    moe.w13.weight_loader(moe.w13, torch.ones(INTER, H), ("gate", 3))  # its own expert: written
    assert (moe.w13[3, :INTER] == 1).all()


# -- bad checkpoint tensors ----------------------------------------------------------------------


def test_expert_id_out_of_range_names_the_tensor() -> None:
    """A checkpoint expert index >= E raises ValueError naming the tensor; unrelated names give None."""
    name = "model.layers.0.mlp.experts.8.gate_proj.weight"
    with pytest.raises(ValueError, match=rf"{name}.*out of range"):
        parse_expert_name(name, "model.layers.0", 8, "gate_up_down")
    assert parse_expert_name("model.layers.0.mlp.gate.weight", "model.layers.0", 8, "gate_up_down") is None
    assert parse_expert_name("model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.0", 8,
                             "gate_up_down") is None
    assert parse_expert_name("model.layers.0.block_sparse_moe.experts.7.w3.weight", "model.layers.0", 8,
                             "w1_w3_w2") == ("w13", ("up", 7))


def test_weight_loader_rejects_bad_shards_and_shapes() -> None:
    """Wrong shapes, unknown projections, out-of-range experts and w13/w2 mix-ups raise ValueError."""
    moe = FusedMoE(RoutingConfig(num_experts=8, num_experts_per_tok=2), H, INTER, torch.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        moe.w13.weight_loader(moe.w13, torch.zeros(INTER + 1, H), ("gate", 0))
    with pytest.raises(ValueError, match="shape mismatch"):
        moe.w2.weight_loader(moe.w2, torch.zeros(H + 1, INTER), ("down", 0))
    with pytest.raises(ValueError, match="unknown expert projection"):
        moe.w13.weight_loader(moe.w13, torch.zeros(INTER, H), ("w1", 0))
    with pytest.raises(ValueError, match="out of range"):
        moe.w13.weight_loader(moe.w13, torch.zeros(INTER, H), ("gate", 8))
    with pytest.raises(ValueError, match="does not belong"):
        moe.w2.weight_loader(moe.w2, torch.zeros(INTER, H), ("gate", 0))
    with pytest.raises(ValueError, match="shard id"):
        moe.w13.weight_loader(moe.w13, torch.zeros(INTER, H))
