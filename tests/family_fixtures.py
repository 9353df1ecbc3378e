"""End-to-end checks of a model family on a tiny random checkpoint (``model_fixtures``): the engine's
greedy tokens against transformers' ``generate`` in fp32, whatever the batching, chunking, prefix
caching, preemption or tensor parallelism; and checkpoints rewritten to be bad.

The tokenizer is SmolLM2's (the prompts are token ids; it only detokenizes). Import from tests as
``family_fixtures`` (pyproject's pytest ``pythonpath`` has ``tests``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from model_fixtures import hf_model
from safetensors.torch import load_file, save_file
from smollm2 import assert_no_leak, model_dir

from paged_backend import LLM, SamplingParams

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 4, 9, 100, 21], [7, 8, 9], list(range(30, 75)), [5, 17, 33, 4, 9, 100, 21, 60, 61, 62, 63,
                                                                        64, 65, 66, 67, 68, 69, 70]]
# engine limits that schedule the prompts differently: all in one batch, one at a time, prefills in chunks
SCHEDULES = {"batched": {}, "one-at-a-time": {"max_num_seqs": 1}, "chunked": {"max_num_batched_tokens": 16}}


def hf_greedy(path: Path, hf=None) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time (fp32, eager attention;
    ``hf``: that model instead of the one at ``path``)."""
    hf = hf_model(path) if hf is None else hf
    out = []
    for ids in PROMPTS:
        tokens = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out.append(tokens[0, len(ids):].tolist())
    return out


def tiny_llm(path: Path, **kw) -> LLM:
    args = dict(model=str(path), tokenizer=model_dir(), dtype="float32", device="cpu",
                kv_cache_memory_bytes=4 << 20, log_stats_interval=0, seed=0)
    return LLM(**{**args, **kw})


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def check_greedy_equals_transformers(path: Path, expected: list[list[int]], **kw) -> None:
    """Greedy tokens under engine limits ``kw`` equal ``expected``, and every block is freed after."""
    llm = tiny_llm(path, **kw)
    assert greedy_tokens(llm) == expected
    assert_no_leak(llm.engine)


def check_prefix_cache_and_preemption(path: Path, expected: list[list[int]]) -> None:
    """A second pass served from the prefix cache, and a cache so small that requests are preempted,
    give ``expected``."""
    llm = tiny_llm(path)
    assert greedy_tokens(llm) == expected
    hits = llm.engine.get_stats()["prefix_cache_hits"]
    assert greedy_tokens(llm) == expected and llm.engine.get_stats()["prefix_cache_hits"] > hits
    small = tiny_llm(path, kv_cache_memory_bytes=None, num_gpu_blocks_override=6)
    assert greedy_tokens(small) == expected
    assert small.engine.stats.num_preemptions_total > 0
    assert_no_leak(small.engine)


def check_tensor_parallel_2(path: Path, expected: list[list[int]], **kw) -> LLM:
    """Split over 2 ranks (gloo on the CPU; engine options ``kw``), the greedy tokens are still
    ``expected``; returns the engine, shut down (rank 0's model stays readable)."""
    llm = tiny_llm(path, tensor_parallel_size=2, kv_cache_memory_bytes=1 << 20, **kw)
    try:
        assert greedy_tokens(llm) == expected
    finally:
        llm.engine.shutdown()
    return llm


def check_cuda_triton_greedy(path: Path, expected: list[list[int]], **kw) -> None:
    """On the GPU in fp32 (Triton kernels, CUDA graphs for decode) the greedy tokens are ``expected``
    too; token-id prompts only, so no tokenizer is loaded."""
    llm = LLM(model=str(path), dtype="float32", device="cuda", kv_cache_memory_bytes=16 << 20,
              skip_tokenizer_init=True, log_stats_interval=0, seed=0, **kw)
    try:
        assert llm.engine.runner.attn_backend.name == "triton"
        assert greedy_tokens(llm) == expected
        assert_no_leak(llm.engine)
    finally:
        llm.engine.shutdown()


def scale_routers(path: Path, factor: float = 8.0) -> None:
    """Routers' weights scaled up, so no routing decision of the test prompts is a near-tie; a random
    routing-correction bias where the router has one (saved as zeros)."""
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(".gate.weight"):
            tensors[name] = t * factor
        if name.endswith(".gate.e_score_correction_bias"):
            tensors[name] = 0.5 * torch.randn(t.shape, generator=gen)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def rewrite_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
                       ) -> Path:
    """A copy of the one-file checkpoint ``src`` at ``dst`` whose tensors are ``edit(tensors)``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# tiny MoE families whose every linear splits into whole 128-blocks (fp8) and 64-groups (int4), also over two
# ranks: q/k/v 256 rows each, every intermediate 256; routers scaled (``scale_routers``)
QUANT_MOE_SHAPES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                        intermediate_size=256, moe_intermediate_size=256)
QUANT_MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                              mlp_only_layers=[0], num_hidden_layers=3)),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                            routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
                                            partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True)),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
}


def make_quant_moe_families(tmp_path_factory) -> dict[str, Path]:
    """One dense tiny checkpoint of each ``QUANT_MOE_FAMILIES`` family, by model_type."""
    from model_fixtures import make_tiny_checkpoint

    out = {}
    for family, (arch, overrides) in QUANT_MOE_FAMILIES.items():
        out[family] = make_tiny_checkpoint(tmp_path_factory.mktemp(family), arch, **{**QUANT_MOE_SHAPES, **overrides})
        scale_routers(out[family])
    return out
