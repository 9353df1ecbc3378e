"""Triton cache write against the reference: same stored bits (bf16/fp16/fp32 and fp8 e4m3)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from paged_backend.kernels.cache_write import write_kv_cache  # noqa: E402
from paged_backend.kernels.cache_write_ref import FP8_DTYPE, FP8_MAX, quantize_fp8, write_kv_cache_ref  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEVICE = torch.device("cuda" if CUDA else "cpu")
BIG = 64 if CUDA else 1

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def bits(x: torch.Tensor) -> torch.Tensor:
    """Raw bits, so NaN == NaN and -0.0 != 0.0."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.contiguous().view(view).cpu()


def poisoned_cache(num_blocks, block_size, kv_heads, head_dim, dtype) -> torch.Tensor:
    return torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), device=DEVICE).to(dtype)


def both(key, value, cache, slots, ks=None, vs=None) -> tuple[torch.Tensor, torch.Tensor]:
    ours, ref = cache.clone(), cache.cpu().clone()
    write_kv_cache(key, value, ours, slots, ks, vs)
    write_kv_cache_ref(key.cpu(), value.cpu(), ref, slots.cpu(), None if ks is None else ks.cpu(),
                       None if vs is None else vs.cpu())
    return ours, ref


@pytest.mark.parametrize(
    "kv_heads,head_dim,block_size,dtype,cache_dtype",
    [
        (2, 64, 16, torch.bfloat16, torch.bfloat16),
        (3, 64, 32, torch.float32, torch.float32),
        (1, 80, 64, torch.float16, torch.float16),  # head_dim padded to 128 in the kernel
        (8, 128, 16, torch.bfloat16, FP8_DTYPE),
        (3, 64, 32, torch.float32, FP8_DTYPE),
        (2, 96, 16, torch.float16, FP8_DTYPE),
    ],
)
def test_matches_reference(kv_heads, head_dim, block_size, dtype, cache_dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks = 9 * BIG
    t = 12 * BIG
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[::5] = -1  # padding tokens are skipped
    key = (torch.randn((t, kv_heads, head_dim), generator=g) * 3).to(dtype).to(DEVICE)
    value = (torch.randn((t, kv_heads, head_dim), generator=g) * 100).to(dtype).to(DEVICE)
    ks = torch.tensor(0.37, device=DEVICE)
    vs = torch.tensor(1.7, device=DEVICE)
    cache = poisoned_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype)
    ours, ref = both(key, value, cache, slots.to(DEVICE), ks, vs)
    assert torch.equal(bits(ours), bits(ref))
    written = ours.view(2, -1, kv_heads, head_dim)[:, slots[slots >= 0].to(DEVICE)]
    assert not written.float().isnan().any()
    untouched = ours.float().isnan().all(dim=(-1, -2)).sum().item()
    assert untouched == 2 * (num_blocks * block_size - int((slots >= 0).sum()))


def test_strided_key_value():
    """key/value as views of a fused qkv projection (token stride > heads * head_dim)."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn((10, 4 + 2 + 2, 64), generator=g).to(torch.bfloat16).to(DEVICE)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, 17, -1, 0, 31, 5, 6, 7, 40, 41], device=DEVICE)
    ours, ref = both(key, value, poisoned_cache(4, 16, 2, 64, torch.bfloat16), slots)
    assert torch.equal(bits(ours), bits(ref))


def test_fp8_rounding_edges():
    """Round-to-nearest-even ties, carries into the exponent, subnormals, saturation at 448."""
    edges = [0.0, -0.0, 1.0, 1.0625, 1.1875, 0.9999, 15.5, 15.75, 15.99, 17.0, 239.99, 240.0, 248.0, 250.0,
             447.0, 448.0, 449.0, 464.0, 480.0, 1e4, -1e4, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 1.5 * 2.0**-7,
             2.0**-6 * 0.9375, 2.0**-6 * 0.97, 1e-12, -0.3, 0.11, 3.0e-3]
    x = torch.tensor(edges + [-e for e in edges], dtype=torch.float32)
    x = torch.cat([x, torch.randn(128, generator=torch.Generator().manual_seed(2)) * 50])
    pad = (-x.numel()) % 64
    x = torch.cat([x, torch.zeros(pad)]).view(-1, 1, 64)
    t = x.shape[0]
    for scale in (1.0, 0.37, 3.0):
        s = torch.tensor(scale, device=DEVICE)
        slots = torch.arange(t, device=DEVICE)
        cache = poisoned_cache(t // 16 + 1, 16, 1, 64, FP8_DTYPE)
        ours, ref = both(x.to(DEVICE), (-x).to(DEVICE), cache, slots, s, s)
        assert torch.equal(bits(ours), bits(ref))
        # and the reference is torch's own cast of the clamped quotient
        expect = quantize_fp8(x, torch.tensor(scale))
        assert torch.equal(bits(ours[0].reshape(-1, 64)[:t]), bits(expect.reshape(-1, 64)))
    assert (quantize_fp8(torch.tensor([1e4]), torch.tensor(1.0)).float() == FP8_MAX).all()


def test_empty_and_single():
    cache = poisoned_cache(2, 16, 2, 64, torch.float32)
    k = torch.randn((0, 2, 64), device=DEVICE)
    write_kv_cache(k, k, cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert cache.isnan().all()
    k = torch.randn((1, 2, 64), device=DEVICE)
    ours, ref = both(k, -k, cache, torch.tensor([31], device=DEVICE))
    assert torch.equal(bits(ours), bits(ref))
    ours, ref = both(k, -k, cache, torch.tensor([-1], device=DEVICE))
    assert ours.isnan().all()


def test_launcher_errors():
    cache = poisoned_cache(2, 16, 2, 64, torch.float32)
    k = torch.randn((3, 2, 64), device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(TypeError, match="kv_cache dtype"):
        write_kv_cache(k, k, cache.to(torch.bfloat16), slots)
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_cache(k, k, cache[..., :1, :], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, cache, slots[:2])
    with pytest.raises(TypeError, match="slot_mapping"):
        write_kv_cache(k, k, cache, slots.float())
    with pytest.raises(ValueError, match="value"):
        write_kv_cache(k, k[:, :1], cache, slots)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(k, k, cache.to(FP8_DTYPE), slots, torch.ones(2, device=DEVICE))
