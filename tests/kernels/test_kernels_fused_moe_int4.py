"""The fused-MoE kernel's int4 experts (W4A16: GPTQ / AWQ checkpoints repacked into the int4 kernel layout)
under the CPU interpreter, against ``fused_moe_ref``: group sizes 32 / 64 / one group, the pairs path and the
sorted path, M from 1 to ~130, top-k 1..3, experts without tokens, router weights on the input, an expert map,
ragged hidden sizes (a partial k-step), poisoned outputs; the config picker's int4 rule, vLLM's table name and
the argument errors.

The reference is itself checked against a float64 loop over (token, slot) pairs that unpacks the nibbles
(written out here, independently of ``int4_gemm_ref``)."""

from __future__ import annotations

import pytest
import torch

from paged_backend.kernels.fused_moe import INT4_SELECTOR, MoEConfig, config_file_name, fused_moe, pick_config
from paged_backend.kernels.fused_moe_ref import fused_moe_ref
from paged_backend.kernels.int4_gemm_ref import KERNEL_NIBBLE, pack_int4_kernel

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def _experts(e: int, n: int, k: int, group: int, gen: torch.Generator):
    """Random int4 experts: (packed int32 [E, N, K/8], scales [E, G, N], zeros uint8 [E, G, N], codes [E, K, N])."""
    codes = torch.randint(0, 16, (e, k, n), generator=gen)
    g = 1 if group == -1 else k // group
    zeros = torch.randint(4, 12, (e, g, n), generator=gen).to(torch.uint8)
    scales = ((torch.rand(e, g, n, generator=gen) * 0.5 + 0.75) / (21.5 * k) ** 0.5).half()  # fp16, as GPTQ stores
    packed = torch.stack([pack_int4_kernel(codes[i]) for i in range(e)])
    return packed, scales, zeros, codes


def _inputs(m, e, k, dtype, seed, group, h=128, inter=64, experts=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=gen).to(dtype)
    w13 = _experts(e, 2 * inter, h, group, gen)
    w2 = _experts(e, h, inter, group, gen)
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(m)]).to(torch.int32)
    tw = torch.softmax(torch.randn(m, k, generator=gen), -1)
    return x, w13, w2, tw, ids


def _kwargs(w13, w2, group):
    return dict(w13_scale=w13[1], w2_scale=w2[1], w13_zeros=w13[2], w2_zeros=w2[2], group_size=group)


def _rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


# the kernel scales the exact q - z product in fp32, the reference rounds W to x.dtype first: bf16 differs by
# that rounding (~2^-9 a weight) and the rounded intermediate; fp32 by summation order only
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _cfg(block_m, group, block_n=64):
    return MoEConfig(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(64, group) if group != -1 else 64, num_stages=1)


def _check(m, e, k, dtype, group, config, seed=0, on_input=False, expert_map=None, **shape):
    x, w13, w2, tw, ids = _inputs(m, e, k, dtype, seed, group, **shape)
    kw = _kwargs(w13, w2, group)
    want = fused_moe_ref(x, w13[0], w2[0], tw, ids, apply_router_weight_on_input=on_input, expert_map=expert_map,
                         **kw)
    got = fused_moe(x, w13[0], w2[0], tw, ids, config=config, apply_router_weight_on_input=on_input,
                    expert_map=expert_map, **kw)
    assert got.shape == x.shape and got.dtype == dtype and not got.isnan().any()
    assert _rel(got, want) < TOL[dtype], (m, e, k, dtype, group, config)
    return x, w13, w2, tw, ids, want


def _loop(x, w13, w2, tw, ids, group, on_input=False):
    """The int4 contract in float64, one (token, slot) pair at a time, from the codes (the intermediate in
    x's dtype)."""

    def dense(w):  # [E, N, K] float64 (W as the reference rounds it: once, to x.dtype)
        packed, scales, zeros, codes = w
        k = codes.shape[1]
        g = torch.arange(k) // (k if group == -1 else group)
        deq = (codes.double() - zeros.double()[:, g, :]) * scales.double()[:, g, :]
        return deq.to(x.dtype).double().transpose(1, 2)

    d13, d2 = dense(w13), dense(w2)
    inter = d13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e, w = int(ids[m, k]), float(tw[m, k])
            y = (x[m].double() * (w if on_input else 1.0)).to(x.dtype).double() @ d13[e].T
            y = y.to(x.dtype).double()
            h = (torch.nn.functional.silu(y[:inter]) * y[inter:]).to(x.dtype).double()
            out[m] += (h @ d2[e].T) * (1.0 if on_input else w)
    return out


def test_the_packing_puts_column_c_in_its_nibble():
    """The layout the loaders repack into: word r of output row n holds input 8r + c at nibble KERNEL_NIBBLE[c]."""
    codes = torch.randint(0, 16, (16, 3), generator=torch.Generator().manual_seed(0))
    packed = pack_int4_kernel(codes)
    assert packed.shape == (3, 2) and packed.dtype == torch.int32
    for n in range(3):
        for k in range(16):
            assert (int(packed[n, k // 8]) >> (4 * KERNEL_NIBBLE[k % 8])) & 0xF == int(codes[k, n])


CASES = [  # (M, E, top-k, dtype, BLOCK_M)
    (1, 4, 1, torch.float32, 1),
    (1, 8, 3, torch.bfloat16, 1),
    (3, 8, 2, torch.float32, 1),
    (5, 4, 2, torch.bfloat16, 16),
    (17, 8, 1, torch.float32, 16),
    (33, 6, 3, torch.bfloat16, 16),
    (130, 8, 2, torch.float32, 32),
]


@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("m,e,k,dtype,block_m", CASES)
def test_fused_moe_int4_matches_the_reference(m, e, k, dtype, block_m, group):
    _check(m, e, k, dtype, group, _cfg(block_m, group), seed=m + e + k)


@pytest.mark.parametrize("group", [32, -1])
def test_reference_matches_the_float64_loop(group):
    x, w13, w2, tw, ids, want = _check(11, 6, 2, torch.float32, group, _cfg(16, group), seed=4)
    assert _rel(want, _loop(x, w13, w2, tw, ids, group)) < 1e-5
    xb = x.to(torch.bfloat16)
    for on_input in (False, True):
        ref = fused_moe_ref(xb, w13[0], w2[0], tw, ids, apply_router_weight_on_input=on_input,
                            **_kwargs(w13, w2, group))
        assert _rel(ref, _loop(xb, w13, w2, tw, ids, group, on_input)) < 1e-2


@pytest.mark.parametrize("block_m", [1, 16])
def test_experts_without_tokens_router_weights_on_the_input_and_an_expert_map(block_m):
    _check(6, 8, 2, torch.float32, 32, _cfg(block_m, 32), seed=3, experts=[1, 6])
    _check(9, 4, 1, torch.bfloat16, 64, _cfg(block_m, 64), seed=5, on_input=True)
    # this rank holds global experts 4..7 as its 0..3: the others' pairs add nothing
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    x, w13, w2, tw, ids = _inputs(7, 4, 2, torch.float32, 6, 32)
    ids = ids + 4 * (torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.5)
    kw = _kwargs(w13, w2, 32)
    want = fused_moe_ref(x, w13[0], w2[0], tw, ids, expert_map=expert_map, **kw)
    got = fused_moe(x, w13[0], w2[0], tw, ids, expert_map=expert_map, config=_cfg(block_m, 32), **kw)
    assert _rel(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("block_m", [1, 16])
def test_a_partial_k_step_and_narrow_tiles(block_m):
    """H 200 in one group (the last k-step's words past H masked), and 32-wide N tiles over 64-input groups."""
    _check(7, 5, 2, torch.float32, -1, _cfg(block_m, -1), seed=7, h=200, inter=96)
    _check(5, 5, 2, torch.float32, 64, _cfg(block_m, 64, block_n=32), seed=9, h=192, inter=128)


def test_default_configs_keep_the_reduction_step_inside_a_group():
    for m in (1, 5, 40, 4096):
        for group in (32, 64, 128):
            assert pick_config(m, 128, 768, 2048, torch.bfloat16, top_k=8, int4_group=group).BLOCK_K <= group
    assert pick_config(1, 8, 64, 128, torch.float32, top_k=2, int4_group=-1) == pick_config(1, 8, 64, 128,
                                                                                            torch.float32, top_k=2)
    for m in (2, 40):  # config=None: the pairs path at decode, the sorted one beyond
        _check(m, 8, 2, torch.float32, 32, None, seed=m)
    assert (config_file_name(128, 768, "NVIDIA H200", INT4_SELECTOR)
            == "E=128,N=768,device_name=NVIDIA_H200,dtype=int4_w4a16.json")


def test_argument_errors_name_the_argument():
    x, w13, w2, tw, ids = _inputs(3, 4, 2, torch.float32, 0, 32)
    kw = _kwargs(w13, w2, 32)
    with pytest.raises(ValueError, match="need w13_scale, w2_scale, w13_zeros, w2_zeros and group_size"):
        fused_moe(x, w13[0], w2[0], tw, ids, **{**kw, "w2_zeros": None})
    with pytest.raises(ValueError, match=r"w13_zeros must have shape \(4, 4, 128\)"):
        fused_moe(x, w13[0], w2[0], tw, ids, **{**kw, "w13_zeros": kw["w13_zeros"][:, :2]})
    with pytest.raises(ValueError, match="group_size 48 must be -1 or divide both"):
        fused_moe_ref(x, w13[0], w2[0], tw, ids, **{**kw, "group_size": 48})
    with pytest.raises(TypeError, match="w2_zeros must be uint8"):
        fused_moe(x, w13[0], w2[0], tw, ids, **{**kw, "w2_zeros": kw["w2_zeros"].int()})
    with pytest.raises(TypeError, match="w2 must be int32"):
        fused_moe_ref(x, w13[0], w2[0].float(), tw, ids, **kw)
    with pytest.raises(ValueError, match="are for int4 .* experts"):
        fused_moe_ref(x, torch.zeros(4, 128, 128), torch.zeros(4, 128, 64), tw, ids, group_size=32)
    with pytest.raises(ValueError, match="w2 must have shape"):
        fused_moe(x, w13[0], w2[0][:, :, :4].contiguous(), tw, ids, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("group", [128, -1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 4, 300])
def test_compiled_qwen3_moe_shaped(m, dtype, group):
    """Qwen3-30B-A3B-GPTQ-Int4-like experts (E 128, top 8, H 2048, I 768, groups of 128), default configs,
    against the reference on the same device (16-bit activations: two nibbles dequantized per instruction)."""
    x, w13, w2, tw, ids = _inputs(m, 128, 8, torch.float32, m, group, h=2048, inter=768)
    dev = [t.cuda() for t in (x.to(dtype), w13[0], w2[0], tw, ids)]
    kw = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in _kwargs(w13, w2, group).items()}
    got = fused_moe(*dev, **kw)
    want = fused_moe_ref(*dev, **kw)
    assert _rel(got.cpu(), want.cpu()) < {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}[dtype]
