"""The fused-MoE kernel's fp8 experts under the CPU interpreter, against ``fused_moe_ref``: block-wise
scales (weight_scale_inv per 128 x 128 block, activations per token and per 128 inputs: DeepSeek-V3 /
Qwen3-FP8) and per-output-channel scales (per-token activations: GLM-4.5-FP8), on the pairs path and the
sorted path; M from 1 to ~100, top-k 1..3, experts without tokens, ragged shapes (partial blocks), poisoned
outputs, router weights on the input, a row split over ranks; the activation quantization kernel bit for bit
against its reference; the config picker's fp8 rules and vLLM's table names; the argument errors.

The reference is itself checked against a float64 loop over (token, slot) pairs that dequantizes the
weights and fake-quantizes the activations group by group (written out here, independently)."""

from __future__ import annotations

import pytest
import torch

from paged_backend.kernels.fp8_quant import quantize_fp8_groups
from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, FP8_MAX, quantize_fp8_groups_ref
from paged_backend.kernels.fused_moe import (
    FP8_SELECTOR,
    MoEConfig,
    config_file_name,
    fused_moe,
    pick_config,
    quantize_moe_activations,
)
from paged_backend.kernels.fused_moe_ref import fused_moe_ref, quantize_moe_activations_ref

pytestmark = pytest.mark.usefixtures("poison_uninitialized")

BLOCK = (128, 128)


def _quant_weights(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 [E, N, K], float32 scales [E, ceil(N/bn), ceil(K/bk)] or [E, N]), each block's
    (row's) largest |w| mapped to 448, written out block by block."""
    e, n, k = w.shape
    if block is None:
        scale = w.abs().amax(-1).float() / FP8_MAX
        return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    bn, bk = block
    scale = torch.empty(e, -(-n // bn), -(-k // bk))
    q = torch.empty(e, n, k, dtype=FP8_DTYPE)
    for r in range(scale.shape[1]):
        for c in range(scale.shape[2]):
            blk = w[:, r * bn : (r + 1) * bn, c * bk : (c + 1) * bk]
            scale[:, r, c] = blk.abs().amax(dim=(1, 2)) / FP8_MAX
            q[:, r * bn : (r + 1) * bn, c * bk : (c + 1) * bk] = (blk / scale[:, r, c, None, None]).to(FP8_DTYPE)
    return q, scale


def _dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        return q.double() * scale[..., None].double()
    bn, bk = block
    n, k = q.shape[-2:]
    full = scale.double().repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return q.double() * full


def _fake_quant(v: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float64 values of v's e4m3 activations: per row, per group of bk (block) or the whole row."""
    out = []
    for part in (v.split(block[1], -1) if block else [v]):
        scale = part.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
        out.append((part.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).double() * scale.double())
    return torch.cat(out, -1)


def _loop(x, q13, s13, q2, s2, tw, ids, block, on_input=False):
    """The fp8 contract in float64, one (token, slot) pair at a time (the intermediate in x's dtype)."""
    w13, w2 = _dequant(q13, s13, block), _dequant(q2, s2, block)
    inter = w13.shape[1] // 2
    xq = _fake_quant(x, block)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e, w = int(ids[m, k]), float(tw[m, k])
            y = xq[m] @ w13[e].T * (w if on_input else 1.0)
            y = y.to(x.dtype).double()
            h = (torch.nn.functional.silu(y[:inter]) * y[inter:]).to(x.dtype)
            out[m] += (_fake_quant(h[None], block)[0] @ w2[e].T) * (1.0 if on_input else w)
    return out


def _inputs(m, e, k, dtype, seed, block, h=256, inter=128, experts=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=gen).to(dtype)
    q13, s13 = _quant_weights(torch.randn(e, 2 * inter, h, generator=gen) / h**0.5, block)
    q2, s2 = _quant_weights(torch.randn(e, h, inter, generator=gen) / inter**0.5, block)
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(m)]).to(torch.int32)
    tw = torch.softmax(torch.randn(m, k, generator=gen), -1)
    return x, q13, s13, q2, s2, tw, ids


def _rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


# a flipped e4m3 rounding of the intermediate (fp32 summation order) moves an output row by ~1e-3 of its
# norm; bf16 rounds the intermediate and the output
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2}


def _cfg(block_m, block, block_n=64):
    return MoEConfig(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block[1] if block else 64, num_stages=1)


def _check(m, e, k, dtype, block, config, seed=0, **kw):
    x, q13, s13, q2, s2, tw, ids = _inputs(m, e, k, dtype, seed, block, **{n: v for n, v in kw.items()
                                                                           if n in ("h", "inter", "experts")})
    on_input = kw.get("on_input", False)
    want = fused_moe_ref(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2, block_shape=block,
                         apply_router_weight_on_input=on_input)
    got = fused_moe(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2, block_shape=block, config=config,
                    apply_router_weight_on_input=on_input)
    assert got.shape == x.shape and got.dtype == dtype and not got.isnan().any()
    assert _rel(got, want) < TOL[dtype], (m, e, k, dtype, block, config)
    return x, q13, s13, q2, s2, tw, ids, want


# -- the activation quantization ----------------------------------------------------------------------


@pytest.mark.parametrize("m,k,group", [(1, 256, 128), (7, 200, 128), (33, 96, 32), (3, 1000, 64), (4, 50, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_quantization_is_bit_exact(m, k, group, dtype):
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k)).to(dtype)
    x[0, :group] = 0.0  # an all-zero group: the tiny scale, zeros out
    q, s = quantize_fp8_groups(x, group)
    q_ref, s_ref = quantize_fp8_groups_ref(x, group)
    assert s.shape == (m, -(-k // group)) and s.dtype == torch.float32 and s.is_contiguous()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("block", [BLOCK, None])
def test_moe_activation_quantization_matches_the_reference(block):
    x = torch.randn(9, 384, generator=torch.Generator().manual_seed(1))
    for got, want in zip(quantize_moe_activations(x, block), quantize_moe_activations_ref(x, block), strict=True):
        assert torch.equal(got.view(torch.uint8) if got.dtype == FP8_DTYPE else got,
                           want.view(torch.uint8) if want.dtype == FP8_DTYPE else want)
    # a row split over ranks: the scale is the whole row's (here: the max with a larger "other rank")
    half = lambda a: torch.maximum(a, torch.full_like(a, 7.0))  # noqa: E731
    q, s = quantize_moe_activations(x, None, half)
    assert torch.equal(s, torch.maximum(x.abs().amax(-1, keepdim=True), torch.tensor(7.0)) / FP8_MAX)
    assert torch.equal(q.view(torch.uint8), quantize_moe_activations_ref(x, None, half)[0].view(torch.uint8))


# -- fused_moe over fp8 experts against the reference (and the reference against the float64 loop) --------


CASES = [  # (M, E, top-k, dtype, BLOCK_M)
    (1, 4, 1, torch.float32, 1),
    (1, 8, 3, torch.bfloat16, 1),
    (3, 8, 2, torch.float32, 1),
    (5, 4, 2, torch.bfloat16, 16),
    (17, 8, 1, torch.float32, 16),
    (33, 6, 3, torch.bfloat16, 16),
    (100, 8, 2, torch.float32, 32),
]


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("m,e,k,dtype,block_m", CASES)
def test_fused_moe_fp8_matches_the_reference(m, e, k, dtype, block_m, block):
    _check(m, e, k, dtype, block, _cfg(block_m, block), seed=m + e + k)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_reference_matches_the_float64_loop(block):
    x, q13, s13, q2, s2, tw, ids, want = _check(11, 6, 2, torch.float32, block, _cfg(16, block), seed=4)
    assert _rel(want, _loop(x, q13, s13, q2, s2, tw, ids, block)) < 2e-3
    for on_input in (False, True):
        ref = fused_moe_ref(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2, block_shape=block,
                            apply_router_weight_on_input=on_input)
        assert _rel(ref, _loop(x, q13, s13, q2, s2, tw, ids, block, on_input)) < 2e-3


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("block_m", [1, 16])
def test_experts_without_tokens_and_router_weights_on_the_input(block, block_m):
    _check(6, 8, 2, torch.float32, block, _cfg(block_m, block), seed=3, experts=[1, 6])
    _check(9, 4, 1, torch.bfloat16, block, _cfg(block_m, block), seed=5, on_input=True)


@pytest.mark.parametrize("block_m", [1, 16])
def test_partial_blocks_and_tiles_narrower_than_a_scale_block(block_m):
    """H 200, I 96 (partial k-groups and a partial row block); 32-wide N tiles read their column's scale
    (n // 128); a 64 x 32 block shape (several scale blocks per N tile)."""
    _check(21, 5, 2, torch.float32, BLOCK, _cfg(block_m, BLOCK, block_n=32), seed=7, h=200, inter=96)
    _check(21, 5, 2, torch.float32, (64, 32), _cfg(block_m, (64, 32), block_n=128), seed=8, h=200, inter=96)
    _check(13, 5, 2, torch.float32, None, _cfg(block_m, None, block_n=32), seed=9, h=200, inter=96)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_default_configs_and_both_paths_agree(block):
    """``config=None`` at a decode shape (pairs path) and a prefill shape (sorted), and the other path forced."""
    assert not pick_config(2, 8, 128, 256, torch.float32, top_k=2, fp8=True, block_shape=block).sorted
    for m in (2, 40):
        x, q13, s13, q2, s2, tw, ids, want = _check(m, 8, 2, torch.float32, block, None, seed=m)
        other = fused_moe(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2, block_shape=block,
                          config=_cfg(16 if m == 2 else 1, block))
        assert _rel(other, want) < TOL[torch.float32]


def test_no_tokens():
    x, q13, s13, q2, s2, tw, ids = _inputs(1, 4, 2, torch.float32, 0, BLOCK)
    out = fused_moe(x[:0], q13, q2, tw[:0], ids[:0], w13_scale=s13, w2_scale=s2, block_shape=BLOCK)
    assert out.shape == (0, 256)


# -- config selection --------------------------------------------------------------------------------


def test_pick_config_fp8_rules_and_table_names():
    table = {1: MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64), 512: MoEConfig(BLOCK_M=64, BLOCK_N=256, BLOCK_K=32)}
    for m in (1, 20, 512, 4096):
        assert pick_config(m, 128, 768, 2048, torch.bfloat16, top_k=8, fp8=True, block_shape=BLOCK).BLOCK_K == 128
        assert pick_config(m, 128, 768, 2048, torch.bfloat16, top_k=8, fp8=True, block_shape=BLOCK,
                           table=table).BLOCK_K == 128
    assert pick_config(512, 128, 768, 2048, torch.bfloat16, top_k=8, fp8=True, block_shape=BLOCK,
                       table=table).BLOCK_N == 256  # any BLOCK_N: per-column scale loads
    assert config_file_name(128, 768, "NVIDIA H200", FP8_SELECTOR, BLOCK) == (
        "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")
    assert config_file_name(160, 1536, "NVIDIA H200", FP8_SELECTOR) == (
        "E=160,N=1536,device_name=NVIDIA_H200,dtype=fp8_w8a8.json")


# -- argument errors -----------------------------------------------------------------------------------


def _args(block=BLOCK, **over):
    x, q13, s13, q2, s2, tw, ids = _inputs(3, 4, 2, torch.float32, 0, block)
    args = dict(x=x, w13=q13, w2=q2, topk_weights=tw, topk_ids=ids, w13_scale=s13, w2_scale=s2, block_shape=block)
    args.update(over)
    return args


@pytest.mark.parametrize("over,exc,match", [
    (dict(w13_scale=None), ValueError, "need w13_scale and w2_scale"),
    (dict(w13_scale=torch.ones(4, 1, 2)), ValueError, r"w13_scale must have shape \(4, 2, 2\) \(per block\), "
                                                      r"got \(4, 1, 2\)"),
    (dict(w2_scale=torch.ones(4, 2, 2, dtype=torch.float64)), TypeError, "w2_scale must be float32"),
    (dict(block_shape=(128, 96)), ValueError, "power of two >= 16"),
    (dict(w2=torch.zeros(4, 256, 128)), TypeError, "w2 must have dtype"),
    (dict(config=MoEConfig(BLOCK_M=16, BLOCK_K=64)), ValueError, "BLOCK_K == the scale block's 128 inputs"),
])
def test_fp8_launcher_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        fused_moe(**_args(**over))


def test_channel_scale_shapes_are_checked_and_unquantized_experts_take_no_scales():
    with pytest.raises(ValueError, match=r"w13_scale must have shape \(4, 256\) \(per output feature\)"):
        fused_moe(**_args(block=None, w13_scale=torch.ones(4, 128)))
    x, q13, s13, q2, s2, tw, ids = _inputs(3, 4, 2, torch.float32, 0, None)
    with pytest.raises(ValueError, match="are for e4m3 experts"):
        fused_moe(x, q13.float(), q2.float(), tw, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="are for e4m3 experts"):
        fused_moe_ref(x, q13.float(), q2.float(), tw, ids, w13_scale=s13, w2_scale=s2)


# -- compiled, on the GPU ----------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 4, 300])
def test_compiled_qwen3_moe_shaped(m, dtype, block):
    """Qwen3-30B-A3B-like experts (E 128, top 8, H 2048, I 768) in e4m3, default configs, against the
    reference on the same device (FP8 tensor cores on sm_89+)."""
    x, q13, s13, q2, s2, tw, ids = _inputs(m, 128, 8, torch.float32, m, block, h=2048, inter=768)
    dev = [t.cuda() for t in (x.to(dtype), q13, q2, tw, ids)]
    scales = dict(w13_scale=s13.cuda(), w2_scale=s2.cuda(), block_shape=block)
    got = fused_moe(*dev, **scales)
    want = fused_moe_ref(*dev, **scales)
    # 16-bit activations run the FP8 tensor cores, whose ~14-bit running sums (as vLLM's kernel) move a row
    # by ~1e-2; fp32 activations take exact fp16 MMAs (``fp8_dot_dtype``)
    assert _rel(got.cpu(), want.cpu()) < {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}[dtype]
