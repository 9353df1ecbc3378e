"""What one layer's paged KV cache holds: its tensor layout, its element type and its bytes per token.

The block pool, the prefix cache, copy-on-write, preemption and the KV budget see blocks only;
how much a block costs and how it is laid out is each layer's ``KVCacheSpec``::

    per-head K and V (MHA / GQA)   [2, num_blocks, block_size, num_kv_heads, head_dim]
                                   (index 0 the keys, 1 the values; blocks on dim 1)
    one latent per token (MLA)     [num_blocks, block_size, latent_dim]
                                   (latent_dim = kv_lora_rank + qk_rope_head_dim; blocks on dim 0)

Block 0 of every layer is the null block that padded slots write to (``worker/step_inputs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache: per-head K/V when ``latent_dim`` is 0, else one latent vector per token."""

    block_size: int
    dtype: torch.dtype
    num_kv_heads: int = 0  # K/V heads this rank caches (per-head layout)
    head_dim: int = 0
    latent_dim: int = 0  # MLA: the cached latent's width (0: the per-head layout)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"KVCacheSpec.block_size must be >= 1, got {self.block_size}")
        per_head = self.num_kv_heads > 0 and self.head_dim > 0
        if per_head == (self.latent_dim > 0):
            raise ValueError("KVCacheSpec needs num_kv_heads and head_dim (per-head K/V) or latent_dim (MLA), "
                             f"not both or neither: {self}")

    @property
    def is_latent(self) -> bool:
        return self.latent_dim > 0

    @property
    def block_dim(self) -> int:
        """The cache tensor's dim that indexes blocks."""
        return 0 if self.is_latent else 1

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.is_latent:
            return (num_blocks, self.block_size, self.latent_dim)
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def values_per_token(self) -> int:
        return self.latent_dim if self.is_latent else 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.values_per_token * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def allocate(self, num_blocks: int, device: torch.device | str, pin_memory: bool = False) -> torch.Tensor:
        """A zeroed cache of ``num_blocks`` blocks (``pin_memory``: page-locked host memory, the swap tier
        of a CUDA cache)."""
        return torch.zeros(self.shape(num_blocks), dtype=self.dtype, device=device, pin_memory=pin_memory)

    def copy_blocks(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Blocks ``src`` copied onto blocks ``dst`` (copy-on-write of forked samples)."""
        if self.is_latent:
            cache[dst] = cache[src]
        else:
            cache[:, dst] = cache[:, src]

    def copy_block_runs(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Block ``s`` of ``src_cache`` copied onto block ``d`` of ``dst_cache`` for each (s, d), same layout,
        each run of consecutive pairs (s, d), (s + 1, d + 1) ... as one non-blocking copy per contiguous
        part (K and V apart for a per-head cache). The host tier's copies before ``HostKVTier``
        (worker/host_kv_tier.py), kept as the reference ``bench kv-swap`` times it against: with
        scattered block ids a copy per block, per layer and per part."""
        parts = [(src_cache, dst_cache)] if self.is_latent else [(src_cache[0], dst_cache[0]),
                                                                 (src_cache[1], dst_cache[1])]
        for s, d, n in block_runs(pairs):
            for src, dst in parts:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=True)


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``pairs`` (src, dst) as runs (src, dst, n): blocks src .. src + n - 1 onto dst .. dst + n - 1, in order."""
    runs: list[list[int]] = []
    for s, d in pairs:
        last = runs[-1] if runs else None
        if last is not None and s == last[0] + last[2] and d == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]
