"""The Triton attention backend (the CUDA path): cache-write kernel, then paged attention.

Same contract as the torch reference backend; the host-side ``max_query_len`` /
``max_seq_len`` of the metadata pick the tile shape and the context split without a sync.
"""

from __future__ import annotations

import torch

from paged_backend.attention.backend import AttentionMetadata
from paged_backend.kernels.cache_write import write_kv_cache
from paged_backend.kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    name = "triton"

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
        )
