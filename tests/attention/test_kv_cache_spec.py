"""``KVCacheSpec``: the per-head K/V and the MLA latent layouts, their bytes, and block copies."""

from __future__ import annotations

import pytest
import torch

from paged_backend.attention.kv_cache_spec import KVCacheSpec


def test_per_head_layout_and_bytes() -> None:
    spec = KVCacheSpec(block_size=16, dtype=torch.bfloat16, num_kv_heads=8, head_dim=128)
    assert not spec.is_latent and spec.block_dim == 1
    assert spec.shape(5) == (2, 5, 16, 8, 128)
    assert spec.bytes_per_token == 2 * 8 * 128 * 2 and spec.bytes_per_block == 16 * 4096
    assert spec.allocate(3, "cpu").shape == (2, 3, 16, 8, 128)


def test_latent_layout_is_one_vector_per_token() -> None:
    """DeepSeek's 512 + 64 latent in fp8: 576 bytes a token, about 1/7 of Llama-3-8B's 4096 values."""
    spec = KVCacheSpec(block_size=16, dtype=torch.float8_e4m3fn, latent_dim=576)
    assert spec.is_latent and spec.block_dim == 0
    assert spec.shape(4) == (4, 16, 576)
    assert spec.bytes_per_token == 576 and spec.bytes_per_block == 16 * 576


@pytest.mark.parametrize("spec", [KVCacheSpec(4, torch.float32, num_kv_heads=2, head_dim=3),
                                  KVCacheSpec(4, torch.float32, latent_dim=5)], ids=["per-head", "latent"])
def test_copy_blocks_copies_whole_blocks(spec: KVCacheSpec) -> None:
    cache = torch.arange(torch.Size(spec.shape(6)).numel(), dtype=torch.float32).reshape(spec.shape(6))
    before = cache.clone()
    spec.copy_blocks(cache, torch.tensor([1, 4]), torch.tensor([2, 5]))
    blocks, old = cache.movedim(spec.block_dim, 0), before.movedim(spec.block_dim, 0)
    assert torch.equal(blocks[2], old[1]) and torch.equal(blocks[5], old[4])
    assert all(torch.equal(blocks[b], old[b]) for b in (0, 1, 3, 4))


@pytest.mark.parametrize("kw", [dict(), dict(num_kv_heads=2, head_dim=4, latent_dim=8), dict(num_kv_heads=2)])
def test_a_spec_is_one_layout(kw) -> None:
    with pytest.raises(ValueError, match="per-head K/V"):
        KVCacheSpec(16, torch.float32, **kw)
