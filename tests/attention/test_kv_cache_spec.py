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


def test_the_block_manager_drives_a_latent_cache() -> None:
    """The block pool with an MLA spec: blocks budgeted from the spec's bytes, exact block ids for a prompt,
    a prefix hit that reads what the first request wrote, a fork whose copy-on-write copies latent blocks,
    and every block free again after the requests end (no leak)."""
    from paged_backend.core.kv_cache_manager import KVCacheManager
    from paged_backend.core.request import Request
    from paged_backend.sampling_params import SamplingParams

    bs, dim = 4, 6
    spec = KVCacheSpec(bs, torch.float32, latent_dim=dim)
    num_blocks = (11 * bs * dim * 4) // spec.bytes_per_block  # the runner's rule: budget // bytes a block
    assert num_blocks == 11
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=bs)
    cache = spec.allocate(num_blocks, "cpu")

    def latent(token: int, pos: int) -> torch.Tensor:
        return torch.full((dim,), float(token * 100 + pos))

    def run(req: Request) -> list[int]:
        """Prefix lookup, allocation, then the step's latents written at their slots (as the model does)."""
        hit, num_hit = mgr.get_computed_blocks(req)
        new = mgr.allocate_slots(req, req.num_tokens - num_hit, hit)
        assert new is not None
        table = mgr.get_block_ids(req.request_id)
        for pos in range(num_hit, req.num_tokens):
            cache[table[pos // bs], pos % bs] = latent(req.all_token_ids[pos], pos)
        req.num_computed_tokens = req.num_tokens
        return [b.block_id for b in new]

    def read(req: Request) -> torch.Tensor:
        table = mgr.get_block_ids(req.request_id)
        return torch.stack([cache[table[p // bs], p % bs] for p in range(req.num_computed_tokens)])

    def expected(tokens: list[int]) -> torch.Tensor:
        return torch.stack([latent(t, p) for p, t in enumerate(tokens)])

    a = Request("a", list(range(10)), SamplingParams(), max_tokens=8)
    assert run(a) == [1, 2, 3]
    b = Request("b", list(range(8)) + [50, 51, 52], SamplingParams(), max_tokens=8)
    assert run(b) == [4]  # blocks 1 and 2 from the prefix cache
    assert mgr.get_block_ids("b") == [1, 2, 4]
    assert torch.equal(read(b), expected(b.all_token_ids))

    child = Request("a.1", list(range(10)), SamplingParams(), max_tokens=8)
    child.num_computed_tokens = a.num_computed_tokens
    mgr.fork(a, child)
    child.append_output_token(77)
    assert mgr.allocate_slots(child, 1) == []
    assert mgr.get_block_ids("a.1") == [1, 2, 5]
    copies = mgr.take_pending_copies()
    assert copies == [(3, 5)]
    spec.copy_blocks(cache, torch.tensor([s for s, _ in copies]), torch.tensor([d for _, d in copies]))
    cache[5, 10 % bs] = latent(77, 10)
    child.num_computed_tokens += 1
    assert torch.equal(read(child), expected(list(range(10)) + [77]))
    assert torch.equal(read(a), expected(list(range(10))))  # the parent's block 3 untouched

    for req in (a, b, child):
        mgr.free(req)
    assert mgr.num_free_blocks == num_blocks - 1
    assert not any(blk.ref_cnt for blk in mgr.block_pool.blocks)
