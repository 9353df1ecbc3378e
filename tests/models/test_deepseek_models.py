"""DeepSeek-V2, DeepSeek-V3 and GLM-4.7-Flash (Glm4MoeLiteForCausalLM) end to end: tiny random checkpoints saved by transformers itself, multi-head latent
attention over the paged latent cache (``models/mla.py``), YaRN rotary with its mscale corrections, routed and
shared experts after a dense first layer; the engine's greedy tokens equal transformers' ``generate`` in fp32
whatever the batching, chunking, prefix caching, preemption or tensor parallelism."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from family_fixtures import (
    NEW,
    PROMPTS,
    SCHEDULES,
    check_greedy_equals_transformers,
    check_prefix_cache_and_preemption,
    check_tensor_parallel_2,
    greedy_tokens,
    hf_greedy,
    scale_routers,
    tiny_llm,
)
from fp8_reference import FollowsTransformers, fake_quant_hf
from model_fixtures import make_tiny_checkpoint
from quant_fixtures import fp8_moe_quant_config, quantize_fp8_weight, write_quantized_pair
from safetensors.torch import load_file, save_file
from smollm2 import assert_no_leak

from paged_backend import SamplingParams
from paged_backend.kernels.mla_attention_ref import mla_attention_ref, write_latent_cache_ref
from paged_backend.kernels.rotary_ref import yarn_mscale
from paged_backend.models.mla import MLAAttention
from paged_backend.models.model_info import ModelInfo

pytestmark = pytest.mark.slow

YARN = dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1,
            original_max_position_embeddings=128, rope_theta=10000.0)
MLA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
           intermediate_size=96, rope_parameters=YARN)
FAMILIES = {
    # V2-Lite's layout: no q compression, softmax greedy top-k without renormalisation
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(MLA, q_lora_rank=None, topk_method="greedy", n_group=1,
                                                  topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    # V2's grouped routing
    "deepseek_v2_grouped": ("DeepseekV2ForCausalLM", dict(MLA, q_lora_rank=None, topk_method="group_limited_greedy",
                                                          n_group=2, topk_group=1, norm_topk_prob=False,
                                                          routed_scaling_factor=1.5)),
    # V3: a low-rank q through q_a_layernorm, sigmoid noaux_tc routing over 2 groups, renormalised and scaled
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(MLA, q_lora_rank=24, n_group=2, topk_group=1,
                                                  routed_scaling_factor=2.5, norm_topk_prob=True)),
    # GLM-4.7-Flash: V3's layout, dense / sparse layers from mlp_layer_types
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", dict(MLA, q_lora_rank=24, n_group=2, topk_group=1,
                                                     routed_scaling_factor=1.8, norm_topk_prob=True,
                                                     mlp_layer_types=["dense", "sparse", "sparse"])),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    arch, overrides = FAMILIES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    scale_routers(path)
    return path, hf_greedy(path)


def test_model_info_reads_the_latent_attention(family) -> None:
    path, _ = family
    cfg = json.loads((path / "config.json").read_text())
    info = ModelInfo.from_dir(path)
    mla = info.mla
    assert mla is not None and (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        32, 16, 8, 16)
    assert mla.q_lora_rank == cfg.get("q_lora_rank") and mla.latent_dim == 40
    assert info.head_dim == 24 and info.rope_dim == 8 and info.rope_interleaved
    assert info.rope_scaling["rope_type"] == "yarn" and info.rope_scaling["factor"] == 4.0
    assert math.isclose(mla.softmax_scale, 24**-0.5 * yarn_mscale(4.0, 0.8) ** 2)
    assert info.moe_layers == (False, True, True) and info.shared_expert_intermediate_size == 32


def test_the_cache_holds_one_latent_per_token(family) -> None:
    """Every layer's cache is [blocks, block_size, 40]: the 32-wide latent and the 8-wide rotary key, ~1/10 of a
    4-head K/V cache of 24-wide heads (2 * 4 * 24 = 192 values a token)."""
    path, _ = family
    llm = tiny_llm(path)
    runner = llm.engine.runner
    assert all(s.is_latent and s.latent_dim == 40 and s.values_per_token == 40 for s in runner.kv_specs)
    assert all(c.shape[1:] == (runner.block_size, 40) for c in runner.kv_caches)
    assert isinstance(runner.model.model.layers[0].self_attn, MLAAttention)


@pytest.mark.parametrize("kw", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_greedy_equals_transformers(family, kw) -> None:
    check_greedy_equals_transformers(*family, **kw)


def test_prefix_cache_and_preemption_keep_the_tokens(family) -> None:
    check_prefix_cache_and_preemption(*family)


def test_an_abort_frees_the_latent_blocks_at_once(family) -> None:
    path, _ = family
    eng = tiny_llm(path).engine
    total = eng.kv.block_pool.num_total_usable
    eng.add_request("a", PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv.num_free_blocks < total and eng.kv.num_blocks_of("a") > 0
    assert eng.abort_request("a").outputs[0].finish_reason == "abort"
    assert eng.kv.num_blocks_of("a") == 0
    while eng.has_unfinished_requests():
        eng.step()
    assert_no_leak(eng)


def test_mtp_layers_after_the_decoder_are_skipped(tmp_path) -> None:
    """DeepSeek-V3's multi-token-prediction layer (num_nextn_predict_layers: 1) is stored as layer L; the engine
    loads the L decoder layers and leaves it (it serves speculative decoding), with the same tokens."""
    arch, overrides = FAMILIES["deepseek_v3"]
    path = make_tiny_checkpoint(tmp_path / "v3", arch, **overrides)
    scale_routers(path)
    expected = hf_greedy(path)
    tensors = load_file(path / "model.safetensors")
    last = "model.layers.2."
    mtp = {"model.layers.3." + n.removeprefix(last): t.clone() for n, t in tensors.items() if n.startswith(last)}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    assert ModelInfo.from_dir(path).num_mtp_layers == 1
    assert greedy_tokens(tiny_llm(path)) == expected


def test_tensor_parallel_2_equals_1(family) -> None:
    """Two heads per rank (q / kv_b column-parallel, o row-parallel), the latent cache whole on both ranks."""
    check_tensor_parallel_2(*family)


# -- the latent attention reference -------------------------------------------------------------------------


def _decompressed(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    """transformers' form for one causal sequence: per head k = [W_UK c | k_pe], v = W_UV c, float64."""
    k_nope = torch.einsum("hnl,tl->thn", w_uk, c)
    v = torch.einsum("hvl,tl->thv", w_uv, c)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, w_uk.shape[0], -1)], -1)
    q = torch.cat([q_nope, q_pe], -1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khv->qhv", scores.softmax(-1), v)


def test_absorbed_attention_over_the_paged_latents_equals_the_decompressed_form() -> None:
    """Two requests in scattered blocks (one a prefill chunk after 5 cached tokens, one decoding): the absorbed
    query against the cached latents, then W_UV, equals attention over the decompressed per-head K and V."""
    gen = torch.Generator().manual_seed(0)
    h, nope, rope, lora, v_dim, bs = 3, 8, 4, 16, 8, 4
    w_uk = torch.randn(h, nope, lora, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(h, v_dim, lora, generator=gen, dtype=torch.float64)
    lens, new = [9, 6], [4, 1]
    tables = torch.tensor([[7, 2, 5], [3, 1, 0]], dtype=torch.int32)
    cache = torch.full((8, bs, lora + rope), float("nan"), dtype=torch.float64)
    seqs = []
    for i, n in enumerate(lens):
        c = torch.randn(n, lora, generator=gen, dtype=torch.float64)
        k_pe = torch.randn(n, rope, generator=gen, dtype=torch.float64)
        slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(n)])
        write_latent_cache_ref(torch.cat([c, k_pe], -1), cache, slots)
        q_nope = torch.randn(n, h, nope, generator=gen, dtype=torch.float64)
        q_pe = torch.randn(n, h, rope, generator=gen, dtype=torch.float64)
        seqs.append((c, k_pe, q_nope, q_pe))
    rows = [torch.cat([torch.einsum("thn,hnl->thl", qn, w_uk), qp], -1)[-k:] for (_, _, qn, qp), k in
            zip(seqs, new, strict=True)]
    out = mla_attention_ref(torch.cat(rows), cache, tables, torch.tensor(lens, dtype=torch.int32),
                            torch.tensor([0, 4, 5], dtype=torch.int32), 0.3, lora)
    got = torch.einsum("thl,hvl->thv", out, w_uv)
    want = torch.cat([_decompressed(qn, qp, c, kp, w_uk, w_uv, 0.3)[-k:] for (c, kp, qn, qp), k in
                      zip(seqs, new, strict=True)])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)  # the reference computes in float32


def test_an_fp8_latent_cache_stores_the_scaled_values() -> None:
    from paged_backend.kernels.fp8_types import FP8_DTYPE

    latent = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))
    cache = torch.zeros(2, 4, 12, dtype=FP8_DTYPE)
    scale = torch.tensor(0.01)
    write_latent_cache_ref(latent, cache, torch.tensor([0, 1, -1, 5, 6]), scale)
    flat = cache.view(-1, 12).float() * scale
    keep = [0, 1, 3, 4]
    assert torch.allclose(flat[[0, 1, 5, 6]], latent[keep], rtol=0.07, atol=1e-3)
    assert torch.equal(flat[2], torch.zeros(12))  # the -1 slot wrote nothing


# -- DeepSeek-V3's FP8 checkpoint format ---------------------------------------------------------------------

FP8_BLOCK = (16, 16)  # the tiny model's dims are 16-multiples (DeepSeek-V3 ships 128 x 128)
_MLA_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                         r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory) -> tuple[Path, FollowsTransformers]:
    """DeepSeek-V3 with every attention, MLP and expert linear block-wise e4m3 (``weight_scale_inv`` per 16 x 16
    block, dynamic activations per token and 16 inputs), routers and norms dense; the expected tokens from
    transformers on the dequantized weights with every quantized linear's input fake-quantized, except
    kv_b_proj's: the engine folds kv_b_proj into the query and the output (absorption), so the latent it would
    read is never quantized."""
    arch, overrides = FAMILIES["deepseek_v3"]
    root = tmp_path_factory.mktemp("deepseek_v3-fp8")
    dense = make_tiny_checkpoint(root / "dense", arch, **overrides)
    scale_routers(dense)
    out, deq, hooked = {}, {}, set()
    for name, t in load_file(dense / "model.safetensors").items():
        if _MLA_LINEAR.match(name):
            q, scale, w = quantize_fp8_weight(t, "block", FP8_BLOCK)
            out[name], out[name.replace(".weight", ".weight_scale_inv")], deq[name] = q, scale, w
            if ".kv_b_proj." not in name:
                hooked.add(name.removesuffix(".weight"))
        else:
            out[name] = deq[name] = t
    write_quantized_pair(dense, root / "fp8", root / "deq", out, deq, fp8_moe_quant_config("block", 3, FP8_BLOCK))
    hf = fake_quant_hf(root / "deq", hooked, "block", FP8_BLOCK[1])
    hf.generation_config.use_cache = False  # full recompute: its tokens are its teacher-forced argmax
    return root / "fp8", FollowsTransformers(hf_greedy(root / "deq", hf), hf)


def test_fp8_kv_b_proj_is_absorbed_from_its_dequantized_weight(fp8_v3) -> None:
    path, _ = fp8_v3
    llm = tiny_llm(path)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    assert attn.kv_b_proj.linear_method is not None and attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn
    w_uk, _ = attn._absorbed(torch.float32)
    raw = load_file(path / "model.safetensors")
    q, s = raw["model.layers.1.self_attn.kv_b_proj.weight"], raw["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    full = q.float() * s.repeat_interleave(16, 0)[: q.shape[0]].repeat_interleave(16, 1)[:, : q.shape[1]]
    assert torch.equal(w_uk, full.view(4, 32, 32)[:, :16])


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}], ids=["batched", "chunked"])
def test_fp8_greedy_follows_transformers(fp8_v3, kw) -> None:
    """Up to e4m3 rounding flips (``FollowsTransformers``), batched or in prefill chunks."""
    check_greedy_equals_transformers(*fp8_v3, **kw)


def test_fp8_prefix_cache_and_preemption_keep_the_tokens(fp8_v3) -> None:
    check_prefix_cache_and_preemption(*fp8_v3)


# -- parallel samples, beam search and the fp8 latent cache ---------------------------------------------------


def test_n2_greedy_copies_and_beam_search_equal_transformers(family) -> None:
    """n = 2 greedy copies (forked latent blocks) both give transformers' tokens; beam search of width 3 gives
    transformers' best beam (EOS ignored on both sides)."""
    from transformers import AutoModelForCausalLM

    path, expected = family
    llm = tiny_llm(path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0, n=2, ignore_eos=True),
                        use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    beam = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], beam, use_tqdm=False), strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               num_beams=3, early_stopping=False, pad_token_id=0, eos_token_id=None)
        assert out.outputs[0].token_ids == want[0, len(prompt):].tolist()
    assert_no_leak(llm.engine)


def test_an_fp8_latent_cache_attends_within_e4m3_error() -> None:
    """The same step over an e4m3 latent cache (scale from the largest value) and a float32 one: the outputs
    differ by e4m3's rounding (3 mantissa bits: ~2^-5 relative a value), far less than they are apart."""
    from model_fixtures import make_meta

    from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX
    from paged_backend.kernels.mla_attention_ref import mla_forward_ref

    gen = torch.Generator().manual_seed(2)
    meta, _ = make_meta([(0, 9, [3, 1, 4]), (0, 5, [2, 5])], block_size=4)
    latent = torch.randn(14, 40, generator=gen)
    q = torch.randn(14, 4, 40, generator=gen)
    scale = latent.abs().amax() / FP8_MAX
    outs = {}
    for dtype in (torch.float32, FP8_DTYPE):
        cache = torch.zeros(6, 4, 40, dtype=dtype)
        outs[dtype] = mla_forward_ref(q, latent, cache, meta, 0.2, 32, scale)
    err = (outs[FP8_DTYPE] - outs[torch.float32]).norm() / outs[torch.float32].norm()
    assert 1e-4 < float(err) < 0.05, float(err)


def test_the_engine_runs_an_fp8_latent_cache(family) -> None:
    """``kv_cache_dtype="fp8"``: e4m3 latents with each layer's scale calibrated on the first batch."""
    path, expected = family
    llm = tiny_llm(path, kv_cache_dtype="fp8", calculate_kv_scales=True)
    runner = llm.engine.runner
    assert all(s.dtype == torch.float8_e4m3fn and s.is_latent for s in runner.kv_specs)
    tokens = greedy_tokens(llm)
    assert [len(t) for t in tokens] == [NEW] * len(PROMPTS)
    scales = [float(m.k_scale) for m in runner.model.modules() if isinstance(m, MLAAttention)]
    assert all(s != 1.0 for s in scales)  # calibrated from the first batch
    # e4m3 latents move these tiny random models' later logits past near-ties; the first tokens mostly hold (a
    # scale applied wrongly moves every logit: test_an_fp8_latent_cache_attends_within_e4m3_error bounds the step)
    assert sum(t[0] == e[0] for t, e in zip(tokens, expected, strict=True)) >= len(PROMPTS) // 2
    assert_no_leak(llm.engine)


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}], ids=["batched", "chunked"])
def test_cuda_triton_kernels_equal_transformers(tmp_path, kw) -> None:
    """On the GPU in fp32: the latent-attention kernels (a 16-wide rotary key, so the kernel takes the dims),
    the fused-MoE, rotary and norm kernels."""
    from family_fixtures import check_cuda_triton_greedy

    arch, overrides = FAMILIES["deepseek_v3"]
    path = make_tiny_checkpoint(tmp_path / "v3", arch, **{**overrides, "qk_rope_head_dim": 16, "head_dim": 16})
    scale_routers(path)
    check_cuda_triton_greedy(path, hf_greedy(path), **kw)
