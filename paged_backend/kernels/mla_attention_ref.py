"""Pure-torch reference of multi-head latent attention over a paged latent cache (the CPU path).

The cache holds one vector per token (``attention/kv_cache_spec.py``'s latent layout)::

    latent_cache  [num_blocks, block_size, D]     D = kv_lora_rank + qk_rope_head_dim
                  token slot s = block * block_size + offset: [ c (kv_lora_rank, normed) | k_pe (roped) ]

Weight absorption (DeepSeek-V2, sec. 2.1.2) turns MLA into multi-query attention over that latent: the
layer folds ``W_UK`` into its query and ``W_UV`` into its output, so every head reads the same cached
vectors as key (all D dims) and value (the first ``v_dim`` = kv_lora_rank dims)::

    q      [T, H, D]   per head [ q_nope @ W_UK (kv_lora_rank) | q_pe (roped) ]
    out    [T, H, v_dim] = softmax(scale * q . latent[:L]) @ latent[:L, :v_dim]   (causal per request)

``write_latent_cache_ref`` first stores the step's new latents at ``slot_mapping`` (-1: not written);
an fp8 cache stores ``latent / kv_scale`` in e4m3 and is read back times ``kv_scale``. The request
layout is the attention metadata's (``attention/backend.py``): request i's new tokens are rows
query_start_loc[i]:query_start_loc[i+1], at positions seq_lens[i] - q_i .. seq_lens[i] - 1.
Scores, softmax and the value sum run in float32; the output is cast to q's dtype.
"""

from __future__ import annotations

import torch

from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX


def write_latent_cache_ref(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kv_scale: torch.Tensor | None = None) -> None:
    """Stores ``latent`` [T, D] into ``cache`` [num_blocks, block_size, D] at ``slot_mapping`` [T]."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = latent[keep]
    if cache.dtype == FP8_DTYPE:
        scale = 1.0 if kv_scale is None else kv_scale.float()
        rows = (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == FP8_DTYPE:  # (no index_copy_ for e4m3 on the CPU: copy the bytes)
        flat.view(torch.uint8).index_copy_(0, slots, rows.to(cache.dtype).view(torch.uint8))
    else:
        flat.index_copy_(0, slots, rows.to(cache.dtype))


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                   kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [length, D]: the first ``length`` cached latents of one request (its block table row)."""
    bs = cache.shape[1]
    blocks = block_table[: -(-length // bs)].long()
    rows = cache.index_select(0, blocks).reshape(-1, cache.shape[-1])[:length].float()
    if cache.dtype == FP8_DTYPE and kv_scale is not None:
        rows = rows * kv_scale.float()
    return rows


def mla_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, D]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
    v_dim: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H, v_dim]
    """Causal MQA of every request's new rows over its cached latents (module docstring)."""
    t, h, d = q.shape
    if latent_cache.shape[-1] != d or not 0 < v_dim <= d:
        raise ValueError(f"q [T, H, {d}] does not match the latent cache {tuple(latent_cache.shape)} "
                         f"(or v_dim {v_dim} is not in (0, {d}])")
    out = torch.zeros(t, h, v_dim, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        kv = gather_latents(latent_cache, block_tables[i], length, kv_scale)  # [L, D]
        scores = torch.einsum("qhd,ld->hql", q[lo:hi].float(), kv) * scale  # [H, q, L]
        pos = torch.arange(length - (hi - lo), length, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("hql,lv->qhv", probs, kv[:, :v_dim]).to(q.dtype)
    return out


def mla_forward_ref(query: torch.Tensor, latent: torch.Tensor, latent_cache: torch.Tensor, meta,
                    scale: float, v_dim: int, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's step: the new ``latent`` [T, D] written at ``meta.slot_mapping``, then
    ``mla_attention_ref`` of ``query`` [T, H, D] over the cache (``meta``: ``AttentionMetadata``)."""
    if latent_cache.shape[1] != meta.block_size:
        raise ValueError(f"latent cache block size {latent_cache.shape[1]} != metadata block_size {meta.block_size}")
    write_latent_cache_ref(latent, latent_cache, meta.slot_mapping, kv_scale)
    return mla_attention_ref(query, latent_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                             v_dim, kv_scale)
