"""Triton RMSNorm (+ fused residual add), rotary (neox or interleaved, partial, llama3 scaling) and SiLU-and-mul
against their references. Tolerances are in units of the dtype's epsilon."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from paged_backend.kernels.activation import silu_and_mul  # noqa: E402
from paged_backend.kernels.activation_ref import silu_and_mul_ref  # noqa: E402
from paged_backend.kernels.rms_norm import rms_norm  # noqa: E402
from paged_backend.kernels.rms_norm_ref import rms_norm_ref  # noqa: E402
from paged_backend.kernels.rotary import rotary  # noqa: E402
from paged_backend.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_ref  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEVICE = torch.device("cuda" if CUDA else "cpu")
BIG = 64 if CUDA else 1
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def rand(shape, dtype, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


# -- RMSNorm --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    x = rand((5 * BIG, hidden), dtype, 0, 3.0)
    w = rand((hidden,), dtype, 1)
    res = rand((5 * BIG, hidden), dtype, 2) if with_residual else None
    out, new_res = rms_norm(x, w, 1e-5, res)
    ref, ref_res = rms_norm_ref(x.cpu(), w.cpu(), 1e-5, None if res is None else res.cpu())
    assert out.dtype == ref.dtype and not out.isnan().any()
    # the residual add is one rounding in both: bit-exact
    if with_residual:
        assert torch.equal(new_res.cpu(), ref_res)
    else:
        assert new_res is None
    # the mean of squares sums in another order (a few fp32 ulps over hundreds of terms); in
    # bf16/fp16 that can flip the rounding of the normed value, then of the product with weight
    tol = 8 * eps(dtype) if dtype == torch.float32 else 2 * eps(dtype)
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)


def test_rms_norm_leading_dims_and_promotion():
    x = rand((2, 3, 64), torch.bfloat16, 3)
    w = rand((64,), torch.float32, 4)  # fp32 weight promotes the output, as in the reference
    out, _ = rms_norm(x, w, 1e-6)
    ref, _ = rms_norm_ref(x.cpu(), w.cpu(), 1e-6)
    assert out.shape == (2, 3, 64) and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, rtol=2 * eps(torch.bfloat16), atol=2 * eps(torch.bfloat16))
    empty, _ = rms_norm(x[:, :0], w, 1e-6)
    assert empty.shape == (2, 0, 64)


def test_rms_norm_errors():
    x = rand((3, 64), torch.float32, 5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, rand((32,), torch.float32, 6), 1e-6)
    with pytest.raises(TypeError, match="residual"):
        rms_norm(x, x[0], 1e-6, x.half())


# -- rotary ---------------------------------------------------------------------------

SCALINGS = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 80)])
@pytest.mark.parametrize("scaling,q_scale", [("default", None), ("llama3", None), ("default", 0.18033688)])
def test_rotary(dtype, heads, kv_heads, head_dim, scaling, q_scale):
    t = 6 * BIG
    # q, k as views of a fused qkv projection output, like the model passes them
    qkv = rand((t, heads + 2 * kv_heads, head_dim), dtype, 7)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    table = rope_cos_sin_cache(rope_inv_freq(head_dim, 10000.0, SCALINGS[scaling]), 2048).to(DEVICE)
    g = torch.Generator().manual_seed(8)
    pos = torch.randint(0, 2048, (t,), generator=g).to(DEVICE)
    qo, ko = rotary(pos, q, k, table, q_scale)
    qr, kr = rotary_ref(pos.cpu(), q.cpu(), k.cpu(), table.cpu(), q_scale)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    if q_scale is not None:  # the rounded rotation times the scale, rounded again (torch.mul)
        assert torch.equal(qr, torch.mul(rotary_ref(pos.cpu(), q.cpu(), k.cpu(), table.cpu())[0], q_scale))
    # every product and sum is rounded as torch rounds them (bit-exact in the interpreter); compiled,
    # a product and the sum may fuse into one FMA: one rounding of the dtype apart
    torch.testing.assert_close(qo.cpu(), qr, rtol=eps(dtype), atol=eps(dtype))
    torch.testing.assert_close(ko.cpu(), kr, rtol=eps(dtype), atol=eps(dtype))
    if not CUDA:
        assert torch.equal(qo, qr) and torch.equal(ko, kr)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 32), (80, 40), (48, 16)])
@pytest.mark.parametrize("q_scale", [None, 0.18033688])
def test_rotary_interleaved_and_partial(dtype, interleaved, head_dim, rotary_dim, q_scale):
    """Pairs (2i, 2i+1) or neox halves of the first ``rotary_dim`` dims (the table's width) rotated, the
    rest copied (times q_scale for q): bit-exact with the reference in the interpreter."""
    t = 5 * BIG
    qkv = rand((t, 4 + 2 * 2, head_dim), dtype, 13)
    q, k = qkv[:, :4], qkv[:, 4:6]
    table = rope_cos_sin_cache(rope_inv_freq(rotary_dim, 10000.0), 1024).to(DEVICE)
    pos = torch.randint(0, 1024, (t,), generator=torch.Generator().manual_seed(14)).to(DEVICE)
    qo, ko = rotary(pos, q, k, table, q_scale, interleaved=interleaved)
    qr, kr = rotary_ref(pos.cpu(), q.cpu(), k.cpu(), table.cpu(), q_scale, interleaved=interleaved)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    # the passed-through dims are the input's (q's times the scale, rounded once)
    want_pass = q.cpu()[..., rotary_dim:] if q_scale is None else torch.mul(q.cpu()[..., rotary_dim:], q_scale)
    assert torch.equal(qr[..., rotary_dim:], want_pass) and torch.equal(kr[..., rotary_dim:], k.cpu()[..., rotary_dim:])
    torch.testing.assert_close(qo.cpu(), qr, rtol=eps(dtype), atol=eps(dtype))
    torch.testing.assert_close(ko.cpu(), kr, rtol=eps(dtype), atol=eps(dtype))
    if not CUDA:
        assert torch.equal(qo, qr) and torch.equal(ko, kr)


def test_rotary_interleaved_pairs_adjacent_dims():
    """Interleaved: dims (2i, 2i+1) turn together by frequency i; at position 0 nothing moves."""
    q = rand((2, 1, 8), torch.float32, 15)
    k = rand((2, 1, 8), torch.float32, 16)
    table = rope_cos_sin_cache(rope_inv_freq(4, 10000.0), 8).to(DEVICE)
    pos = torch.tensor([0, 3], device=DEVICE)
    qo, ko = rotary(pos, q, k, table, interleaved=True)
    assert torch.equal(qo[0], q[0]) and torch.equal(ko[0], k[0])
    cos, sin = table[3, :2], table[3, 2:]
    x = q[1, 0]
    want = torch.stack([x[0:4:2] * cos - x[1:4:2] * sin, x[1:4:2] * cos + x[0:4:2] * sin], dim=-1).flatten()
    torch.testing.assert_close(qo[1, 0, :4], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qo[1, 0, 4:], x[4:])


def test_rotary_errors():
    q = rand((3, 4, 64), torch.float32, 9)
    k = rand((3, 2, 64), torch.float32, 10)
    table = torch.zeros((16, 64), device=DEVICE)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary(torch.arange(3, device=DEVICE), q, k, torch.zeros((16, 66), device=DEVICE))
    with pytest.raises(ValueError, match="cos_sin_cache.*even"):
        rotary(torch.arange(3, device=DEVICE), q, k, table[:, :31])
    with pytest.raises(TypeError, match="positions"):
        rotary(torch.arange(3, device=DEVICE).float(), q, k, table)
    with pytest.raises(TypeError, match="key"):
        rotary(torch.arange(3, device=DEVICE), q, k.half(), table)
    qo, ko = rotary(torch.arange(0, device=DEVICE), q[:0], k[:0], table)
    assert qo.shape == (0, 4, 64) and ko.shape == (0, 2, 64)


# -- SiLU-and-mul -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 96), (3, 5, 2 * 64), (1, 2 * 1536), (0, 128)])
def test_silu_and_mul(dtype, shape):
    shape = (shape[0] * BIG, *shape[1:])
    x = rand(shape, dtype, 11, 4.0)
    out = silu_and_mul(x)
    ref = silu_and_mul_ref(x.cpu())
    assert out.shape == ref.shape and out.dtype == dtype and not out.isnan().any()
    # exp/sigmoid differ by an ulp or two in fp32; in bf16/fp16 that may flip silu's rounding
    tol = 4 * eps(dtype) if dtype == torch.float32 else 2 * eps(dtype)
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)


def test_silu_and_mul_errors():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(rand((2, 7), torch.float32, 12))
    with pytest.raises(TypeError, match="dtype"):
        silu_and_mul(torch.ones((2, 8), dtype=torch.int32, device=DEVICE))
