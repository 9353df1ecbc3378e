"""The multi-head latent attention kernels under the CPU interpreter (compiled on CUDA), against
``mla_attention_ref``: decode rows and prefill chunks of several requests in scattered blocks, head counts that
pad to BLOCK_H, bf16 / fp32 queries, an e4m3 latent cache with its scale, poisoned outputs; the latent cache
write bit for bit against its reference."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import make_meta

from paged_backend.kernels import mla_attention as mla_attention_module
from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX
from paged_backend.kernels.mla_attention import (
    DEQUANTIZE_MAX_BYTES,
    dequantize_blocks,
    dequantizes,
    host_lens_of,
    mla_attention,
    mla_forward,
    pick_splits,
    prefill_tile_for,
    reads_pairs,
    row_positions,
    step_plan,
    supported,
    warm_up,
    write_latent_cache,
)
from paged_backend.kernels.mla_attention_ref import mla_attention_ref, mla_forward_ref, write_latent_cache_ref

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def _step(seqs, heads, dv, dr, dtype, block_size=16, fp8=False, seed=0, device="cpu"):
    """(query, latent, meta, a filled cache, kv_scale) of one step over ``seqs`` = (cached, new, blocks)."""
    gen = torch.Generator().manual_seed(seed)
    meta, _ = make_meta(seqs, block_size)
    t = sum(n for _, n, _ in seqs)
    blocks = 1 + max(b for *_, table in seqs for b in table)
    cache_dtype = FP8_DTYPE if fp8 else dtype
    cache = torch.randn(blocks, block_size, dv + dr, generator=gen).to(cache_dtype)  # the cached context
    latent = torch.randn(t, dv + dr, generator=gen).to(dtype)
    q = (torch.randn(t, heads, dv + dr, generator=gen) * 0.3).to(dtype)
    scale = torch.tensor(0.05 if fp8 else 1.0)
    to = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    for f in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        setattr(meta, f, to(getattr(meta, f)))
    return to(q), to(latent), meta, to(cache), to(scale)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


CASES = [  # (seqs, heads, dv, dr)
    ([(37, 1, [3, 1, 4]), (5, 1, [2]), (70, 1, [6, 5, 7, 8, 9])], 16, 64, 16),  # decode rows
    ([(0, 9, [3, 1]), (20, 13, [2, 5, 4]), (15, 1, [6])], 4, 32, 16),  # a prefill, a chunk, a decode; 4 heads
    ([(40, 3, [1, 2, 3]), (0, 2, [4])], 20, 32, 32),  # 20 heads: two head blocks
]


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs,heads,dv,dr", CASES)
def test_mla_forward_matches_the_reference(seqs, heads, dv, dr, dtype, fp8):
    q, latent, meta, cache, scale = _step(seqs, heads, dv, dr, dtype, fp8=fp8, seed=heads + dv)
    ref_cache = cache.clone()
    got = mla_forward(q, latent, cache, meta, 0.125, dv, scale)
    want = mla_forward_ref(q, latent, ref_cache, meta, 0.125, dv, scale)
    assert got.shape == (q.shape[0], heads, dv) and got.dtype == dtype and not got.isnan().any()
    assert torch.equal(cache.view(torch.uint8) if fp8 else cache, ref_cache.view(torch.uint8) if fp8 else ref_cache)
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_the_write_skips_padded_slots_and_saturates_fp8():
    cache = torch.zeros(2, 16, 48, dtype=FP8_DTYPE)
    latent = torch.randn(4, 48) * 100
    slots = torch.tensor([3, -1, 17, 30])
    ref = cache.clone()
    write_latent_cache(latent, cache, slots, torch.tensor(0.1))
    write_latent_cache_ref(latent, ref, slots, torch.tensor(0.1))
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert float(cache.float().abs().max()) == FP8_MAX


def test_rows_find_their_request_and_position():
    req, pos = row_positions(torch.tensor([10, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 5, 7],
                                                                                     dtype=torch.int32), 7)
    assert req.tolist() == [0, 0, 0, 0, 1, 2, 2] and pos.tolist() == [6, 7, 8, 9, 2, 5, 6]


def test_unsupported_dims_are_refused():
    assert supported(512, 64) and not supported(32, 8) and not supported(48, 16)
    q, _, meta, cache, _ = _step([(3, 1, [1])], 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        mla_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.1, 40)
    ref = mla_attention_ref(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.1, 32)
    assert ref.shape == (1, 4, 32)


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiled_deepseek_v2_lite_shaped(fp8):
    """16 heads, latent 512 + 64, 8 decode rows over 1k-4k tokens, on the GPU."""
    seqs, start = [], 1
    for n in [1000, 4000, 2500, 1, 17, 3000, 64, 2048]:
        nb = -(-(n + 1) // 16)
        seqs.append((n, 1, list(range(start, start + nb))))
        start += nb
    q, latent, meta, cache, scale = _step(seqs, 16, 512, 64, torch.bfloat16, fp8=fp8, device="cuda")
    ref_cache = cache.clone()
    got = mla_forward(q, latent, cache, meta, 0.07, 512, scale)
    want = mla_forward_ref(q, latent, ref_cache, meta, 0.07, 512, scale)
    assert _rel(got.cpu(), want.cpu()) < 2e-2


@pytest.mark.cuda
def test_compiled_prefill_deepseek_v2_lite_shaped():
    """The prefill kernel at 16 heads, latent 512 + 64: a 300-token prompt, a 200-token chunk after 1000 cached
    tokens and two decode rows in one step, on the GPU."""
    seqs, start = [], 1
    for n, new in [(0, 300), (1000, 200), (700, 1), (64, 1)]:
        nb = -(-(n + new) // 16)
        seqs.append((n, new, list(range(start, start + nb))))
        start += nb
    for fp8 in (False, True):
        q, latent, meta, cache, scale = _step(seqs, 16, 512, 64, torch.bfloat16, fp8=fp8, device="cuda")
        ref_cache = cache.clone()
        got = mla_forward(q, latent, cache, meta, 0.07, 512, scale)
        want = mla_forward_ref(q, latent, ref_cache, meta, 0.07, 512, scale)
        assert _rel(got.cpu(), want.cpu()) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiled_warm_up_launches_every_variant_and_leaves_the_cache(fp8):
    """``warm_up`` at DeepSeek-V2-Lite's shapes on the GPU: the decode split counts, the prefill kernel (over e4m3
    also reading e4m3 and the split step of a chunk beside a decode row), the cache untouched."""
    cache = torch.randn(130, 16, 576, device="cuda").to(FP8_DTYPE if fp8 else torch.bfloat16)
    before = cache.clone()
    launched = warm_up(cache, torch.bfloat16, 16, 512, max_model_len=2048, kv_scale=torch.tensor(0.1, device="cuda"))
    splits = pick_splits(1, 128, torch.cuda.get_device_properties(0).multi_processor_count).bit_length()
    assert launched == splits + (4 if fp8 else 1)  # fp8: converted / e4m3 prefill, each alone and beside a decode row
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_splits_merge_to_the_reference(splits, dtype):
    """A row's blocks over 2-8 programs merged by log-sum-exp; splits past a short row's last block (no keys)
    add nothing; fp8 latents too."""
    seqs = [(70, 1, [6, 5, 7, 8, 9]), (5, 1, [2]), (20, 3, [3, 1])]
    for fp8 in (False, True):
        q, latent, meta, cache, scale = _step(seqs, 4, 32, 16, dtype, fp8=fp8, seed=splits)
        ref_cache = cache.clone()
        write_latent_cache(latent, cache, meta.slot_mapping, scale)
        got = mla_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 32, scale,
                            max_seq_len=71, splits=splits)
        want = mla_forward_ref(q, latent, ref_cache, meta, 0.125, 32, scale)
        assert not got.isnan().any() and _rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("tile", [(1, 16), (2, 32), (4, 64), (8, 16)], ids=lambda t: f"rows{t[0]}-keys{t[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_tiles_match_the_reference(tile, dtype):
    """The prefill kernel's tiles (rows of one request x keys a step, keys spanning cache blocks): a prompt,
    chunks after a cached context (rows past a chunk's end in the last tile), a decode row in the same step,
    20 heads over two head blocks, block size 32; fp8 latents too."""
    seqs = [(0, 11, [3, 1]), (45, 7, [2, 5, 4]), (30, 1, [6, 7])]
    for fp8 in (False, True):
        q, latent, meta, cache, scale = _step(seqs, 20, 32, 16, dtype, block_size=32, fp8=fp8, seed=tile[0])
        ref_cache = cache.clone()
        write_latent_cache(latent, cache, meta.slot_mapping, scale)
        got = mla_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 32, scale,
                            max_query_len=11, prefill_tile=tile)
        want = mla_forward_ref(q, latent, ref_cache, meta, 0.125, 32, scale)
        assert not got.isnan().any() and _rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_a_long_chunk_beside_many_decode_rows_matches_the_reference():
    """A step of 24 decode rows and one 40-row chunk (the prefill kernel's ragged grid: one program a decode
    row, not one per tile of the longest request), e4m3 latents too."""
    seqs = [(10 + 2 * i, 1, [3 * i + 1, 3 * i + 2, 3 * i + 3]) for i in range(12)]  # up to 33 tokens
    seqs += [(8, 40, [40, 41, 42])] + [(3 + i, 1, [50 + i]) for i in range(12)]
    for fp8 in (False, True):
        q, latent, meta, cache, scale = _step(seqs, 16, 32, 16, torch.float32, fp8=fp8, seed=7)
        ref_cache = cache.clone()
        write_latent_cache(latent, cache, meta.slot_mapping, scale)
        got = mla_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 32, scale,
                            max_query_len=40, prefill_tile=(4, 16))
        want = mla_forward_ref(q, latent, ref_cache, meta, 0.125, 32, scale)
        assert not got.isnan().any() and _rel(got, want) < 1e-5


def test_pick_splits_fills_the_gpu_and_keeps_splits_long():
    assert pick_splits(8, 256, 132) == 32  # 8 rows x 4k context: 33 -> 32 splits of 8 blocks
    assert pick_splits(300, 256, 132) == 1  # enough rows already
    assert pick_splits(1, 4, 132) == 1  # 4 blocks: too short to split
    assert pick_splits(1, 64, 132) == 8


def test_prefill_tiles_fill_64_mma_rows_and_the_cpu_warms_nothing():
    assert prefill_tile_for(16) == (4, 64) and prefill_tile_for(128) == (1, 64) and prefill_tile_for(20) == (2, 64)
    assert prefill_tile_for(16, torch.float32) == (2, 32)  # fp32: half the tile (twice the bytes)
    assert warm_up(torch.zeros(4, 16, 48), torch.float32, 4, 32, max_model_len=64) == 0


def test_decode_tiles_take_32_keys_for_16_head_blocks_and_64_for_wider():
    from paged_backend.kernels.mla_attention import decode_tile_for

    assert decode_tile_for(16, torch.bfloat16, 512) == (32, 4, 2)
    assert decode_tile_for(64, torch.bfloat16, 512) == (64, 8, 2)
    assert decode_tile_for(64, torch.float16, 64) == (64, 4, 2)
    assert decode_tile_for(16, torch.float32, 512) == (32, 8, 2)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_reads_e4m3_latents_as_word_pairs(splits):
    """16-bit queries over an e4m3 cache: the decode kernel reads the latents as int16 words of two values (even
    and odd dims apart, ``reads_pairs``); the same as reading them byte by byte, and the reference. 20 heads over
    two head blocks, latent 64 + 32, one program or four context splits a row."""
    assert reads_pairs(torch.bfloat16, FP8_DTYPE, 64, 32, 20) and not reads_pairs(torch.float32, FP8_DTYPE, 64, 32, 20)
    assert not reads_pairs(torch.bfloat16, torch.bfloat16, 64, 32, 20)
    assert not reads_pairs(torch.bfloat16, FP8_DTYPE, 64, 16, 20)  # a rotary half below an MMA's 16
    assert not reads_pairs(torch.bfloat16, FP8_DTYPE, 64, 32, 128)  # 64-head blocks
    seqs = [(70, 1, [6, 5, 7, 8, 9]), (5, 1, [2]), (33, 1, [3, 1, 4])]
    q, latent, meta, cache, scale = _step(seqs, 20, 64, 32, torch.bfloat16, fp8=True, seed=3)
    ref_cache = cache.clone()
    write_latent_cache(latent, cache, meta.slot_mapping, scale)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 64, scale)
    got = mla_attention(*args, max_seq_len=71, splits=splits)
    by_bytes = mla_attention(*args, max_seq_len=71, splits=splits, fp8_pairs=False)
    want = mla_forward_ref(q, latent, ref_cache, meta, 0.125, 64, scale)
    assert not got.isnan().any() and _rel(got, want) < 2e-2 and _rel(got, by_bytes) < 1e-2


def test_prefill_over_e4m3_latents_converts_the_steps_blocks_once(monkeypatch):
    """A prefill step over an e4m3 cache with 16-bit q converts each request's blocks (those holding its tokens)
    to q's dtype exactly, then runs the 16-bit kernel: the same as reading e4m3 in the kernel, and the reference;
    past ``DEQUANTIZE_MAX_BYTES`` it reads e4m3."""
    seqs = [(0, 11, [3, 1]), (45, 7, [2, 5, 4, 9]), (30, 1, [6, 7])]
    q, latent, meta, cache, scale = _step(seqs, 20, 64, 32, torch.bfloat16, fp8=True, seed=4)
    ref_cache = cache.clone()
    write_latent_cache(latent, cache, meta.slot_mapping, scale)
    monkeypatch.setattr(mla_attention_module, "DEQUANTIZE_CHUNK", 512)  # a block (16 x 96 values) in three programs
    plan = step_plan(meta.seq_lens, meta.query_start_loc, 52, 16, None, True)  # no host lens: all
    # 4 blocks for the longest request, table rows 16 blocks wide (one compiled variant for every step)
    assert (plan.decode_rows, plan.chunk_slots, plan.chunk_blocks, plan.chunk_base.tolist()) == (0, 3, 16, [0, 16, 32])
    copy, tables = dequantize_blocks(cache, meta.block_tables, meta.seq_lens, plan, torch.bfloat16)
    assert copy.dtype == torch.bfloat16 and copy.shape[0] == 48
    assert tables.tolist() == [list(range(16 * r, 16 * r + 16)) for r in range(3)]
    for r, (n, new, blocks) in enumerate(seqs):
        held = -(-(n + new) // 16)
        assert torch.equal(copy[16 * r:16 * r + held], cache[blocks[:held]].to(torch.bfloat16))
    assert dequantizes(torch.bfloat16, cache, 12) and not dequantizes(torch.float32, cache, 12)
    assert not dequantizes(torch.bfloat16, cache.to(torch.bfloat16), 12)
    assert not dequantizes(torch.bfloat16, cache, DEQUANTIZE_MAX_BYTES // (16 * 96 * 2) + 1)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 64, scale)
    got = mla_attention(*args, max_query_len=11, max_seq_len=52)
    by_bytes = mla_attention(*args, max_query_len=11, max_seq_len=52, dequantize=False)
    want = mla_forward_ref(q, latent, ref_cache, meta, 0.125, 64, scale)
    assert not got.isnan().any() and _rel(got, want) < 2e-2 and _rel(got, by_bytes) < 1e-2


@pytest.mark.parametrize("splits", [None, 4])
def test_a_step_with_chunks_sends_single_rows_to_the_decode_kernel_over_e4m3(splits):
    """With the host's query lengths, a step over e4m3 latents (16-bit q, word pairs) attends its single-row
    requests in the decode kernel and its chunks in the prefill kernel over a converted copy of the chunks'
    blocks only (the other kernel skips each row: poisoned outputs, no NaN); the same as the one-kernel step and
    the reference, and as ``mla_forward`` with the metadata's host lengths."""
    seqs = [(20, 1, [7, 8]), (0, 11, [3, 1]), (5, 1, [2]), (45, 7, [5, 4, 9, 10]), (30, 1, [6, 11])]
    q, latent, meta, cache, scale = _step(seqs, 20, 64, 32, torch.bfloat16, fp8=True, seed=5)
    ref_cache = cache.clone()
    want = mla_forward_ref(q, latent, ref_cache, meta, 0.125, 64, scale)
    write_latent_cache(latent, cache, meta.slot_mapping, scale)
    lens = ([1, 11, 1, 7, 1], [21, 11, 6, 52, 31])
    plan = step_plan(meta.seq_lens, meta.query_start_loc, 52, 16, lens, True)
    assert (plan.decode_rows, plan.decode_max_seq_len, plan.chunk_slots, plan.chunk_blocks) == (3, 31, 2, 16)
    assert plan.chunk_base.tolist() == [-1, 0, -1, 16, -1]
    assert plan.decode_req.tolist() == [0, 2, 4] and plan.decode_pos.tolist() == [20, 5, 30]
    assert plan.decode_row_ids.tolist() == [0, 12, 20]  # rows of the single-row requests, nothing else
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 64, scale)
    got = mla_attention(*args, max_query_len=11, max_seq_len=52, host_lens=lens, splits=splits)
    one_kernel = mla_attention(*args, max_query_len=11, max_seq_len=52)
    assert not got.isnan().any() and _rel(got, want) < 2e-2 and _rel(got, one_kernel) < 1e-2
    if splits is None:
        assert meta.query_lens_cpu == lens[0] and meta.seq_lens_cpu == lens[1]
        assert torch.equal(mla_forward(q, latent, cache, meta, 0.125, 64, scale), got)


def test_host_lengths_plan_a_step_only_where_they_describe_its_rows():
    """A step padded for a CUDA graph (more requests than host lengths, or requests spread over padded rows)
    is planned from the device alone: its single rows stay in the prefill kernel, the converted copy sized from
    ``max_seq_len`` (the graph's bound), not from this step's lengths."""
    seqs = [(20, 1, [7, 8]), (0, 11, [3, 1]), (5, 1, [2])]
    _, _, meta, _, _ = _step(seqs, 4, 64, 32, torch.bfloat16, fp8=True)
    assert host_lens_of(meta, 13) == ([1, 11, 1], [21, 11, 6])
    assert host_lens_of(meta, 14) is None  # rows spread over padding
    meta.query_lens_cpu, meta.seq_lens_cpu = [1, 11], [21, 11]  # a padding request beyond the host's
    assert host_lens_of(meta, 12) is None
    plan = step_plan(meta.seq_lens, meta.query_start_loc, 64, 16, host_lens_of(meta, 12), True)
    assert (plan.decode_rows, plan.chunk_slots, plan.chunk_blocks) == (0, 3, 16)


def test_the_prefill_kernel_leaves_a_split_steps_single_rows_to_the_decode_kernel(monkeypatch):
    """In a split step the decode kernel's rows are written first; the prefill kernel then writes the chunks'
    rows only (a sentinel put where the decode kernel would write survives)."""
    seqs = [(20, 1, [7, 8]), (0, 11, [3, 1]), (5, 1, [2])]
    q, latent, meta, cache, scale = _step(seqs, 20, 64, 32, torch.bfloat16, fp8=True, seed=6)
    ref_cache = cache.clone()
    want = mla_forward_ref(q, latent, ref_cache, meta, 0.125, 64, scale)
    write_latent_cache(latent, cache, meta.slot_mapping, scale)
    monkeypatch.setattr(mla_attention_module, "_decode", lambda q, *args: args[5].fill_(7.0))  # out_d
    got = mla_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 64, scale,
                        max_query_len=11, max_seq_len=21, host_lens=([1, 11, 1], [21, 11, 6]))
    single = torch.tensor([0, 12])
    assert bool((got[single] == 7.0).all())
    chunk = torch.arange(1, 12)
    assert not got[chunk].isnan().any() and _rel(got[chunk], want[chunk]) < 2e-2
