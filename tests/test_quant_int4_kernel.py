"""The Triton W4A16 kernel against the torch reference: small K/N under the CPU interpreter
(every compile-time variant: packed / per-row weight loads, group-aligned or not, tl.dot or the
few-row multiply-sum, split-K), full Llama-3.1-8B sizes on CUDA; and the reference against a
from-scratch per-element dequantization."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from paged_backend.kernels.int4_gemm_ref import dequantize_int4_ref, int4_gemm_ref, pack_int4, unpack_int4


def _random_int4(k: int, n: int, group_size: int, act_order: bool, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    g = k // (k if group_size == -1 else group_size)
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 17, (g, n), generator=gen).to(torch.uint8)  # 16: GPTQ v1's overflow zero
    scales = (torch.rand(g, n, generator=gen) * 0.02 + 0.005).to(dtype)
    perm = torch.randperm(k, generator=gen).to(torch.int32) if act_order else None
    return pack_int4(q), q, scales, zeros, perm


def test_pack_unpack_roundtrip_and_bit_order():
    q = torch.arange(16).repeat(2).reshape(32, 1) % 16
    packed = pack_int4(q)
    assert packed.shape == (4, 1) and packed.dtype == torch.int32
    assert int(packed[0, 0]) == 0x76543210  # row 8r + j sits in nibble j, low nibble first
    assert torch.equal(unpack_int4(packed).long(), q)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(12, 4, dtype=torch.int32))


@pytest.mark.parametrize("group_size", [32, -1])
def test_reference_dequant_matches_elementwise_formula(group_size):
    k, n = 64, 24
    qweight, q, scales, zeros, _ = _random_int4(k, n, group_size, False, torch.float32)
    w = dequantize_int4_ref(qweight, scales, zeros, group_size)
    gs = k if group_size == -1 else group_size
    for kk in (0, 7, 31, 33, 63):
        for nn in (0, 5, 23):
            want = (int(q[kk, nn]) - int(zeros[kk // gs, nn])) * float(scales[kk // gs, nn])
            assert float(w[kk, nn]) == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_reference_gemm_applies_perm_to_activations():
    k, n = 32, 16
    qweight, _, scales, zeros, perm = _random_int4(k, n, 32, True, torch.float32)
    x = torch.randn(3, k)
    w = dequantize_int4_ref(qweight, scales, zeros, 32)
    torch.testing.assert_close(int4_gemm_ref(x, qweight, scales, zeros, 32, perm), x[:, perm.long()] @ w)


# (M, K, N, group_size, act_order, dtype): odd multiples of the group size for K and N
CASES = [
    (1, 96, 160, 32, False, torch.float16),
    (7, 96, 160, 32, True, torch.float16),
    (16, 192, 96, 64, False, torch.bfloat16),
    (64, 128, 96, 128, True, torch.bfloat16),
    (256, 96, 40, -1, False, torch.float16),
    (7, 128, 72, 64, True, torch.float32),
]


@pytest.mark.parametrize("m,k,n,group_size,act_order,dtype", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_int4_gemm_matches_reference(m, k, n, group_size, act_order, dtype, bias):
    from paged_backend.kernels.int4_gemm import int4_gemm

    qweight, _, scales, zeros, perm = _random_int4(k, n, group_size, act_order, dtype, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    want = int4_gemm_ref(x.float(), qweight, scales, zeros, group_size, perm, b)
    got = int4_gemm(x, qweight, scales, zeros, group_size, perm, b)
    assert got.dtype == dtype and got.shape == (m, n)
    # fp32 accumulation vs an fp32 reference of the same rounded operands; only output rounding differs
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("split_k", [1, 2, 3, 5])
def test_triton_split_k_paths_agree(split_k):
    from paged_backend.kernels.int4_gemm import int4_gemm

    k, n = 160, 48
    qweight, _, scales, zeros, perm = _random_int4(k, n, 32, True, torch.float32, seed=3)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    b = torch.randn(n)
    want = int4_gemm_ref(x, qweight, scales, zeros, 32, perm, b)
    torch.testing.assert_close(int4_gemm(x, qweight, scales, zeros, 32, perm, b, split_k=split_k), want,
                               rtol=1e-5, atol=1e-5)


# (config, group_size): each kernel variant once; block_k 64 with group 32 is the per-row-group path
VARIANTS = [
    (dict(block_m=16, block_n=32, block_k=64, packed=True), 64),
    (dict(block_m=16, block_n=32, block_k=64, packed=True), 32),
    (dict(block_m=16, block_n=64, block_k=64, packed=False), 32),
    (dict(block_m=1, block_n=32, block_k=32, packed=False), 32),
    (dict(block_m=4, block_n=32, block_k=64, packed=True), 32),
    (dict(block_m=2, block_n=32, block_k=32, packed=True, split_k=3), -1),
]


@pytest.mark.parametrize("cfg,group_size", VARIANTS)
@pytest.mark.parametrize("act_order", [False, True])
def test_triton_kernel_variants_match_reference(cfg, group_size, act_order):
    from paged_backend.kernels.int4_gemm import Int4Config, int4_gemm

    k, n, m = 192, 96, 5
    qweight, _, scales, zeros, perm = _random_int4(k, n, group_size, act_order, torch.float16, seed=7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    b = torch.randn(n).to(torch.float16)
    want = int4_gemm_ref(x.float(), qweight, scales, zeros, group_size, perm, b)
    got = int4_gemm(x, qweight, scales, zeros, group_size, perm, b, config=Int4Config(**cfg))
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


def test_split_k_reduce_is_deterministic_and_adds_bias_once():
    from paged_backend.kernels.int4_gemm import Int4Config, int4_gemm

    k, n = 256, 40
    qweight, _, scales, zeros, _ = _random_int4(k, n, 32, False, torch.float32, seed=5)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    b = torch.full((n,), 100.0)
    cfg = Int4Config(block_m=16, block_n=32, block_k=32, split_k=4)
    a1 = int4_gemm(x, qweight, scales, zeros, 32, None, b, config=cfg)
    a2 = int4_gemm(x, qweight, scales, zeros, 32, None, b, config=cfg)
    assert torch.equal(a1, a2)
    torch.testing.assert_close(a1 - 100.0, int4_gemm_ref(x, qweight, scales, zeros, 32), rtol=1e-4, atol=1e-4)


def test_pick_split_k():
    from paged_backend.kernels.int4_gemm import pick_split_k

    # H200 (132 SMs), M = 1, BN = 64, BK = 128
    assert pick_split_k(1, 4096, 1, 64, 32, 132) == 9  # 4096 x 4096: ~4 programs per SM
    assert pick_split_k(1, 4096, 1, 224, 32, 132) == 3  # N = 14336
    assert pick_split_k(1, 4096, 1, 600, 32, 132) == 1  # the tiles alone fill the GPU
    assert pick_split_k(1, 512, 1, 4, 4, 132) == 2  # at least two k-blocks per slice
    assert pick_split_k(1, 1 << 20, 1, 1, 8192, 132) == 16  # capped
    assert pick_split_k(64, 4096, 1, 32, 64, 132) == 4  # partials no larger than the weight
    assert pick_split_k(256, 4096, 4, 32, 64, 132) == 1


def test_triton_launcher_rejects_bad_arguments():
    from paged_backend.kernels.int4_gemm import int4_gemm

    qweight, _, scales, zeros, _ = _random_int4(64, 16, 32, False, torch.float32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="scales"):
        int4_gemm(x, qweight, scales[:1], zeros, 32)
    with pytest.raises(TypeError, match="zeros"):
        int4_gemm(x, qweight, scales, zeros.to(torch.int32), 32)
    with pytest.raises(ValueError, match="group_size"):
        int4_gemm(x, qweight, scales, zeros, 48)
    with pytest.raises(ValueError, match="qweight"):
        int4_gemm(torch.randn(2, 72), qweight, scales, zeros, 32)


# Full sizes on the GPU: the M grid over Llama-3.1-8B's projections (group 128)
CUDA_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size kernel test needs CUDA")
@pytest.mark.parametrize("k,n", CUDA_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("act_order", [False, True])
def test_cuda_full_size_matches_reference(k, n, m, act_order):
    _check_cuda_case(m, k, n, 128, act_order, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size kernel test needs CUDA")
@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_group_sizes_and_variants(group_size, m, packed):
    from paged_backend.kernels.int4_gemm import Int4Config, default_config

    cfg = dataclasses.replace(default_config(m, 4096, 4096, 128), packed=packed)
    _check_cuda_case(m, 4096, 4096, group_size, True, cfg)
    if m == 1:  # the no-tl.dot path for single rows
        _check_cuda_case(m, 4096, 4096, group_size, False, Int4Config(block_m=1, block_n=64, block_k=128,
                                                                      packed=packed))


@functools.lru_cache(maxsize=16)
def _cuda_int4(k, n, group_size, act_order):
    qweight, _, scales, zeros, perm = _random_int4(k, n, group_size, act_order, torch.float32, seed=k + n)
    return qweight.cuda(), scales.cuda(), zeros.cuda(), perm.cuda() if perm is not None else None


def _check_cuda_case(m, k, n, group_size, act_order, cfg):
    from paged_backend.kernels.int4_gemm import int4_gemm

    dev = torch.device("cuda")
    qweight, scales, zeros, perm = _cuda_int4(k, n, group_size, act_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)).to(dev, torch.bfloat16)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    w = dequantize_int4_ref(qweight, scales, zeros, group_size, torch.bfloat16).float()  # the kernel's operands
    xs = x.float() if perm is None else x.float().index_select(1, perm.long())
    want = xs @ w + bias.float()
    got = int4_gemm(x, qweight, scales, zeros, group_size, perm, bias, config=cfg)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n) and torch.isfinite(got).all()
    # fp32 accumulation of the same bf16 operands: the output's bf16 rounding dominates
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 4e-3, err
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
