"""The dense GLM-4 families end to end: tiny random GlmForCausalLM (glm-4-9b-chat-hf) and
Glm4ForCausalLM (GLM-4-0414) checkpoints saved by transformers itself. ModelInfo reads their partial
interleaved rotary, biases and norms; the reference rotary is transformers' GLM rotary bit for bit; the
engine's greedy tokens equal transformers' ``generate`` in fp32, whatever the batching, chunking,
prefix caching, preemption or tensor parallelism; bad fused gate|up tensors fail at load by name."""

from __future__ import annotations

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
    tiny_llm,
)
from model_fixtures import make_variant

from paged_backend.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_ref
from paged_backend.models.model_info import ModelInfo

pytestmark = pytest.mark.slow

FAMILIES = ("glm-head-dim", "glm4-sublayer-norms")  # model_fixtures.TINY_VARIANTS
GATE_UP = "model.layers.1.mlp.gate_up_proj.weight"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    path = make_variant(tmp_path_factory.mktemp("glm"), request.param)
    return path, hf_greedy(path)


def test_model_info_reads_the_glm_layout(family) -> None:
    """Half of each head rotated in interleaved pairs, q/k/v bias without o_proj bias, gate|up fused in
    the checkpoint; the sublayer-output norms only for GLM-4-0414."""
    path, _ = family
    info = ModelInfo.from_dir(path)
    glm4 = info.architecture == "Glm4ForCausalLM"
    assert (info.head_dim, info.rope_dim) == ((16, 8) if glm4 else (24, 12))
    assert info.rope_interleaved and info.fused_gate_up_checkpoint and info.sublayer_output_norms == glm4
    assert info.attention_bias and not info.o_proj_bias and not info.qk_norm and info.rope_scaling is None


def test_model_info_reads_a_hub_style_config() -> None:
    """glm-4-9b-chat-hf's config.json as the hub has it (transformers 4 keys: top-level rope_theta and
    partial_rotary_factor); without the factor, transformers' default 0.5; the model type alone names it."""
    cfg = dict(architectures=["GlmForCausalLM"], model_type="glm", hidden_size=4096, intermediate_size=13696,
               num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
               vocab_size=151552, partial_rotary_factor=0.5, rope_theta=10000.0, attention_bias=True,
               eos_token_id=[151329, 151336, 151338])
    info = ModelInfo.from_config(cfg)
    assert (info.rope_dim, info.rope_theta, info.num_kv_heads, info.eos_token_ids) == (64, 10000.0, 2,
                                                                                      (151329, 151336, 151338))
    assert info.attention_bias and not info.o_proj_bias and info.rope_interleaved
    del cfg["partial_rotary_factor"], cfg["architectures"], cfg["attention_bias"]
    info = ModelInfo.from_config({**cfg, "model_type": "glm4"})
    assert info.architecture == "Glm4ForCausalLM" and info.rope_dim == 64 and info.attention_bias
    assert info.sublayer_output_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_rotary_is_transformers_glm_rotary(dtype) -> None:
    """rotary_ref(interleaved=True) with a half-width table equals transformers' GLM
    ``apply_rotary_pos_emb`` (its own cos/sin) bit for bit, passed-through dims included."""
    from transformers import GlmConfig
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding, apply_rotary_pos_emb

    config = GlmConfig(hidden_size=96, num_attention_heads=4, head_dim=24, max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn((9, 4, 24), generator=g).to(dtype)
    k = torch.randn((9, 2, 24), generator=g).to(dtype)
    pos = torch.tensor([0, 1, 2, 7, 8, 30, 31, 62, 63])
    cos, sin = GlmRotaryEmbedding(config)(q, pos[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    table = rope_cos_sin_cache(rope_inv_freq(12, 10000.0), 64)
    ours_q, ours_k = rotary_ref(pos, q, k, table, interleaved=True)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1)) and torch.equal(ours_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("kw", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_greedy_equals_transformers(family, kw) -> None:
    """Greedy tokens equal transformers' generate token for token, batched, alone or chunked."""
    check_greedy_equals_transformers(*family, **kw)


def test_prefix_cache_preemption_and_tensor_parallel_keep_the_tokens(family) -> None:
    """Served again from the prefix cache, preempted in a tiny cache, and split over 2 ranks (each reads
    its rows of the gate half and of the up half of the fused tensor): still transformers' tokens."""
    check_prefix_cache_and_preemption(*family)
    check_tensor_parallel_2(*family)


def test_a_missing_gate_up_proj_fails_at_load_naming_it(family, tmp_path) -> None:
    """A checkpoint without one layer's fused gate|up tensor is refused, that tensor named (not the
    gate_proj / up_proj names of the Llama layout)."""
    path, _ = family
    bad = rewrite_checkpoint(path, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != GATE_UP})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model\.layers\.1\.mlp\.gate_up_proj\.weight'\]"):
        tiny_llm(bad)


def test_a_misshapen_gate_up_proj_fails_at_load_naming_it(family, tmp_path) -> None:
    """A fused gate|up tensor of the wrong row count is refused naming it: odd (no halves), or halves
    that are not the intermediate size."""
    path, _ = family
    for rows, match in ((257, "even number of rows, got 257"), (258, r"checkpoint has \(129, 64\)")):
        bad = rewrite_checkpoint(path, tmp_path / f"bad{rows}", lambda t, n=rows: {**t, GATE_UP: torch.zeros(n, 64)})
        with pytest.raises(ValueError, match=rf"tensor '{GATE_UP}': .*{match}"):
            tiny_llm(bad)


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}], ids=["batched", "chunked"])
def test_cuda_triton_kernels_equal_transformers(family, kw) -> None:
    """The interleaved partial rotary and the other kernels compiled on the GPU keep the tokens."""
    check_cuda_triton_greedy(*family, **kw)
