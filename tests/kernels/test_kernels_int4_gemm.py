"""The Triton W4A16 kernels against the torch reference: small K/N under the CPU interpreter
(the M grid 1, 7, 16, 64, 256, odd multiples of the group size, groups 32/64/128/-1, act-order on
and off; then every compile-time variant: the FMA GEMV with 1/2/4 rows and each activation load
mode, the tl.dot path with and without W^T x^T and with the scale before or after the dot, split-K
through the reduce kernel and through the last program, uneven K, a group size without 16-row
blocks), full Llama-3.1-8B sizes, the inline-PTX mma path and CUDA-graph replays on CUDA; and the
reference against a from-scratch per-element dequantization."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from paged_backend.kernels.int4_gemm_ref import (
    KERNEL_NIBBLE,
    compact_scales,
    dequantize_int4_ref,
    int4_gemm_ref,
    pack_int4,
    pack_int4_kernel,
    unpack_int4,
    unpack_int4_kernel,
)


def _random_int4(k: int, n: int, group_size: int, act_order: bool, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    g = k // (k if group_size == -1 else group_size)
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 17, (g, n), generator=gen).to(torch.uint8)  # 16: GPTQ v1's overflow zero
    scales = (torch.rand(g, n, generator=gen) * 0.02 + 0.005).to(dtype)
    perm = torch.randperm(k, generator=gen).to(torch.int32) if act_order else None
    return pack_int4_kernel(q), q, scales, zeros, perm


def test_pack_unpack_roundtrip_and_bit_order():
    q = torch.arange(16).repeat(2).reshape(32, 1) % 16
    packed = pack_int4(q)  # GPTQ's K-packed [K/8, N]
    assert packed.shape == (4, 1) and packed.dtype == torch.int32
    assert int(packed[0, 0]) == 0x76543210  # row 8r + j sits in nibble j, low nibble first
    assert torch.equal(unpack_int4(packed).long(), q)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(12, 4, dtype=torch.int32))


def test_kernel_layout_is_n_major_with_k_packed_words():
    q = torch.randint(0, 16, (24, 5), generator=torch.Generator().manual_seed(0))
    qw = pack_int4_kernel(q)
    assert qw.shape == (5, 3) and qw.is_contiguous()
    for n in (0, 4):
        for k in range(24):  # column c of a word: bits 4 * (c // 2) + 16 * (c % 2)
            assert (int(qw[n, k // 8]) >> (4 * (k % 8 // 2) + 16 * (k % 2))) & 0xF == int(q[k, n])
    assert [4 * (c // 2) + 16 * (c % 2) for c in range(8)] == [4 * j for j in KERNEL_NIBBLE]
    assert torch.equal(unpack_int4_kernel(qw).long(), q)


def test_compact_scales_keeps_values_exactly():
    fp16 = torch.tensor([[0.0125, 3.0]]).to(torch.float16).float()
    assert compact_scales(fp16).dtype == torch.float16
    bf16 = torch.tensor([[1e-30, 3.0]]).to(torch.bfloat16).float()  # below fp16's range
    assert compact_scales(bf16).dtype == torch.bfloat16
    fp32 = torch.tensor([[0.1, 3.0]])
    assert compact_scales(fp32).dtype == torch.float32
    for s in (fp16, bf16, fp32):
        assert torch.equal(compact_scales(s).float(), s)


@pytest.mark.parametrize("group_size", [32, -1])
def test_reference_dequant_matches_elementwise_formula(group_size):
    k, n = 64, 24
    qweight, q, scales, zeros, _ = _random_int4(k, n, group_size, False, torch.float32)
    w = dequantize_int4_ref(qweight, scales, zeros, group_size)
    assert w.shape == (k, n) and w.dtype == torch.float32
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


def _check(m, k, n, group_size, act_order, dtype, bias=True, config=None, seed=0, **kw):
    from paged_backend.kernels.int4_gemm import int4_gemm

    qweight, _, scales, zeros, perm = _random_int4(k, n, group_size, act_order, dtype, seed=seed + m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    want = int4_gemm_ref(x.float(), qweight, scales, zeros, group_size, perm, b)
    got = int4_gemm(x, qweight, scales, zeros, group_size, perm, b, config=config, **kw)
    assert got.dtype == dtype and got.shape == (m, n)
    # fp32 accumulation of exact (q - z) times the fp32 scale vs an fp32 reference: only the output
    # rounding differs (bf16: 2^-8 relative; the scale-before-dot variant also rounds W, 2^-8)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    return got


# (M, K, N, group_size, act_order, dtype): M grid 1, 7, 16, 64, 256; K and N odd multiples of the group
CASES = [
    (1, 96, 160, 32, False, torch.float16),
    (1, 192, 96, 64, True, torch.bfloat16),
    (1, 384, 40, 128, True, torch.float16),
    (7, 96, 160, 32, True, torch.float16),
    (7, 128, 72, -1, False, torch.float32),
    (16, 192, 96, 64, False, torch.bfloat16),
    (16, 384, 24, 128, True, torch.float16),
    (64, 128, 96, 128, True, torch.bfloat16),
    (64, 96, 40, 32, False, torch.float32),
    (256, 96, 40, -1, False, torch.float16),
    (256, 192, 24, 64, True, torch.bfloat16),
]


@pytest.mark.parametrize("m,k,n,group_size,act_order,dtype", CASES)
def test_triton_int4_gemm_matches_reference(m, k, n, group_size, act_order, dtype):
    _check(m, k, n, group_size, act_order, dtype, bias=m % 2 == 1)


def _cfg(**kw):
    from paged_backend.kernels.int4_gemm import Int4Config

    return Int4Config(**kw)


# every compile-time variant once: (config, group_size, act_order, dtype, M)
VARIANTS = [
    # FMA GEMV: rows per program, activation loads (bf16 pairs, fp16 pairs, fp32, gathered)
    (dict(path="gemv", block_m=1, block_n=32, block_k=32), 32, False, torch.bfloat16, 1),
    (dict(path="gemv", block_m=2, block_n=16, block_k=64, num_stages=2), 64, False, torch.float16, 2),
    (dict(path="gemv", block_m=4, block_n=32, block_k=32), 32, True, torch.bfloat16, 3),
    (dict(path="gemv", block_m=4, block_n=16, block_k=64, num_stages=2), -1, False, torch.float32, 5),
    (dict(path="gemv", block_m=1, block_n=32, block_k=64, gather_x=False), 64, True, torch.float16, 1),
    (dict(path="gemv", block_m=1, block_n=32, block_k=32, num_stages=1), 64, True, torch.bfloat16, 1),
    (dict(path="gemv", block_m=1, block_n=32, block_k=32, num_stages=3, split_k=2), 32, False, torch.float16, 1),
    (dict(path="gemv", block_m=1, block_n=32, block_k=32, split_k=2), 64, False, torch.bfloat16, 1),
    # tensor cores: x W or W^T x^T, scale after or before the dot
    (dict(path="dot", block_m=16, block_n=32, block_k=32), 32, True, torch.float16, 5),
    (dict(path="dot", block_m=16, block_n=16, block_k=64, swap_ab=True), 64, False, torch.bfloat16, 9),
    (dict(path="dot", block_m=32, block_n=16, block_k=32, swap_ab=True, scale_after=False), 32, True,
     torch.bfloat16, 20),
    (dict(path="dot", block_m=16, block_n=32, block_k=16, scale_after=False), -1, False, torch.float32, 17),
]


@pytest.mark.parametrize("cfg,group_size,act_order,dtype,m", VARIANTS)
def test_triton_kernel_variants_match_reference(cfg, group_size, act_order, dtype, m):
    _check(m, 192, 96, group_size, act_order, dtype, config=_cfg(**cfg), seed=7)


@pytest.mark.parametrize("path", ["gemv", "dot"])
def test_split_k_reductions_agree_bit_for_bit_and_add_bias_once(path):
    """Partials summed by the reduce kernel or by the tile's last program: the same fixed order,
    so the same bits; with the bias added once; and the tickets are left at zero for the next launch."""
    from paged_backend.kernels import int4_gemm as mod

    k, n, m = 256, 40, 3
    qweight, _, scales, zeros, _ = _random_int4(k, n, 32, False, torch.float32, seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6))
    b = torch.full((n,), 100.0)
    base = dict(path=path, block_m=4 if path == "gemv" else 16, block_n=16, block_k=32)
    outs = {}
    for reduce in ("last", "kernel"):
        for split in (1, 3, 8):
            outs[reduce, split] = mod.int4_gemm(x, qweight, scales, zeros, 32, None, b,
                                                config=_cfg(**base, split_k=split, reduce=reduce))
    assert torch.equal(outs["last", 3], outs["kernel", 3]) and torch.equal(outs["last", 8], outs["kernel", 8])
    torch.testing.assert_close(outs["last", 8] - 100.0, int4_gemm_ref(x, qweight, scales, zeros, 32),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs["last", 1], outs["last", 8], rtol=1e-5, atol=1e-4)
    assert int(mod._TICKETS[None].abs().sum()) == 0


def test_uneven_k_and_a_group_size_without_16_row_blocks():
    """K not a multiple of the k-block (masked tail), and group 40 (k-blocks of 8: the dot path
    falls back to the FMA kernel, 4 rows per program)."""
    _check(5, 96, 24, -1, False, torch.float16, config=_cfg(path="dot", block_m=16, block_n=16, block_k=64))
    _check(3, 96, 24, -1, True, torch.bfloat16, config=_cfg(path="gemv", block_m=4, block_n=16, block_k=64))
    _check(6, 120, 24, 40, True, torch.float16, config=_cfg(path="dot", block_m=16, block_n=16, block_k=32))
    for stages in (2, 3):  # one row: the activations and words loaded ahead, masked at the tail
        _check(1, 96, 24, -1, True, torch.bfloat16,
               config=_cfg(path="gemv", block_m=1, block_n=16, block_k=64, split_k=1, num_stages=stages))
    _check(1, 120, 24, 40, False, torch.float16, config=_cfg(path="gemv", block_m=1, block_n=16, block_k=8))


def test_pick_split_k():
    from paged_backend.kernels.int4_gemm import pick_split_k

    # H200 (132 SMs): up to four programs per SM, one wave
    assert pick_split_k(1, 4096, 32, 32, 132) == 16  # 4096 x 4096, 128 columns a program
    assert pick_split_k(1, 4096, 112, 32, 132) == 4  # N = 14336: 448 programs, not 560 (a 2nd wave)
    assert pick_split_k(1, 4096, 600, 32, 132) == 1  # the tiles alone fill the GPU
    assert pick_split_k(1, 512, 4, 4, 132) == 4  # at most one slice per k-block
    assert pick_split_k(1, 1 << 20, 1, 8192, 132) == 32  # capped
    assert pick_split_k(16, 4096, 32, 32, 132) == 16  # partials no larger than the weight
    assert pick_split_k(64, 4096, 32, 32, 132) == 4
    assert pick_split_k(256, 4096, 64, 64, 132) == 1


def test_default_config_paths():
    from paged_backend.kernels import int4_gemm as mod

    mod.interpreting = lambda: False  # the GPU defaults (restored below)
    try:
        assert mod.default_config(1, 4096, 4096, 128).path == "gemv"
        assert {mod.default_config(m, 4096, 4096, 128).path for m in (7, 16, 64, 256)} == {"dot"}
        assert mod.default_config(16, 4096, 4096, 128).swap_ab  # few tokens: the weight tile is MMA-M
        # split-K sums: the tile's last program up to 16 rows, the reduce kernel from 17 (H200, 2026-11-30)
        assert [mod.default_config(m, 4096, 4096, 128).reduce for m in (16, 17, 32, 64)] == [
            "last", "kernel", "kernel", "kernel"]
        # act-order's in-kernel gather: two warps (four doubled its time on the H200)
        assert mod.default_config(1, 4096, 4096, 128, act_order=True).num_warps == 2
        assert mod.default_config(1, 4096, 4096, 128).num_warps == 4
        # 16-bit activations on the GPU: the mma path up to 16 rows, for groups of whole 128-k blocks
        assert [mod.default_config(m, 4096, 4096, 128, mma_ok=True).path for m in (1, 8, 9, 16)] == [
            "mma", "mma", "dot", "dot"]
        # 9-16 rows on an N or K of 8192+: two 16-column tiles per warp (x loads shared), 64 columns per
        # program for a wide N; act-order there keeps the dot path
        assert [(c.path, c.block_m, c.block_n, c.mma_cols, c.num_warps) for c in (
            mod.default_config(m, n, k, 128, mma_ok=True) for m, n, k in ((16, 14336, 4096), (9, 4096, 14336)))
        ] == [("mma", 16, 64, 32, 8), ("mma", 16, 32, 32, 8)]
        assert mod.default_config(16, 14336, 4096, 128, act_order=True, mma_ok=True).path == "dot"
        assert mod.default_config(1, 4096, 4096, 256, mma_ok=True).path == "mma"
        # act-order at one row: the GEMV's in-kernel gather on small weights, the mma path's
        # gather-first launch on large ones
        assert [mod.default_config(1, n, 4096, 128, act_order=True, mma_ok=True).path for n in (4096, 14336)] == [
            "gemv", "mma"]
        # one 16-column group per program, warps splitting K (see default_config)
        assert [(c.block_n, c.num_warps, c.split_k) for c in (mod.default_config(1, n, k, 128, mma_ok=True)
                for n, k in ((14336, 4096), (4096, 4096), (4096, 14336), (1024, 4096)))] == [
            (16, 4, 1), (16, 8, 1), (16, 16, 1), (16, 8, None)]
        assert mod.default_config(1, 4096, 4096, 4096, mma_ok=True).path == "mma"  # one group
        assert mod.default_config(1, 4096, 4096, 64, mma_ok=True).path == "gemv"
        assert mod.default_config(1, 4096, 4160, 4160, mma_ok=True).path == "gemv"  # K not whole 128-k blocks
    finally:
        del mod.interpreting
        from paged_backend.kernels._launch import interpreting

        mod.interpreting = interpreting


def test_config_validation_and_launcher_errors():
    from paged_backend.kernels.int4_gemm import Int4Config, int4_gemm

    with pytest.raises(ValueError, match="path"):
        Int4Config(path="marlin")
    with pytest.raises(ValueError, match="power of two"):
        Int4Config(block_n=48)
    with pytest.raises(ValueError, match=">= 16"):
        Int4Config(path="dot", block_m=8)
    with pytest.raises(ValueError, match="mma path"):
        Int4Config(path="mma", block_m=8, block_n=128, block_k=128, num_warps=4)  # 8 column groups, 4 warps
    with pytest.raises(ValueError, match="mma path"):
        Int4Config(path="mma", block_m=8, block_n=64, block_k=128, num_warps=2)
    with pytest.raises(ValueError, match="mma path"):
        Int4Config(path="mma", block_m=4, block_n=64, block_k=128, num_warps=4)
    with pytest.raises(ValueError, match="mma path"):  # two 16-column tiles per warp: 32 columns at least
        Int4Config(path="mma", block_m=8, block_n=16, block_k=128, num_warps=4, mma_cols=32)
    with pytest.raises(ValueError, match="mma path"):
        Int4Config(path="mma", block_m=8, block_n=64, block_k=128, num_warps=4, mma_cols=48)
    Int4Config(path="mma", block_m=8, block_n=128, block_k=128, num_warps=4, mma_cols=32)  # 4 warps side by side
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
    with pytest.raises(ValueError, match="qweight"):
        int4_gemm(x, qweight.t().contiguous(), scales, zeros, 32)  # GPTQ's [K/8, N] is not the kernel layout
    # the mma path is inline PTX: never on fp32 activations (nor in the interpreter), nor for groups
    # that split a 128-k block
    mma = Int4Config(path="mma", block_m=8, block_n=64, block_k=128, num_warps=4)
    with pytest.raises(ValueError, match="path 'mma' needs"):
        int4_gemm(x, qweight, scales, zeros, 32, config=mma)


# -- CUDA: full sizes (M grid 1, 7, 16, 64, 256 over Llama-3.1-8B's projections, group 128) --------

CUDA_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
cuda = pytest.mark.cuda  # full sizes


@cuda
@pytest.mark.parametrize("k,n", CUDA_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("act_order", [False, True])
def test_cuda_full_size_matches_reference(k, n, m, act_order):
    _check_cuda_case(m, k, n, 128, act_order, None)


@cuda
@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("m", [1, 2, 16, 64])
@pytest.mark.parametrize("path", ["gemv", "dot"])
def test_cuda_group_sizes_and_paths(group_size, m, path):
    from paged_backend.kernels.int4_gemm import default_config

    cfg = default_config(m, 4096, 4096, 128)
    if cfg.path != path:
        cfg = (_cfg(path="gemv", block_m=min(m, 4) if m <= 4 else 4, block_n=128, block_k=128, num_warps=2)
               if path == "gemv" else _cfg(path="dot", block_m=16, block_n=128, block_k=128, swap_ab=True))
    for act_order in (False, True):
        for reduce in ("last", "kernel"):
            _check_cuda_case(m, 4096, 4096, group_size, act_order, dataclasses.replace(cfg, reduce=reduce))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_after", [True, False])
@pytest.mark.parametrize("scales_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_dot_pairs_dequant_matches_fp32_route(dtype, scale_after, scales_dtype):
    """The dot path's paired 16-bit dequantization gives the fp32 route's bits: q - z is exact
    either way, and a scale folded in before the dot is rounded once (the paired multiply when
    the scales are in x's dtype; the fp32 route otherwise)."""
    from paged_backend.kernels.int4_gemm import int4_gemm

    k, n, m = 1024, 384, 16
    qweight, _, scales, zeros, perm = _random_int4(k, n, 128, True, scales_dtype, seed=5)
    qweight, scales, zeros, perm = qweight.cuda(), scales.cuda(), zeros.cuda(), perm.cuda()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    cfg = _cfg(path="dot", block_m=16, block_n=128, block_k=128, swap_ab=True, scale_after=scale_after)
    got = int4_gemm(x, qweight, scales, zeros, 128, perm, config=cfg)
    fp32_route = int4_gemm(x, qweight, scales, zeros, 128, perm, config=dataclasses.replace(cfg, pairs=False))
    assert torch.equal(got, fp32_route)
    w = dequantize_int4_ref(qweight, scales, zeros, 128)
    want = x.float().index_select(1, perm.long()) @ w
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@functools.lru_cache(maxsize=16)
def _cuda_int4(k, n, group_size, act_order):
    qweight, _, scales, zeros, perm = _random_int4(k, n, group_size, act_order, torch.float16, seed=k + n)
    return qweight.cuda(), scales.cuda(), zeros.cuda(), perm.cuda() if perm is not None else None


def _check_cuda_case(m, k, n, group_size, act_order, cfg, dtype=torch.bfloat16, x=None):
    from paged_backend.kernels.int4_gemm import int4_gemm

    dev = torch.device("cuda")
    qweight, scales, zeros, perm = _cuda_int4(k, n, group_size, act_order)
    if x is None:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)).to(dev, dtype)
    bias = torch.randn(n, device=dev, dtype=dtype)
    w = dequantize_int4_ref(qweight, scales, zeros, group_size)  # fp32: the kernel never rounds W
    xs = x.float() if perm is None else x.float().index_select(1, perm.long())
    want = xs @ w + bias.float()
    got = int4_gemm(x, qweight, scales, zeros, group_size, perm, bias, config=cfg)
    assert got.dtype == dtype and got.shape == (m, n) and torch.isfinite(got).all()
    # fp32 accumulation of exact operands: the output's bf16 rounding (2^-8 relative) dominates,
    # plus W's bf16 rounding when the scale goes before the dot
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 4e-3, err
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("k,n,group_size", [(4096, 4136, 128), (2048, 1000, 256), (1152, 520, -1)])
def test_cuda_mma_path_matches_reference(dtype, m, k, n, group_size):
    """The mma path (inline PTX: per-lane words into m16n8k16 fragments) on its own: N not a
    multiple of the program's columns, groups of 128 / 256 / one, both 16-bit dtypes, one or two
    8-row groups of activations, every split-K reduction, act-order (x gathered first), warps
    side by side and warps splitting K (k-block counts not a multiple of them), one or two 16-column
    tiles per warp."""
    for act_order in (False, True):
        for split_k, reduce in ((None, "last"), (1, "last"), (3, "kernel"), (5, "last")):
            cfg = _cfg(path="mma", block_m=8 if m <= 8 else 16, block_n=64, block_k=128, num_warps=4,
                       split_k=split_k, reduce=reduce)
            _check_cuda_case(m, k, n, group_size, act_order, cfg, dtype)
    for block_n, warps in ((32, 2), (128, 8), (16, 4), (32, 8)):  # block_n < 16 x warps: warps split K
        for split_k in (None, 3):
            cfg = _cfg(path="mma", block_m=8 if m <= 8 else 16, block_n=block_n, block_k=128, num_warps=warps,
                       split_k=split_k)
            _check_cuda_case(m, k, n, group_size, False, cfg, dtype)
    # two 16-column tiles per warp sharing the x loads (mma_cols 32): warps side by side or splitting K
    for block_n, warps, split_k, act_order in ((32, 1, None, False), (64, 4, 3, True), (128, 4, None, False),
                                               (32, 8, 2, False)):
        cfg = _cfg(path="mma", block_m=8 if m <= 8 else 16, block_n=block_n, block_k=128, num_warps=warps,
                   split_k=split_k, mma_cols=32)
        _check_cuda_case(m, k, n, group_size, act_order, cfg, dtype)


@cuda
def test_cuda_mma_default_and_unaligned_activations():
    """bf16/fp16 x with rows on 16-byte boundaries takes the mma path by default (up to 8 rows); a view whose
    rows are not (or fp32 x) takes the FMA GEMV, with the same result."""
    from paged_backend.kernels.int4_gemm import _mma_ok, _plan

    k, n = 4096, 4136
    base = torch.randn(3, k + 8, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    aligned, unaligned = base[:, :k], base[:, 1:k + 1]
    assert _mma_ok(aligned) and not _mma_ok(unaligned) and not _mma_ok(aligned.float())
    assert _plan(3, n, k, 128, 0, None, False, True).cfg.path == "mma"
    for x in (aligned, unaligned):
        _check_cuda_case(3, k, n, 128, False, None, x=x)


@cuda
@pytest.mark.parametrize("m", [1, 16])
def test_cuda_graph_replays_match_eager(m):
    """The split-K tickets make the launch self-resetting: a captured graph replayed many times
    (and eager calls between replays) gives the eager result every time."""
    from paged_backend.kernels.int4_gemm import int4_gemm

    qweight, scales, zeros, perm = _cuda_int4(4096, 4096, 128, True)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    want = int4_gemm(x, qweight, scales, zeros, 128, perm)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        int4_gemm(x, qweight, scales, zeros, 128, perm, check=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemm(x, qweight, scales, zeros, 128, perm, check=False)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(int4_gemm(x, qweight, scales, zeros, 128, perm), want)
