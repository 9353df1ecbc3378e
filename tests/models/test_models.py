"""Our Llama-family models against transformers' own, logits position by position.

Tiny random checkpoints (the dense architectures and their flags) run through the paged
KV cache with shuffled block ids: one prefill, then prefill + decode steps, then several
sequences flattened into one step with chunked prefill. fp32 must match HF to ~1e-4.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import (
    TINY_VARIANTS,
    PagedCache,
    hf_logits,
    hf_model,
    make_meta,
    make_variant,
    paged_logits,
)

from paged_backend.attention.torch_attn import TorchAttentionBackend
from paged_backend.models.model_info import ModelInfo
from paged_backend.worker.model_loader import load_model

ATOL = RTOL = 1e-4


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Variant name -> checkpoint dir, each built once per module on first use."""
    root, made = tmp_path_factory.mktemp("tiny"), {}

    def get(name: str):
        if name not in made:
            made[name] = make_variant(root, name)
        return made[name]

    return get


def _ours(path, dtype=torch.float32):
    info = ModelInfo.from_dir(path)
    return info, load_model(path, info, dtype, torch.device("cpu"), TorchAttentionBackend())


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_paged_prefill_and_decode_match_hf(checkpoints, variant):
    path = checkpoints(variant)
    info, model = _ours(path)
    hf = hf_model(path)
    for length, prefill, seed in ((35, 35, 1), (35, 32, 2), (9, 6, 3)):
        tokens = _prompt(length, seed)
        ref = hf_logits(hf, tokens)
        cache = PagedCache(info.num_layers, info.num_kv_heads, info.head_dim, torch.float32, seed=seed)
        _assert_close(paged_logits(model, tokens, prefill, cache), ref)


@pytest.mark.parametrize("variant", ["llama-tied", "qwen3-qk-norm", "mistral-window"])
@torch.no_grad()
def test_flattened_batch_with_chunked_prefill_matches_hf(checkpoints, variant):
    """Three sequences share each step: prefills, a chunked prefill and decodes, all mixed."""
    path = checkpoints(variant)
    info, model = _ours(path)
    hf = hf_model(path)
    prompts = [_prompt(n, 10 + n) for n in (20, 13, 7)]
    refs = [hf_logits(hf, p) for p in prompts]
    cache = PagedCache(info.num_layers, info.num_kv_heads, info.head_dim, torch.float32, num_blocks=12)
    tables: list[list[int]] = [[], [], []]
    # per step: new tokens per sequence (0 = not scheduled)
    steps = [(18, 5, 0), (1, 6, 7), (1, 2, 0)]
    done = [0, 0, 0]
    for step in steps:
        seqs, rows = [], []
        for i, q in enumerate(step):
            if q == 0:
                continue
            cache.blocks_for(tables[i], done[i] + q)
            seqs.append((done[i], q, tables[i]))
            rows.append((i, done[i], q))
        meta, positions = make_meta(seqs, cache.block_size, model.sliding_window)
        ids = torch.tensor([t for i, ctx, q in rows for t in prompts[i][ctx : ctx + q]])
        logits = model.compute_logits(model(ids, positions, cache.kv_caches, meta))
        start = 0
        for i, ctx, q in rows:
            _assert_close(logits[start : start + q], refs[i][ctx : ctx + q])
            start += q
            done[i] += q
    assert done == [len(p) for p in prompts]


@pytest.mark.parametrize("variant", ["llama-untied-sharded", "qwen3-qk-norm"])
def test_bf16_close_to_hf_bf16(checkpoints, variant):
    """bf16: within a few bf16 ulps of HF's bf16 logits and no further from fp32 than HF is."""
    path = checkpoints(variant)
    info, model = _ours(path, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    tokens = _prompt(35, 7)
    ref16, ref32 = hf_logits(hf_model(path, torch.bfloat16), tokens), hf_logits(hf_model(path), tokens)
    cache = PagedCache(info.num_layers, info.num_kv_heads, info.head_dim, torch.bfloat16)
    ours = paged_logits(model, tokens, 32, cache)
    tol = 0.1  # ~6 bf16 ulps at |logit| ~ 3
    assert (ours - ref16).abs().max() < tol
    assert (ours - ref32).abs().max() <= 1.5 * (ref16 - ref32).abs().max()
    top2 = ref16.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tol  # argmax is only defined where bf16 noise can't flip it
    assert clear.sum() > 10
    assert torch.equal(ours.argmax(-1)[clear], ref16.argmax(-1)[clear])


@pytest.mark.slow
def test_smollm2_matches_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_backend.models.default_model import ensure_default_model

    path = ensure_default_model()
    info, model = _ours(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    for text in ("The capital of France is", "def fibonacci(n):\n    ", "Hello! How are you today? I am"):
        ids = tok(text)["input_ids"]
        ref = hf_logits(hf, ids)
        cache = PagedCache(info.num_layers, info.num_kv_heads, info.head_dim, torch.float32, num_blocks=4)
        ours = paged_logits(model, ids, len(ids) - 2, cache)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        assert (ours - ref).abs().max() < 1e-3  # |logits| ~ 30, 30 layers
