"""The runner's swap copies: device -> host then host -> device moves exactly the listed blocks'
contents, every layer, for the per-head K/V layout and the MLA latent layout (CPU tensors stand for
the device cache and the host tier), and leaves every other block alone; the per-run copies that
``bench kv-swap`` keeps as its reference move the same blocks."""

from __future__ import annotations

import pytest
import torch

from paged_backend.attention.kv_cache_spec import KVCacheSpec, block_runs
from paged_backend.worker.host_kv_tier import HostKVTier
from paged_backend.worker.model_runner import ModelRunner

SPECS = {
    "per_head": KVCacheSpec(4, torch.float32, num_kv_heads=2, head_dim=3),
    "latent": KVCacheSpec(4, torch.float32, latent_dim=5),
}


def _runner(spec: KVCacheSpec, num_blocks: int, num_host: int, num_layers: int = 2) -> ModelRunner:
    """A ModelRunner's cache state alone (the copies touch nothing else of it)."""
    r = ModelRunner.__new__(ModelRunner)
    r.device = torch.device("cpu")
    r.kv_specs = [spec] * num_layers
    g = torch.Generator().manual_seed(0)
    r.kv_caches = [torch.randn(spec.shape(num_blocks), generator=g) for _ in range(num_layers)]
    r.host_tier = HostKVTier(r.kv_specs, num_host, "cpu")
    r.num_host_blocks = num_host
    return r


def _block(spec: KVCacheSpec, cache: torch.Tensor, i: int) -> torch.Tensor:
    return cache.select(spec.block_dim, i)


@pytest.mark.parametrize("kind", list(SPECS))
def test_swap_out_then_in_moves_exactly_the_listed_blocks(kind: str) -> None:
    spec = SPECS[kind]
    r = _runner(spec, num_blocks=8, num_host=6)
    before = [c.clone() for c in r.kv_caches]
    r.swap_blocks([(3, 1), (7, 2), (2, 5)], [])
    for dev, host in zip(before, r.host_caches, strict=True):
        for d, h in [(3, 1), (7, 2), (2, 5)]:
            assert torch.equal(_block(spec, host, h), _block(spec, dev, d))
        for h in (0, 3, 4):  # untouched host blocks stay zero
            assert not _block(spec, host, h).any()
    assert all(torch.equal(a, b) for a, b in zip(before, r.kv_caches, strict=True))  # a swap out reads only
    # the freed device blocks are overwritten by others; the swap in lands in new ones
    for c in r.kv_caches:
        c.zero_()
    r.swap_blocks([], [(1, 6), (2, 4), (5, 1)])
    for dev_before, dev in zip(before, r.kv_caches, strict=True):
        assert torch.equal(_block(spec, dev, 6), _block(spec, dev_before, 3))
        assert torch.equal(_block(spec, dev, 4), _block(spec, dev_before, 7))
        assert torch.equal(_block(spec, dev, 1), _block(spec, dev_before, 2))
        for d in (0, 2, 3, 5, 7):
            assert not _block(spec, dev, d).any()


@pytest.mark.parametrize("kind", list(SPECS))
def test_swap_out_and_in_in_one_call_run_out_first(kind: str) -> None:
    """A host block freed by a swap in and reused by a swap out of the same step: out runs first."""
    spec = SPECS[kind]
    r = _runner(spec, num_blocks=6, num_host=4)
    r.swap_blocks([(1, 2)], [])
    saved = [c.clone() for c in r.kv_caches]
    r.swap_blocks([(4, 3)], [(2, 5)])
    for dev, old in zip(r.kv_caches, saved, strict=True):
        assert torch.equal(_block(spec, dev, 5), _block(spec, old, 1))
    for host, old in zip(r.host_caches, saved, strict=True):
        assert torch.equal(_block(spec, host, 3), _block(spec, old, 4))


def test_swap_without_a_host_tier_refuses() -> None:
    r = _runner(SPECS["per_head"], 4, 2)
    r.host_tier = None
    with pytest.raises(RuntimeError, match="swap_space"):
        r.swap_blocks([(1, 1)], [])
    r.swap_blocks([], [])  # nothing to copy: fine


@pytest.mark.parametrize("kind", list(SPECS))
def test_per_run_copies_move_the_listed_blocks(kind: str) -> None:
    """The per-run reference (one copy per run of consecutive blocks and per contiguous part) moves
    exactly the listed blocks."""
    spec = SPECS[kind]
    pairs = [(3, 1), (4, 2), (5, 3), (1, 7), (7, 5), (8, 6), (2, 0)]
    assert block_runs(pairs) == [(3, 1, 3), (1, 7, 1), (7, 5, 2), (2, 0, 1)]
    g = torch.Generator().manual_seed(1)
    src = torch.randn(spec.shape(9), generator=g)
    runs = spec.allocate(8, "cpu")
    spec.copy_block_runs(src, runs, pairs)
    for s, d in pairs:
        assert torch.equal(_block(spec, runs, d), _block(spec, src, s))
    assert not _block(spec, runs, 4).any()  # not a destination
