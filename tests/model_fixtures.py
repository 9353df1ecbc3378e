"""Tiny random HF checkpoints (built with transformers' own classes) and paged-step helpers.

Import from tests as ``model_fixtures`` (pyproject's pytest ``pythonpath`` has ``tests``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paged_backend.attention.backend import AttentionMetadata

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (architecture, config overrides, save_pretrained kwargs)
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}, {}),
    "llama-untied-sharded": ("LlamaForCausalLM", {"tie_word_embeddings": False}, {"max_shard_size": "60KB"}),
    "llama3-rope": ("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}, {}),
    "llama-linear-rope-bias": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True,
                               "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, {}),
    "llama-mqa": ("LlamaForCausalLM", {"num_key_value_heads": 1}, {}),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 6}, {}),
    "qwen2-bias": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}, {}),
    "qwen2-mixed-window": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 5,
                           "max_window_layers": 1}, {}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"tie_word_embeddings": False}, {}),
    # GLM-4 dense: half of each head rotated in interleaved pairs, q/k/v bias, gate|up as one tensor; here
    # heads * head_dim (4 * 24) != hidden (64)
    "glm-head-dim": ("GlmForCausalLM", {"head_dim": 24}, {}),
    # GLM-4-0414: also norms on the attention and MLP outputs; one KV head (replicated under TP)
    "glm4-sublayer-norms": ("Glm4ForCausalLM", {"num_key_value_heads": 1}, {}),
}


def hf_classes(arch: str) -> tuple[type, type]:
    import transformers

    config_cls = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
                  "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
                  "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "MixtralForCausalLM": "MixtralConfig",
                  "GlmForCausalLM": "GlmConfig", "Glm4ForCausalLM": "Glm4Config",
                  "Glm4MoeForCausalLM": "Glm4MoeConfig", "DeepseekV2ForCausalLM": "DeepseekV2Config",
                  "DeepseekV3ForCausalLM": "DeepseekV3Config", "Glm4MoeLiteForCausalLM": "Glm4MoeLiteConfig"}[arch]
    return getattr(transformers, config_cls), getattr(transformers, arch)


@torch.no_grad()
def make_tiny_checkpoint(out_dir: Path, arch: str, seed: int = 0, save_kwargs: dict | None = None, **overrides) -> Path:
    """Saves a seeded random ``arch`` model (fp32) with HF's save_pretrained; returns the dir.

    Every parameter is randomised (norm weights around 1, biases non-zero) so that each one
    matters for the logits.
    """
    config_cls, model_cls = hf_classes(arch)
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, **(save_kwargs or {}))
    return out_dir


def make_variant(root: Path, name: str) -> Path:
    arch, overrides, save_kwargs = TINY_VARIANTS[name]
    return make_tiny_checkpoint(root / name, arch, save_kwargs=save_kwargs, **overrides)


def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """HF logits [L, vocab] float32 for one sequence."""
    return model(torch.tensor([token_ids])).logits[0].float()


def make_meta(
    seqs: list[tuple[int, int, list[int]]], block_size: int, sliding_window: int | None = None
) -> tuple[AttentionMetadata, torch.Tensor]:
    """(meta, positions) for one step; each seq is (num_cached_tokens, num_new_tokens, block_table)."""
    slots, positions, qsl = [], [], [0]
    width = max(len(bt) for _, _, bt in seqs)
    for ctx, q, bt in seqs:
        for p in range(ctx, ctx + q):
            positions.append(p)
            slots.append(bt[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + q)
    seq_lens = [ctx + q for ctx, q, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([bt + [0] * (width - len(bt)) for _, _, bt in seqs], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(q for _, q, _ in seqs),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        seq_lens_cpu=seq_lens,
        query_lens_cpu=[q for _, q, _ in seqs],
        sliding_window=sliding_window,
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


@dataclass
class PagedCache:
    """Per-layer KV caches pre-filled with garbage (so reading an unwritten slot shows) and a
    shuffled pool of block ids (block 0, the null block, is never handed out)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_blocks: int = 24
    block_size: int = 16
    seed: int = 0
    kv_caches: list[torch.Tensor] = field(init=False)
    free: list[int] = field(init=False)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(10 * torch.randn(shape, generator=gen)).to(self.dtype) for _ in range(self.num_layers)]
        self.free = list(range(1, self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def blocks_for(self, table: list[int], num_tokens: int) -> list[int]:
        """Grows ``table`` in place to hold ``num_tokens`` tokens."""
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table


@torch.no_grad()
def paged_logits(model, token_ids: list[int], prefill_len: int, cache: PagedCache) -> torch.Tensor:
    """Logits [L, vocab]: a prefill of ``prefill_len`` tokens, then one decode step per token."""
    table: list[int] = []
    out, ctx = [], 0
    while ctx < len(token_ids):
        q = prefill_len if ctx == 0 else 1
        cache.blocks_for(table, ctx + q)
        meta, pos = make_meta([(ctx, q, table)], cache.block_size, model.sliding_window)
        hidden = model(torch.tensor(token_ids[ctx : ctx + q]), pos, cache.kv_caches, meta)
        out.append(model.compute_logits(hidden))
        ctx += q
    return torch.cat(out)
