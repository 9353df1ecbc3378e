"""The attention-backend interface and the per-step metadata the model runner builds.

Tokens of all scheduled requests are flattened into one batch of ``T`` tokens::

    query_start_loc  [0,        q0,          q0+q1,  ...,  T]      (int32, num_seqs+1)
    seq_lens         [ctx0+q0,  ctx1+q1,     ...]                  (int32, num_seqs)
    request i's new tokens are rows query_start_loc[i]:query_start_loc[i+1]; they sit at
    positions seq_lens[i]-q_i .. seq_lens[i]-1 of that request and attend causally to
    every earlier position (the cached context, read through block_tables[i]).

    slot_mapping[t] = block_id * block_size + offset   (int64, T; -1 = do not write)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]  context + new tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # host copies, for backends that loop on the CPU
    seq_lens_cpu: list[int] | None = None
    query_lens_cpu: list[int] | None = None
    sliding_window: int | None = None
    # scratch a backend fills lazily and every layer of the step reuses (the torch backend's gather
    # plan). It belongs to one step: a runner that reuses a metadata object across steps must clear
    # it. dataclasses.replace() shares it, so entries must key on the fields they depend on.
    step_cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache, then attends over it."""

    name: str

    def query_scale(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> float | None:
        """A factor the layer's rotary should multiply into this step's query (then ``forward``
        gets ``q_scaled=True``), or None: the backend would otherwise make a pass over q for it."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor,  # float32 scalar tensor (1.0 unless the cache is fp8)
        v_scale: torch.Tensor,
        q_scaled: bool = False,  # query carries ``query_scale``'s factor
    ) -> torch.Tensor:  # [T, num_heads, head_dim], dtype of query
        ...

    def forward_mla(
        self,
        query: torch.Tensor,  # [T, num_heads, D]: absorbed q_nope | roped q_pe (models/mla.py)
        latent: torch.Tensor,  # [T, D]: normed c | roped k_pe
        kv_cache: torch.Tensor,  # [num_blocks, block_size, D] (the latent layout of attention/kv_cache_spec.py)
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,  # the value: the latent's first v_dim dims (kv_lora_rank)
        kv_scale: torch.Tensor,  # float32 scalar (1.0 unless the cache is fp8)
    ) -> torch.Tensor:  # [T, num_heads, v_dim], dtype of query
        """Multi-head latent attention: writes ``latent`` into the cache, then attends (paged_backend/kernels/mla_attention_ref.py)."""
        ...
