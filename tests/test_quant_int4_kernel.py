"""The Triton W4A16 kernel (CPU interpreter, small K/N) against the torch reference, and the
reference against a from-scratch per-element dequantization."""

from __future__ import annotations

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
