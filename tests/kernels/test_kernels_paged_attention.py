"""Triton paged attention against the torch reference (interpreter on CPU, full size on CUDA).

Batches mix decode, prefill, chunked prefill and prefix-cache hits; caches are random
everywhere (a wrong block or position changes the result) and outputs start as NaN.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

import paged_backend.kernels.paged_attention as pa  # noqa: E402
from paged_backend.kernels.cache_write import write_kv_cache  # noqa: E402
from paged_backend.kernels.cache_write_ref import FP8_DTYPE, quantize_fp8  # noqa: E402
from paged_backend.kernels.paged_attention import AttentionConfig, paged_attention  # noqa: E402
from paged_backend.kernels.paged_attention_ref import paged_attention_ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = torch.device("cuda" if CUDA else "cpu")
BIG = 16 if CUDA else 1  # context lengths scale up on the GPU
# ||out - ref|| / ||ref|| and elementwise (atol, rtol) per output dtype
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1e-2, 3e-2)}


pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def make_batch(
    reqs: list[tuple[int, int]],  # (cached context, new tokens) per request
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    fp8: bool = False,
    seed: int = 0,
    spare_blocks: int = 7,
    kv_cache: torch.Tensor | None = None,
    block_ids: list[int] | None = None,
):
    """Random q, a random cache and block tables of distinct shuffled blocks (never block 0)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    nblk = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(max(nblk), 1) + 2  # padded with the null block
    total = sum(nblk)
    if kv_cache is None:
        num_blocks = total + spare_blocks + 1
        shape = (2, num_blocks, block_size, kv_heads, head_dim)
        data = torch.randn(shape, generator=g) * 2.0
        kv_cache = data.to(FP8_DTYPE) if fp8 else data.to(dtype)
        ids = (torch.randperm(num_blocks - 1, generator=g)[:total] + 1).tolist()
    else:
        ids = block_ids
    bt = torch.zeros((len(reqs), max_blocks), dtype=torch.int32)
    i = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = torch.tensor(ids[i : i + n], dtype=torch.int32)
        i += n
    t = sum(q for _, q in reqs)
    q = torch.randn((t, heads, head_dim), generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor([q for _, q in reqs]).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    dev = DEVICE
    return q.to(dev), kv_cache.to(dev), bt.to(dev), sl.to(dev), qsl.to(dev)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "unwritten (NaN) output elements"
    rel_tol, rtol = TOL[dtype]
    o, r = out.float().cpu(), ref.float().cpu()
    assert r.norm() > 0
    err = ((o - r).norm() / r.norm()).item()
    assert err < rel_tol, f"relative error {err:.3e} >= {rel_tol}"
    torch.testing.assert_close(o, r, atol=rtol, rtol=rtol)


def run_both(q, kv, bt, sl, qsl, scale, ks=None, vs=None, window=None, **kw):
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, kv, bt, sl, qsl, scale, ks, vs, window, out=out, **kw)
    assert got is out
    ref = paged_attention_ref(q.cpu(), kv.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), scale,
                              None if ks is None else ks.cpu(), None if vs is None else vs.cpu(), window)
    return out, ref


def scaled(reqs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(c * BIG, q if q == 1 else q * BIG) for c, q in reqs]


# decode (incl. a page-boundary and a first-token decode), fresh prefill, chunked prefill / prefix hit
MIXED = [(37, 1), (0, 19), (23, 9), (64, 1), (0, 1), (5, 3)]
DECODE = [(37, 1), (64, 1), (0, 1), (130, 1)]

SHAPES = [  # heads, kv_heads, head_dim, block_size, dtype
    (4, 4, 64, 16, torch.float32),  # GQA ratio 1
    (9, 3, 64, 32, torch.bfloat16),  # ratio 3 (SmolLM2)
    (8, 2, 128, 16, torch.bfloat16),  # ratio 4, head_dim 128
    (6, 2, 80, 64, torch.float16),  # ratio 3, head_dim 80 (padded to 128)
    (4, 1, 96, 16, torch.float32),  # ratio 4, head_dim 96
    (16, 1, 64, 32, torch.bfloat16),  # ratio 16
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", SHAPES)
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_matches_reference(heads, kv_heads, head_dim, block_size, dtype, batch):
    reqs = scaled(MIXED if batch == "mixed" else DECODE)
    q, kv, bt, sl, qsl = make_batch(reqs, heads, kv_heads, head_dim, block_size, dtype)
    out, ref = run_both(q, kv, bt, sl, qsl, head_dim**-0.5, num_splits=1)
    check(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_context_splits(num_splits, batch):
    """Flash-decoding path: partial softmax per context split, merged by the reduce kernel."""
    reqs = scaled([(300, 1), (2, 1), (130, 1)] if batch == "decode" else [(300, 1), (0, 20), (90, 9)])
    q, kv, bt, sl, qsl = make_batch(reqs, 6, 2, 64, 16, torch.bfloat16, seed=1)
    out, ref = run_both(q, kv, bt, sl, qsl, 0.125, num_splits=num_splits)
    check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("batch,fp8", [("mixed", False), ("mixed", True), ("decode", False), ("decode", True)])
def test_q_scaled(batch, fp8):
    """q already multiplied by the softmax scale x log2(e) (the engine's rotary does it, with
    ``query_prescale``'s factor): where the launcher would fold it (prefill), the same bits out;
    on a decode config (which scales scores instead) still the reference's result."""
    reqs = scaled(MIXED if batch == "mixed" else DECODE)
    dtype = torch.bfloat16
    q, kv, bt, sl, qsl = make_batch(reqs, 8, 2, 64, 16, dtype, fp8=fp8, seed=4)
    ks, vs = (torch.tensor(0.7, device=DEVICE), torch.tensor(1.3, device=DEVICE)) if fp8 else (None, None)
    qlens = [n for _, n in reqs]
    mq, ms = max(qlens), int(sl.max())
    factor = pa.query_prescale(q, kv, 0.125, mq, ms)
    if batch == "decode":
        assert factor is None
        factor = 0.125 * pa.LOG2E
    else:
        assert factor == 0.125 * pa.LOG2E
    kw = dict(max_query_len=mq, max_seq_len=ms)
    out = paged_attention(torch.mul(q, factor), kv, bt, sl, qsl, 0.125, ks, vs, out=torch.full_like(q, float("nan")),
                          q_scaled=True, **kw)
    ref = paged_attention_ref(q.cpu(), kv.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), 0.125,
                              None if ks is None else ks.cpu(), None if vs is None else vs.cpu())
    check(out, ref, dtype)
    if batch == "mixed":
        assert torch.equal(out, paged_attention(q, kv, bt, sl, qsl, 0.125, ks, vs, **kw))


@pytest.mark.parametrize("window,num_splits", [(1, 1), (8, 1), (40, 1), (40, 3)])
def test_sliding_window(window, num_splits):
    reqs = scaled([(70, 1), (0, 30), (45, 20), (3, 1)])
    q, kv, bt, sl, qsl = make_batch(reqs, 4, 2, 64, 16, torch.float32, seed=2)
    out, ref = run_both(q, kv, bt, sl, qsl, 0.125, window=window * BIG, num_splits=num_splits)
    check(out, ref, torch.float32)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,num_splits",
    [
        (9, 3, 64, 16, torch.bfloat16, 1),
        (8, 2, 128, 32, torch.float32, 1),
        (8, 2, 128, 32, torch.bfloat16, 3),
    ],
)
def test_fp8_cache(heads, kv_heads, head_dim, block_size, dtype, num_splits):
    """e4m3 cache dequantized in the kernel with k_scale / v_scale."""
    reqs = scaled([(50, 1), (0, 17), (33, 6), (96, 1)])
    q, kv, bt, sl, qsl = make_batch(reqs, heads, kv_heads, head_dim, block_size, dtype, fp8=True, seed=3)
    assert kv.dtype == FP8_DTYPE
    ks = torch.tensor(0.37, device=DEVICE)
    vs = torch.tensor(1.9, device=DEVICE)
    out, ref = run_both(q, kv, bt, sl, qsl, head_dim**-0.5, ks, vs, num_splits=num_splits)
    check(out, ref, dtype)
    # the scales matter: without them the result is different
    plain = paged_attention_ref(q.cpu(), kv.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), head_dim**-0.5)
    assert not torch.allclose(plain.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_fp8_pairs_decode_padded_head_dim(head_dim):
    """The fp8 decode default (int16 pairs) with a head dim padded to a power of two: the half
    columns past head_dim / 2 are masked (decode-only batch, so the launcher picks the pairs)."""
    reqs = scaled([(50, 1), (17, 1), (96, 1), (3, 1)])
    q, kv, bt, sl, qsl = make_batch(reqs, 8, 2, head_dim, 16, torch.bfloat16, fp8=True, seed=21)
    assert pa.pick_config(1, 4, head_dim, 1, 2).fp8_pairs
    ks, vs = torch.tensor(0.61, device=DEVICE), torch.tensor(1.3, device=DEVICE)
    out, ref = run_both(q, kv, bt, sl, qsl, head_dim**-0.5, ks, vs, num_splits=2)
    check(out, ref, torch.bfloat16)


@pytest.mark.parametrize(
    "config,block_size",
    [
        (AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2), 64),  # tile inside a page
        (AttentionConfig(block_m=16, tile_n=128, num_warps=4, num_stages=2), 16),  # tile over 8 pages
        (AttentionConfig(block_m=32, tile_n=32, num_warps=4, num_stages=2), 32),
    ],
)
def test_tile_configs(config, block_size):
    """Small query tiles split a prefill into many tiles; KV tiles smaller and larger than a page."""
    reqs = scaled([(0, 23), (40, 1), (17, 12)])
    q, kv, bt, sl, qsl = make_batch(reqs, 6, 2, 64, block_size, torch.float32, seed=4)
    out, ref = run_both(q, kv, bt, sl, qsl, 0.125, config=config, num_splits=1)
    check(out, ref, torch.float32)


VARIANTS = {  # AttentionConfig overrides of the code-path variants (module docstring)
    "fold_launcher": dict(q_fold=2),
    "off32": dict(offsets32=True),
    "all": dict(q_fold=2, offsets32=True, maxnreg=128),
    "pairs": dict(fp8_pairs=True),
    "pairs_all": dict(fp8_pairs=True, q_fold=2, offsets32=True),
    "reduce_block": dict(reduce_block=2),  # splits merged two at a time (a chunk with one split absent)
    "reduce_block_pdl": dict(reduce_block=64, pdl=True),  # programmatic dependent launch on CUDA
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,fp8,num_splits",
    [
        (9, 3, 64, 16, torch.bfloat16, False, 1),
        (8, 2, 128, 32, torch.float32, False, 3),  # context splits, merged by the reduce kernel
        (6, 2, 80, 64, torch.float16, False, 2),  # head_dim padded to 128
        (8, 2, 64, 16, torch.bfloat16, True, 3),  # fp8 cache with scales
    ],
)
def test_variants_match_reference(variant, heads, kv_heads, head_dim, block_size, dtype, fp8, num_splits):
    """Every code-path variant computes the same attention as the reference (mixed batch)."""
    reqs = scaled([(50, 1), (0, 17), (33, 6), (96, 1), (3, 1)])
    q, kv, bt, sl, qsl = make_batch(reqs, heads, kv_heads, head_dim, block_size, dtype, fp8=fp8, seed=11)
    ks = torch.tensor(0.37, device=DEVICE) if fp8 else None
    vs = torch.tensor(1.9, device=DEVICE) if fp8 else None
    block_m = max(16, heads // kv_heads * 4)
    cfg = AttentionConfig(block_m=16 if block_m <= 16 else 32, tile_n=32, num_warps=4, num_stages=2,
                          **VARIANTS[variant])
    out, ref = run_both(q, kv, bt, sl, qsl, head_dim**-0.5, ks, vs, num_splits=num_splits, config=cfg)
    check(out, ref, dtype)


@pytest.mark.parametrize("num_splits,block", [(9, 64), (21, 4), (8, 4)])
@pytest.mark.parametrize("fp8", [False, True])
def test_split_merge_in_blocks(num_splits, block, fp8):
    """Past 8 splits the merge kernel reads ``reduce_block`` of them per load (chunks with absent
    and empty splits: short requests leave most splits without a tile); up to 8 one by one.
    On CUDA it is launched as a programmatic dependent of the attention kernel."""
    q, kv, bt, sl, qsl = make_batch(scaled([(300, 1), (17, 1), (0, 1), (129, 1)]), 8, 2, 64, 16, torch.bfloat16,
                                    fp8=fp8, seed=21)
    ks, vs = (torch.tensor(0.5, device=DEVICE), torch.tensor(1.5, device=DEVICE)) if fp8 else (None, None)
    cfg = AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2, reduce_block=block, pdl=True,
                          fp8_pairs=fp8)
    out, ref = run_both(q, kv, bt, sl, qsl, 0.125, ks, vs, num_splits=num_splits, config=cfg)
    check(out, ref, torch.bfloat16)


def test_pdl_needs_hopper_and_a_triton_with_gdc(monkeypatch):
    """Programmatic dependent launch only where Triton has ``gdc_wait`` (3.3+) and the GPU is sm_90+;
    elsewhere a ``pdl`` config launches the merge kernel plainly (older Tritons import fine)."""
    monkeypatch.setattr(pa, "_DEVICE_FACTS", {})
    monkeypatch.setattr(pa, "gdc_wait", None)
    assert not pa._has_pdl(torch.device("cuda", 0))


def test_num_splits_follow_the_occupancy():
    """Context splits aim at ``programs_per_sm`` programs per SM, each split keeping 2+ KV tiles."""
    assert pa.pick_num_splits(64, 32768, 128, 132) == 4  # 2 per SM: 264 // 64
    assert pa.pick_num_splits(64, 32768, 128, 132, 4) == 8  # 528 // 64
    assert pa.pick_num_splits(8, 32768, 128, 132, 4) == 64  # capped at 64
    assert pa.pick_num_splits(8, 4096, 128, 132, 4) == 16  # 32 tiles: 2 per split
    assert pa.pick_num_splits(64, 32768, 128, None, 4) == 1  # the CPU
    cfg = dataclasses.replace(pa.pick_config(1, 4, 128, baseline=True), programs_per_sm=3)
    assert pa.launch_plan(8, 8, 1, 32768, 32, 8, 128, 2, 2, sms=132, config=cfg)[1] == 6


class _LaunchSpy:
    """Stands in for a Triton kernel in the launcher's module and counts its launches."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)


def test_pick_config_regimes():
    """The measured winners per regime (module docstring, docs/BENCHMARKS.md "Variant sweep")."""
    base = pa.pick_config(1, 4, 128, baseline=True)
    assert (base.block_m, base.tile_n, base.num_warps, base.num_stages) == (16, 128, 4, 3)
    assert not (base.offsets32 or base.q_fold or base.maxnreg or base.reduce_block or base.pdl or base.fp8_pairs)
    assert base.programs_per_sm == 2
    # decode: int32 offsets, merge kernel in blocks past 8 splits, launched programmatically dependent
    merge = dataclasses.replace(base, offsets32=True, reduce_block=pa.MERGE_BLOCK, pdl=True)
    assert pa.pick_config(1, 4, 128, 2, 2) == merge  # bf16 cache
    assert pa.pick_config(1, 3, 64, 2, 2) == merge
    fp8 = pa.pick_config(1, 4, 128, 1, 2)  # fp8 cache: int16 pairs, 128 registers, splits for 4 programs per SM
    assert fp8 == dataclasses.replace(merge, fp8_pairs=True, maxnreg=128, programs_per_sm=4)
    assert not pa.pick_config(1, 4, 128, 1, 4).fp8_pairs  # fp32 q
    assert not pa.pick_config(1, 4, 128, 1, 2, baseline=True).fp8_pairs
    f32_decode = pa.pick_config(1, 4, 128, 4, 4)  # fp32: no variant flags
    assert not (f32_decode.offsets32 or f32_decode.reduce_block or f32_decode.pdl or f32_decode.fp8_pairs)
    # prefill, bf16, KV extent up to 4k: 128-row q tiles, 32-position KV tiles, 5 stages, 128 registers
    for n, ctx in ((2048, None), (4096, None), (33, 4000), (17, None)):
        short = pa.pick_config(n, 4, 128, max_seq_len=ctx)
        assert (short.block_m, short.tile_n, short.num_warps, short.num_stages, short.maxnreg) == (128, 32, 8, 5, 128)
        assert short.q_fold == 2 and short.offsets32 and not short.pdl
    # past 4k with more than 128 query rows: 256-row q tiles over 64-position KV tiles, 3 stages
    for n, ctx in ((8192, None), (4097, None), (33, 30_000), (512, 30_000)):
        big = pa.pick_config(n, 4, 128, max_seq_len=ctx)
        assert (big.block_m, big.tile_n, big.num_warps, big.num_stages, big.maxnreg) == (256, 64, 8, 3, 0)
        assert big.q_fold == 2 and big.offsets32
    # a short chunk (<= 128 query rows) over a long context: 128-row tiles, 128-position KV tiles
    chunk = pa.pick_config(32, 4, 128, max_seq_len=30_000)
    assert (chunk.block_m, chunk.tile_n, chunk.num_stages, chunk.maxnreg) == (128, 128, 5, 0)
    assert pa.pick_config(17, 3, 64, max_seq_len=4096).tile_n == 32
    assert pa.pick_config(17, 3, 64, max_seq_len=4097).tile_n == 128
    # fp32 queries keep the baseline tile shape (FMA dots: the older, fully buffered estimate)
    f32 = pa.pick_config(8192, 4, 128, 4, 4)
    assert (f32.tile_n, f32.num_stages, f32.maxnreg) == (64, 2, 0) and f32.q_fold == 2 and f32.offsets32
    assert pa.pick_config(8192, 4, 128, 4, 4, baseline=True).tile_n == 64


def test_pick_config_shared_memory():
    """Triton 3.6 allocates stages-2 K/V buffers (the K/V loads wait on the block-id load):
    5 stages of 128/128 bf16 tiles need 231,424 B, inside the H200's 232,448, so the shrink
    loop must keep them; a smaller budget still shrinks stages, then the tile."""
    assert pa.smem_bytes(128, 128, 5, 128) == 231_424 <= pa.SMEM_BUDGET == 232_448
    assert pa.smem_bytes(128, 128, 6, 128) > pa.SMEM_BUDGET
    for cfg in (pa.pick_config(32, 4, 128, max_seq_len=8192), pa.pick_config(32, 4, 128, 1, 2, max_seq_len=8192),
                pa.pick_config(32, 4, 80)):
        assert cfg.num_stages == 5
    for budget in (160 * 1024, 100 * 1024, 48 * 1024):
        cfg = pa.pick_config(32, 4, 128, max_seq_len=8192, smem_budget=budget)  # 128 / 128, 5 stages
        assert pa.smem_bytes(cfg.block_m, cfg.tile_n, cfg.num_stages, 128) <= budget
        assert cfg.num_stages < 5 and (cfg.num_stages == 2 or cfg.tile_n == 128)
        big = pa.pick_config(8192, 4, 128, smem_budget=budget)  # 256 / 64, 3 stages: 98,816 B
        assert pa.smem_bytes(big.block_m, big.tile_n, big.num_stages, 128) <= budget
    # fp32: every stage buffered in full (the estimate the fp32 tests on the H200 ran against)
    assert pa.smem_bytes(128, 64, 2, 128, 4, 4) == 2 * 2 * 64 * 128 * 4 + 128 * 128 * 4
    # fp8 cache converted to fp16 for the MMA: one 16-bit copy of each tile on top
    assert pa.smem_bytes(128, 128, 5, 128, 1, 2) == pa.smem_bytes(128, 128, 5, 128) - 3 * 2 * 128 * 128 + 65536


def _busy_decode(seed: int, fp8: bool = False):
    """16 decode requests over 4 KV heads: 64 programs."""
    reqs = scaled([(40 + 23 * i % 170, 1) for i in range(16)])
    return make_batch(reqs, 8, 4, 64, 16, torch.bfloat16, fp8=fp8, seed=seed)


def test_splits_launch_the_merge_kernel(monkeypatch):
    """Context splits are merged by a second kernel launch, for bf16 and fp8 caches; both match
    the reference."""
    spy = _LaunchSpy(pa._reduce_splits_kernel)
    monkeypatch.setattr(pa, "_reduce_splits_kernel", spy)
    q, kv, bt, sl, qsl = _busy_decode(seed=16)
    out, ref = run_both(q, kv, bt, sl, qsl, 0.125, num_splits=3)
    check(out, ref, torch.bfloat16)
    assert spy.launches == 1
    q, kv, bt, sl, qsl = _busy_decode(seed=17, fp8=True)
    ks, vs = torch.tensor(0.5, device=DEVICE), torch.tensor(1.5, device=DEVICE)
    out, ref = run_both(q, kv, bt, sl, qsl, 0.125, ks, vs, num_splits=3)
    check(out, ref, torch.bfloat16)
    assert spy.launches == 2


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need compiled kernels, not the Triton interpreter")
@pytest.mark.parametrize("batch,fp8", [(16, False), (1, False), (16, True)])
def test_cuda_graph_replay_default_decode(monkeypatch, batch, fp8):
    """As the engine does it (cuda_graphs.py): warm up twice on a side stream, capture the
    default launch, then replay on new inputs; every replay matches the reference. The
    defaults launch the merge kernel as a programmatic dependent inside the graph (one request:
    16 splits, merged in blocks)."""
    spy = _LaunchSpy(pa._reduce_splits_kernel)
    monkeypatch.setattr(pa, "_reduce_splits_kernel", spy)
    reqs = [(600 + 97 * i, 1) for i in range(batch)]  # 16 requests x 4 KV heads = 64 programs
    q, kv, bt, sl, qsl = make_batch(reqs, 8, 4, 128, 16, torch.bfloat16, fp8=fp8, seed=19)
    scales = (torch.tensor(0.5, device=DEVICE), torch.tensor(1.5, device=DEVICE)) if fp8 else (None, None)
    max_seq = 4096  # a bound, as the graphs capture with max_model_len
    cfg, splits, _ = pa.launch_plan(batch, batch, 1, max_seq, 8, 4, 128, kv.element_size(), 2,
                                    sms=pa.device_sms(q.device))
    assert splits > (8 if batch == 1 else 1) and cfg.pdl
    out = torch.empty_like(q)

    def step():
        paged_attention(q, kv, bt, sl, qsl, 0.125, *scales, out=out, max_query_len=1, max_seq_len=max_seq)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert spy.launches == 3  # the warm-up's two and the capture's
    g = torch.Generator(device="cpu").manual_seed(20)
    for _ in range(3):
        q.copy_(torch.randn(q.shape, generator=g).to(q.dtype))
        sl.copy_(sl.flip(0))  # other lengths each replay (all within the block tables)
        bt.copy_(bt.flip(0))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(q.cpu(), kv.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), 0.125,
                                  *(None if x is None else x.cpu() for x in scales))
        check(out, ref, torch.bfloat16)


def test_offsets32_only_when_they_fit():
    """int32 offsets are used only when every offset into the cache is below 2^31."""
    small = torch.empty((2, 1000, 16, 8, 128), device="meta")
    assert pa._fits_int32(small[0]) and pa._fits_int32(small[1])
    # head 0's last element: (nb - 1) * 16384 + 15 * 1024 + 127 (the head offset is added in 64-bit)
    nb = 2**31 // (16 * 8 * 128)
    assert pa._fits_int32(torch.empty((2, nb, 16, 8, 128), device="meta")[0]) is True
    assert pa._fits_int32(torch.empty((2, nb + 1, 16, 8, 128), device="meta")[0]) is False


def test_bench_variants_are_valid_configs():
    """Every variant `bench kernels --variants` times names real AttentionConfig fields and passes
    the launcher's checks (a typo would only surface on the GPU run)."""
    from paged_backend.benchmarks.attention_variants import (
        DECODE_VARIANTS,
        PREFILL_VARIANTS,
        parse_cells,
        selected,
    )

    for variants in (DECODE_VARIANTS, PREFILL_VARIANTS):
        names = [v.name for v in variants]
        assert names[0] == "default" and len(set(names)) == len(names)
    assert parse_cells("8x4096, 1x32768") == [(8, 4096), (1, 32768)]
    assert [v.name for v in selected(DECODE_VARIANTS, "pairs o32 n,o32 n")] == [
        "default", "o32 n32", "pairs o32 n32", "pairs o32 n64"]
    assert selected(PREFILL_VARIANTS, None) == PREFILL_VARIANTS
    q, kv, bt, sl, qsl = make_batch([(20, 1), (0, 5)], 8, 2, 64, 16, torch.bfloat16, seed=15)
    for variants, mql in ((DECODE_VARIANTS, 1), (PREFILL_VARIANTS, 64)):
        for v in variants:
            cfg = dataclasses.replace(pa.pick_config(mql, 4, 64), **v.cfg)
            assert v.splits in ("auto", "x2", "/2") or v.splits.isdigit()
            if not CUDA:  # the launcher's checks pass (on CUDA this would compile ~30 kernels)
                paged_attention(q, kv, bt, sl, qsl, 0.125, config=cfg, compile_only=True)


def test_compile_only_launches_nothing():
    q, kv, bt, sl, qsl = make_batch([(20, 1), (0, 5)], 4, 2, 64, 16, torch.float32, seed=14)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, kv, bt, sl, qsl, 0.125, out=out, compile_only=True)
    assert got is out and out.isnan().all()


def test_single_token_and_empty():
    q, kv, bt, sl, qsl = make_batch([(0, 1)], 4, 2, 64, 16, torch.bfloat16, seed=5)
    out, ref = run_both(q, kv, bt, sl, qsl, 0.125)
    check(out, ref, torch.bfloat16)
    # no tokens at all
    empty = paged_attention(q[:0], kv, bt[:0], sl[:0], qsl[:1], 0.125)
    assert empty.shape == (0, 4, 64)
    # a request with no new tokens this step next to one with a token
    q, kv, bt, sl, qsl = make_batch([(9, 0), (20, 1)], 4, 2, 64, 16, torch.float32, seed=6)
    out, ref = run_both(q, kv, bt, sl, qsl, 0.125)
    check(out, ref, torch.float32)


def test_stale_slots_ignored():
    """NaN in slots past a request's length (its last page, the null block) must not leak in."""
    reqs = scaled([(37, 1), (0, 1), (12, 5), (70, 1)])
    bs = 16
    q, kv, bt, sl, qsl = make_batch(reqs, 6, 2, 64, bs, torch.bfloat16, seed=10)
    kv[:, 0] = float("nan")  # the null block pads every block table
    for r, length in enumerate(sl.tolist()):
        last = int(bt[r, (length - 1) // bs])
        kv[:, last, (length - 1) % bs + 1 :] = float("nan")
    for max_query_len in (None, 8):  # exact (decode-only path for the decode batch) or an upper bound
        out, ref = run_both(q, kv, bt, sl, qsl, 0.125, max_query_len=max_query_len)
        check(out, ref, torch.bfloat16)
        d = torch.tensor([0, 1, 3])  # the decode rows alone
        qd = q[qsl[d].long()]
        qsl_d = torch.arange(4, dtype=torch.int32, device=DEVICE)
        out, ref = run_both(qd, kv, bt[d.to(DEVICE)], sl[d.to(DEVICE)], qsl_d, 0.125, max_query_len=max_query_len)
        check(out, ref, torch.bfloat16)


def test_rows_past_query_start_loc_left_alone():
    q, kv, bt, sl, qsl = make_batch([(5, 1), (0, 4)], 4, 2, 64, 16, torch.float32, seed=7)
    padded = torch.cat([q, torch.randn(3, 4, 64, device=DEVICE)])  # e.g. graph padding
    out = torch.full_like(padded, float("nan"))
    paged_attention(padded, kv, bt, sl, qsl, 0.125, out=out)
    ref = paged_attention_ref(q.cpu(), kv.cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), 0.125)
    check(out[:5], ref, torch.float32)
    assert out[5:].isnan().all()


def _big_cache(path: str, num_blocks: int, shape_tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache of > 2^31 elements: real memory on CUDA, a sparse memory-mapped file on the CPU."""
    if CUDA:
        return torch.empty((2, num_blocks, *shape_tail), dtype=dtype, device=DEVICE)
    numel = 2 * num_blocks
    for s in shape_tail:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    with open(path, "wb") as f:
        f.truncate(nbytes)  # sparse: only the pages written are stored
    raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return raw.view(dtype).view(2, num_blocks, *shape_tail)


@pytest.mark.parametrize("offsets32", [False, True])  # True: the launcher must still pick int64 here
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE])
def test_int64_offsets_large_cache(tmp_path, dtype, offsets32):
    """Block ids past 131072 in a cache of 2^32+ elements: int32 offsets would wrap."""
    block_size, kv_heads, head_dim = 64, 2, 128  # block stride 16384 elements
    num_blocks = 140_000  # K offsets of blocks >= 131072 exceed 2^31, V offsets even earlier
    cache = _big_cache(str(tmp_path / "kv.bin"), num_blocks, (block_size, kv_heads, head_dim), dtype)
    assert cache.numel() > 2**32
    reqs = [(100, 1), (10, 40)]
    ids = [139_999, 131_073, 3, 135_000, 70_000]  # the requests use the first 3
    qdt = torch.bfloat16
    q, _, bt, sl, qsl = make_batch(reqs, 8, kv_heads, head_dim, block_size, qdt, seed=8, kv_cache=cache,
                                   block_ids=ids)
    g = torch.Generator().manual_seed(9)
    for b in ids:  # fill the used blocks; then overwrite a few slots through the Triton cache write
        cache[:, b] = (torch.randn((2, block_size, kv_heads, head_dim), generator=g) * 2).to(dtype).to(DEVICE)
    slots = torch.tensor([ids[0] * block_size + 5, ids[1] * block_size + 63, -1, ids[3] * block_size,
                          ids[4] * block_size + 7], dtype=torch.int64)
    k = torch.randn((len(slots), kv_heads, head_dim), generator=g).to(qdt).to(DEVICE)
    v = torch.randn((len(slots), kv_heads, head_dim), generator=g).to(qdt).to(DEVICE)
    one = torch.ones((), device=DEVICE)
    write_kv_cache(k, v, cache, slots.to(DEVICE), one, one)
    if dtype == FP8_DTYPE:
        k, v = quantize_fp8(k, one), quantize_fp8(v, one)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            blk, off = divmod(slot, block_size)
            assert torch.equal(cache[0, blk, off].float(), k[i].float())
            assert torch.equal(cache[1, blk, off].float(), v[i].float())
    out = torch.full_like(q, float("nan"))
    assert not pa._fits_int32(cache[0])
    cfg = None
    if offsets32:  # decode-shaped tiles, as pick_config would choose, plus the int32-offset request
        cfg = dataclasses.replace(pa.pick_config(40, 4, head_dim, cache.element_size()), offsets32=True)
    paged_attention(q, cache, bt, sl, qsl, head_dim**-0.5, one, one, out=out, config=cfg)
    # reference on a compact copy of the used blocks
    small = torch.stack([cache[:, i] for i in ids], dim=1).cpu()
    small = torch.cat([torch.zeros_like(small[:, :1]), small], dim=1)
    remap = {b: i + 1 for i, b in enumerate(ids)}
    bt_small = bt.cpu().apply_(lambda b: remap.get(b, 0))
    ref = paged_attention_ref(q.cpu(), small, bt_small, sl.cpu(), qsl.cpu(), head_dim**-0.5, one.cpu(), one.cpu())
    check(out, ref, qdt)


def test_launcher_errors():
    q, kv, bt, sl, qsl = make_batch([(5, 1)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(TypeError, match="block_tables"):
        paged_attention(q, kv, bt.long(), sl, qsl, 0.1)
    with pytest.raises(TypeError, match="kv_cache"):
        paged_attention(q, kv.to(torch.float16), bt, sl, qsl, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], kv, bt, sl, qsl, 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(q, kv, bt, sl, qsl[:1], 0.1)
    with pytest.raises(ValueError, match="kv_cache"):
        paged_attention(q, kv[..., :32], bt, sl, qsl, 0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, kv, bt, sl, qsl, 0.1, sliding_window=0)
    bad = dataclasses.replace(pa.pick_config(1, 2, 64, 4, 4), q_fold=1)  # 0 or 2 only
    with pytest.raises(ValueError, match="bad attention config"):
        paged_attention(q, kv, bt, sl, qsl, 0.1, config=bad)


def _not_specialized(kernel) -> set[str]:
    """Arguments Triton compiles no per-value variants for (compiled JITFunction or the interpreter's)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return {p.name for p in params if p.do_not_specialize}
    return set(kernel.kwargs.get("do_not_specialize") or ())


@pytest.mark.parametrize("kernel", [pa._paged_attention_kernel, pa._reduce_splits_kernel])
def test_batch_dependent_ints_are_not_specialized(kernel):
    """A new batch mix (num_seqs == 1, divisible by 16 or not; a split count) must not compile a
    new variant mid-run."""
    assert {"num_seqs", "num_splits", "stride_ms"} <= _not_specialized(kernel)


def test_compiled_variants_counts_each_kernels_cache(monkeypatch):
    import sys
    import types

    from paged_backend.kernels import _launch

    mod = types.ModuleType("paged_backend.kernels._variants_probe")
    mod.two = types.SimpleNamespace(device_caches={0: ({"a": 1}, None), 1: ({"b": 2}, None)})
    mod.none = types.SimpleNamespace(device_caches={0: ({}, None)})  # never launched: left out
    mod.other = object()
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    counts = _launch.compiled_variants()
    assert counts["_variants_probe.two"] == 2
    assert "_variants_probe.none" not in counts and "_variants_probe.other" not in counts


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,kv_elem,max_seqs,max_tokens,max_len",
    [
        (32, 8, 64, 2, 1024, 16384, 2048),  # W1 (Llama-3.2-1B shapes), the H200 defaults
        (32, 8, 128, 1, 1024, 16384, 32768),  # 8B shapes, fp8 cache, long contexts
        (9, 3, 64, 2, 256, 2048, 8192),  # SmolLM2, GQA 3
        (32, 32, 128, 2, 8, 512, 1024),  # MHA, small limits
    ],
)
def test_warmup_shapes_reach_every_step_variant(heads, kv_heads, head_dim, kv_elem, max_seqs, max_tokens, max_len):
    """Every launch variant (config, context split or not, decode-only grid) of a wide range of
    real step shapes is among the variants the start-up warm-up compiles, on a 132-SM GPU."""

    def variant(n, t, q, ln):
        cfg, splits, decode_only = pa.launch_plan(t, n, q, ln, heads, kv_heads, head_dim, kv_elem, 2, sms=132)
        return cfg, splits > 1, decode_only

    warm = pa.warmup_shapes(kv_heads, max_seqs, max_tokens, max_len)
    assert all(t <= 4096 for _, t, _, _ in warm)  # compiling needs the variant, not the size
    warmed = {variant(*s) for s in warm}
    steps = []
    for n in (1, 2, 3, 7, 8, 9, 17, 31, 32, 33, 64, 86, 100, 255, 512, 1000, 1024):
        for ln in (1, 16, 100, 511, 2048, 4096, 4097, 8192, 32768):
            if n <= max_seqs and n <= max_tokens and ln <= max_len:
                steps.append((n, n, 1, ln))  # decode (eager: real max; graphs: max_model_len)
        for q in (2, 3, 4, 17, 64, 256, 500, 2048, 8192, 16384):
            for extra in (0, 1, 500, 4000, 30000):
                ln = q + extra
                if n * q <= max_tokens and n <= max_seqs and ln <= max_len:
                    steps.append((n, n * q, q, ln))  # prefill, chunks, prefix hits, mixed batches
    missing = {variant(*s) for s in steps} - warmed
    assert not missing, f"{len(missing)} variants not warmed, e.g. {sorted(map(str, missing))[:2]}"
    assert len(warmed) >= 4


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET, reason="compiles Triton kernels for the GPU, not the Triton interpreter")
@pytest.mark.parametrize("fp8", [False, True])
def test_warm_up_compiles_what_engine_steps_launch(fp8):
    """After ``warm_up`` for some engine limits, steps within them (decode, prefill, chunks over a
    context, mixed) launch no kernel that still has to compile."""
    from paged_backend.kernels._launch import compiled_variants

    width = 67  # the engine's block-table rows: max_model_len / block_size + 1 (an odd width here)
    limits = dict(max_num_seqs=96, max_num_batched_tokens=2048, max_model_len=(width - 1) * 16)
    steps = [[(100, 1)] * 3, [(0, 300)], [(500, 40), (33, 1), (0, 7)], [(700, 1)] * 90, [(0, 1000), (20, 1)]]
    batches = [make_batch(reqs, 8, 2, 64, 16, torch.bfloat16, fp8=fp8, seed=30 + i)
               for i, reqs in enumerate(steps)]
    scales = (torch.tensor(0.5, device=DEVICE), torch.tensor(1.5, device=DEVICE)) if fp8 else (None, None)
    assert pa.warm_up(batches[0][1], torch.bfloat16, 8, max_blocks=width, k_scale=scales[0], v_scale=scales[1],
                      **limits) > 0
    before = compiled_variants()
    for q, kv, bt, sl, qsl in batches:
        table = torch.zeros((bt.shape[0], width), dtype=torch.int32, device=DEVICE)
        table[:, : bt.shape[1]] = bt
        paged_attention(q, kv, table, sl, qsl, 0.125, *scales)
    torch.cuda.synchronize()
    assert compiled_variants() == before
