"""The pure-torch attention backend: the CPU path and the reference for the kernels."""

from __future__ import annotations

import torch

from paged_backend.attention.backend import AttentionMetadata
from paged_backend.kernels.cache_write_ref import write_kv_cache_ref
from paged_backend.kernels.paged_attention_ref import paged_attention_ref


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> torch.Tensor:
        write_kv_cache_ref(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        return paged_attention_ref(
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            k_scale,
            v_scale,
            meta.sliding_window,
        )
