"""The Triton attention backend (the CUDA path): cache-write kernel, then paged attention.

Same contract as the torch reference backend; the host-side ``max_query_len`` /
``max_seq_len`` of the metadata pick the tile shape and the context split without a sync.
Where the kernel takes q pre-scaled (prefill steps), ``query_scale`` hands that factor to the
layer's rotary kernel, which writes q anyway (``paged_backend/kernels/paged_attention.py``, ``query_prescale``).
"""

from __future__ import annotations

import torch

from paged_backend.attention.backend import AttentionMetadata
from paged_backend.kernels.cache_write import write_kv_cache
from paged_backend.kernels.mla_attention import mla_forward, supported
from paged_backend.kernels.mla_attention import warm_up as warm_up_latent
from paged_backend.kernels.mla_attention_ref import mla_forward_ref
from paged_backend.kernels.paged_attention import paged_attention, query_prescale, warm_up


class TritonAttentionBackend:
    name = "triton"

    def forward_mla(self, query: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, v_dim: int, kv_scale: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention (``AttentionBackend.forward_mla``): the Triton kernels
        (``paged_backend/kernels/mla_attention.py``) where they take the dims, else the torch reference."""
        if supported(v_dim, query.shape[-1] - v_dim):
            return mla_forward(query, latent, kv_cache, meta, scale, v_dim, kv_scale)
        return mla_forward_ref(query, latent, kv_cache, meta, scale, v_dim, kv_scale)

    def query_scale(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> float | None:
        key = ("query_scale", tuple(query.shape[1:]), query.dtype, tuple(kv_cache.shape[3:]), kv_cache.dtype, scale,
               meta.max_query_len, meta.max_seq_len)
        if key not in meta.step_cache:  # once per step, not per layer
            meta.step_cache[key] = query_prescale(query, kv_cache, scale, meta.max_query_len, meta.max_seq_len)
        return meta.step_cache[key]

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        q_scaled: bool = False,
    ) -> torch.Tensor:  # [T, num_heads, head_dim], dtype of query
        if kv_cache.shape[2] != meta.block_size:
            raise ValueError(f"kv_cache block size {kv_cache.shape[2]} != metadata block_size {meta.block_size}")
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        return paged_attention(
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            k_scale,
            v_scale,
            meta.sliding_window,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            q_scaled=q_scaled,
        )

    def warm_up(self, kv_cache: torch.Tensor, query_dtype: torch.dtype, num_heads: int, *, max_num_seqs: int,
                max_num_batched_tokens: int, max_model_len: int, max_blocks: int,
                sliding_window: int | None = None) -> int:
        """Compile every attention kernel variant steps under these limits can launch (``warm_up``
        in paged_backend/kernels/paged_attention.py), so none compiles mid-run. Returns the launches planned."""
        return warm_up(kv_cache, query_dtype, num_heads, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                       max_blocks=max_blocks, sliding_window=sliding_window)

    def warm_up_mla(self, kv_cache: torch.Tensor, query_dtype: torch.dtype, num_heads: int, v_dim: int, *,
                    max_model_len: int) -> int:
        """``warm_up`` for a latent cache (``paged_backend/kernels/mla_attention.py``'s ``warm_up``); 0 where the
        torch reference runs (dims the kernel does not take)."""
        if not supported(v_dim, kv_cache.shape[-1] - v_dim):
            return 0
        return warm_up_latent(kv_cache, query_dtype, num_heads, v_dim, max_model_len)
