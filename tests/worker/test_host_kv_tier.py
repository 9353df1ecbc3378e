"""The host tier's batched copies (worker/host_kv_tier.py) against a pure-torch reference that copies
block by block between per-layer caches of the spec's own layout: per-head K/V and MLA latent specs,
bf16 / fp32 / fp8 caches, scattered and consecutive block ids, one staging chunk or several. On a GPU:
the stream ordering (a kernel queued after a swap out may overwrite the freed blocks; a kernel queued
after a swap in reads the copied blocks)."""

from __future__ import annotations

import random

import pytest
import torch

from paged_backend.attention.kv_cache_spec import KVCacheSpec
from paged_backend.kernels.fp8_types import FP8_DTYPE
from paged_backend.worker.host_kv_tier import HostKVTier, host_runs

SPECS = {
    "per_head": KVCacheSpec(4, torch.bfloat16, num_kv_heads=2, head_dim=8),
    "latent": KVCacheSpec(4, torch.float32, latent_dim=6),
    "per_head_fp8": KVCacheSpec(4, FP8_DTYPE, num_kv_heads=2, head_dim=8),
    "latent_fp8": KVCacheSpec(4, FP8_DTYPE, latent_dim=12),
    "odd_bytes": KVCacheSpec(3, FP8_DTYPE, num_kv_heads=1, head_dim=3),  # 9-byte parts: byte words
}
NUM_LAYERS = 3


def _random_cache(spec: KVCacheSpec, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes in the spec's layout (every bit pattern: the copies must move bytes exactly)."""
    cache = spec.allocate(num_blocks, "cpu")
    raw = torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8, generator=g)
    cache.view(torch.uint8).copy_(raw)
    return cache


def _block(spec: KVCacheSpec, cache: torch.Tensor, i: int) -> torch.Tensor:
    return cache.select(spec.block_dim, i).view(torch.uint8)


def _reference_copy(spec: KVCacheSpec, src: torch.Tensor, dst: torch.Tensor, pairs) -> None:
    for s, d in pairs:
        dst.select(spec.block_dim, d).copy_(src.select(spec.block_dim, s))


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _ids(n: int, lo: int, hi: int, consecutive: bool, rng: random.Random) -> list[int]:
    if consecutive:
        start = rng.randrange(lo, hi - n + 1)
        return list(range(start, start + n))
    return rng.sample(range(lo, hi), n)


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("consecutive", [False, True], ids=["scattered", "consecutive"])
@pytest.mark.parametrize("staging_blocks", [1, 3, 64], ids=["chunks_of_1", "chunks_of_3", "one_chunk"])
def test_swap_out_then_in_matches_the_block_by_block_reference(kind: str, consecutive: bool,
                                                               staging_blocks: int) -> None:
    spec = SPECS[kind]
    num_blocks, num_host, n = 40, 30, 17
    rng = random.Random(f"{kind}-{consecutive}-{staging_blocks}")
    g = torch.Generator().manual_seed(rng.randrange(1000))
    specs = [spec] * NUM_LAYERS
    dev = [_random_cache(spec, num_blocks, g) for _ in specs]
    tier = HostKVTier(specs, num_host, "cpu", staging_bytes=staging_blocks * NUM_LAYERS * spec.bytes_per_block)
    assert tier.staging.shape[0] == min(staging_blocks, num_host)
    ref_host = [spec.allocate(num_host, "cpu") for _ in specs]
    out = list(zip(_ids(n, 1, num_blocks, consecutive, rng), _ids(n, 1, num_host, consecutive, rng), strict=True))
    tier.swap(dev, out, [])
    for layer in range(NUM_LAYERS):
        _reference_copy(spec, dev[layer], ref_host[layer], out)
        _assert_same(tier.caches[layer], ref_host[layer])  # every host block: the listed ones, zeros elsewhere
    # back into other device blocks, after those were overwritten
    before = [c.clone() for c in dev]
    into = list(zip([h for _, h in out], _ids(n, 1, num_blocks, consecutive, rng), strict=True))
    for c in dev:
        c.view(torch.uint8).fill_(7)
    ref_dev = [c.clone() for c in dev]
    tier.swap(dev, [], into)
    for layer in range(NUM_LAYERS):
        _reference_copy(spec, ref_host[layer], ref_dev[layer], into)
        _assert_same(dev[layer], ref_dev[layer])
        for (d_old, _), (_, d_new) in zip(out, into, strict=True):
            assert torch.equal(_block(spec, dev[layer], d_new), _block(spec, before[layer], d_old))


def test_mixed_specs_and_one_call_out_before_in() -> None:
    """Layers of different specs in one host block; one call whose swap in reads a host block its swap out
    writes and writes a device block its swap out reads (a write-back and a prefix load of one step)."""
    specs = [SPECS["per_head"], SPECS["latent"], SPECS["per_head_fp8"]]
    g = torch.Generator().manual_seed(3)
    dev = [_random_cache(s, 12, g) for s in specs]
    tier = HostKVTier(specs, 10, "cpu", staging_bytes=1)  # one block per chunk
    assert tier.block_bytes == sum(s.bytes_per_block for s in specs)
    before = [c.clone() for c in dev]
    tier.swap(dev, [(5, 4), (2, 9), (7, 3)], [(4, 2), (3, 11)])
    for spec, c, old, host in zip(specs, dev, before, tier.caches, strict=True):
        assert torch.equal(_block(spec, host, 4), _block(spec, old, 5))
        assert torch.equal(_block(spec, host, 9), _block(spec, old, 2))
        assert torch.equal(_block(spec, c, 2), _block(spec, old, 5))  # read by the swap out, then overwritten
        assert torch.equal(_block(spec, c, 11), _block(spec, old, 7))
        for d in (0, 1, 3, 4, 5, 6, 7, 8, 9, 10):
            assert torch.equal(_block(spec, c, d), _block(spec, old, d))


def test_a_host_block_holds_every_layer_contiguously() -> None:
    """Host block h is row h of one tensor: layer 0's bytes (K then V), then layer 1's ..."""
    spec = SPECS["per_head"]
    g = torch.Generator().manual_seed(4)
    dev = [_random_cache(spec, 6, g) for _ in range(2)]
    tier = HostKVTier([spec, spec], 4, "cpu")
    tier.swap(dev, [(5, 2)], [])
    row = tier.buffer[2].view(torch.uint8)
    expect = torch.cat([dev[layer][part, 5].reshape(-1).view(torch.uint8) for layer in range(2) for part in range(2)])
    assert torch.equal(row, expect)
    assert not tier.buffer[[0, 1, 3]].any()


def test_host_runs_group_consecutive_host_ids() -> None:
    assert host_runs([1, 2, 3, 7, 8, 4]) == [(0, 1, 3), (3, 7, 2), (5, 4, 1)]
    assert host_runs([]) == []


def test_nothing_to_copy_is_a_no_op() -> None:
    spec = SPECS["latent"]
    tier = HostKVTier([spec], 3, "cpu")
    tier.swap([spec.allocate(3, "cpu")], [], [])
    assert not tier.buffer.any()


# -- on a GPU: stream ordering -------------------------------------------------------------------

def _cuda_setup(num_blocks: int = 512, num_host: int = 520):
    spec = KVCacheSpec(16, torch.bfloat16, num_kv_heads=8, head_dim=128)  # 64 KiB a block per layer
    specs = [spec] * 8
    g = torch.Generator().manual_seed(5)
    dev = [_random_cache(spec, num_blocks, g).cuda() for _ in specs]
    tier = HostKVTier(specs, num_host, "cuda", pin_memory=True, staging_bytes=64 << 20)  # several chunks
    return spec, dev, tier


@pytest.mark.cuda
def test_cuda_freed_blocks_reused_after_a_swap_out_reach_the_host_intact() -> None:
    """A kernel queued right after a swap out overwrites the freed device blocks; the host gets the
    contents from before (the caller's stream waited for the gathers, not for the copies to the host)."""
    spec, dev, tier = _cuda_setup()
    rng = random.Random(6)
    device_ids = rng.sample(range(1, 512), 400)
    host_ids = rng.sample(range(1, 520), 400)
    expect = [c.cpu() for c in dev]
    torch.cuda.synchronize()
    tier.swap(dev, list(zip(device_ids, host_ids, strict=True)), [])
    for c in dev:  # the freed blocks reused at once, on the caller's stream
        c.fill_(-1.0)
    tier.synchronize()
    torch.cuda.synchronize()
    for layer, host in enumerate(tier.caches):
        for d, h in zip(device_ids, host_ids, strict=True):
            assert torch.equal(_block(spec, host, h), _block(spec, expect[layer], d))


@pytest.mark.cuda
def test_cuda_swapped_in_blocks_are_read_right_after_the_call() -> None:
    """Swap out, then (the next step) swap the same host blocks into other device blocks and read them at
    once on the caller's stream: the read sees the copied contents."""
    spec, dev, tier = _cuda_setup()
    rng = random.Random(7)
    out_ids = rng.sample(range(1, 512), 300)
    host_ids = rng.sample(range(1, 520), 300)
    in_ids = rng.sample(range(1, 512), 300)
    expect = [c.cpu() for c in dev]
    tier.swap(dev, list(zip(out_ids, host_ids, strict=True)), [])
    for c in dev:
        c.zero_()
    tier.swap(dev, [], list(zip(host_ids, in_ids, strict=True)))
    idx = torch.tensor(in_ids, device="cuda")
    read = [c.index_select(spec.block_dim, idx).cpu() for c in dev]  # queued right after the swap in
    for layer in range(len(dev)):
        want = expect[layer].index_select(spec.block_dim, torch.tensor(out_ids))
        assert torch.equal(read[layer].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.cuda
def test_cuda_one_call_write_back_then_load_of_the_same_blocks() -> None:
    """One call whose swap in reads host blocks its swap out writes, into device blocks its swap out read."""
    spec, dev, tier = _cuda_setup()
    rng = random.Random(8)
    src = rng.sample(range(1, 512), 200)
    host_ids = rng.sample(range(1, 520), 200)
    dst = rng.sample(src, 200)  # the same device blocks, permuted
    expect = [c.cpu() for c in dev]
    tier.swap(dev, list(zip(src, host_ids, strict=True)), list(zip(host_ids, dst, strict=True)))
    got = [c.cpu() for c in dev]
    for layer in range(len(dev)):
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(_block(spec, got[layer], d), _block(spec, expect[layer], s))
