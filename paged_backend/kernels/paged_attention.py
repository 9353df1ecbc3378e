"""Paged attention in Triton: one kernel family for every step the scheduler makes.

Decode, prefill, chunked prefill and prefix-cache hits are the same thing here: request
i's new query rows ``query_start_loc[i]:query_start_loc[i+1]`` sit at positions
``ctx_i .. seq_lens[i]-1`` and attend causally (optionally within a sliding window) to
the request's cached keys, read page by page through ``block_tables[i]``. Contract and
math as ``paged_attention_ref``.

Work split. A program owns one (query tile, KV head[, context split]). A query tile is
BLOCK_Q consecutive tokens of one request times the G = H / Hkv query heads sharing the
KV head, packed into BLOCK_M = BLOCK_Q * G rows (row r = token r // G, head r % G), so
GQA of any ratio reads each K/V tile once for all its heads::

    grid axis 0: (q tile, KV head), heads fastest so one q tile's heads run together;
            q tiles of all requests, last first (causal: most work first); request i's
            tiles start at qsl[i] // BLOCK_Q + i (found by binary search; spare programs
            exit); with <= 1 new token per request (DECODE_ONLY) the q tile is the request
    axis 1: context split (flash decoding: few long requests still fill the GPU;
            partial (acc, max, sum) per split, merged by _reduce_splits_kernel)

    positions  0 ......... full_hi*TILE_N ....... q_first ... q_last
               [ tiles seen whole by every row ][ causal tiles, masked ]

Each KV tile of TILE_N positions gathers its rows from their pages (block id per position,
int64 offsets). FP8 caches are dequantized in the kernel: e4m3 converts exactly to fp16
(the dot operand type then; q is pre-scaled by the softmax scale to stay in fp16 range),
K's scale folds into the score scale, V's into the output.

Variants (``AttentionConfig`` fields, all off in the baseline config; ``pick_config`` turns
on the ones the H200 sweep in ``bench kernels --variants`` measured faster, per regime:
decode gets offsets32 + reduce_block + pdl, with an fp8 cache also fp8_pairs + maxnreg 128 +
programs_per_sm 4; prefill q_fold 2 + offsets32 (and its own tile shapes))::

    q_fold        0: scores scaled per tile; 2: softmax scale * log2(e) folded into q by the
                  launcher (one elementwise op; q then feeds the MMA as loaded), or by the caller
                  (``q_scaled``: the engine's rotary kernel)
    offsets32     int32 K/V offsets when the cache is small enough (the launcher checks; else int64)
    maxnreg       > 0: register cap per thread, so more programs fit on an SM
    fp8_pairs     fp8 cache read as int16 words of two e4m3 values, converted with bit moves
                  into even / odd head_dim columns (``_attend_tiles_pairs``): the MMA operands are
                  16-bit tiles, staged like bf16 ones (an 8-bit V tile is read from shared memory
                  byte by byte for the MMA's transposed operand)
    programs_per_sm  context splits aim at this many programs per SM (the config's occupancy)
    reduce_block  > 0: past 8 splits the merge kernel reads this many per load (else one by one:
                  a memory round trip per split)
    pdl           the merge kernel is launched as a programmatic dependent (sm_90+): its launch
                  and prologue overlap the attention kernel's tail; it waits (griddepcontrol)
                  before reading the partials
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_backend.kernels._launch import (
    FLOAT_DTYPES,
    async_compiles,
    check_device,
    check_tensor,
    dot_dtype,
    interpreting,
    next_pow2,
    scale_tensor,
)
from paged_backend.kernels.cache_write_ref import FP8_DTYPE
from paged_backend.kernels.e4m3_pairs import e4m3_pairs
from paged_backend.kernels.q_tiles import q_tile_of, ragged_grid

try:  # programmatic dependent launch (Triton >= 3.3); without it ``pdl`` configs run as plain launches
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)


MERGE_SERIAL_MAX = tl.constexpr(8)  # split merge: up to this many splits read one by one, past it in blocks


@triton.jit
def _kv_tile_rows(bt_row, kpos, seq_len, stride_kb, stride_ks, stride_vb, stride_vs, MASK: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, OFF32: tl.constexpr):
    """KV positions ``kpos`` [TILE_N] of one tile: which are < seq_len, and each position's K and
    V row offset, gathered through the request's block table."""
    kmask = kpos < seq_len
    if MASK:
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0)
    else:
        blk = tl.load(bt_row + kpos // BLOCK_SIZE)
    in_blk = kpos % BLOCK_SIZE
    if not OFF32:  # int64 unless the launcher proved every offset in this cache fits in int32
        blk = blk.to(tl.int64)
        in_blk = in_blk.to(tl.int64)
    return kmask, blk * stride_kb + in_blk * stride_ks, blk * stride_vb + in_blk * stride_vs


@triton.jit
def _load_tile(ptrs, len_mask, pad_mask, MASK: tl.constexpr, PADDED: tl.constexpr):
    """A K or V tile; ``len_mask`` (positions past the sequence) only on masked tiles,
    ``pad_mask`` (head_dim padding) only when the head dim is padded. Masked elements read 0."""
    if MASK:
        x = tl.load(ptrs, mask=len_mask & pad_mask, other=0.0)
    elif PADDED:
        x = tl.load(ptrs, mask=pad_mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _mask_scores(s, kpos, kmask, qpos, window, SLIDING: tl.constexpr):
    """Scores [BLOCK_M, TILE_N] with causal / length / sliding-window masked positions at -inf."""
    keep = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
    if SLIDING:
        keep = keep & (kpos[None, :] > qpos[:, None] - window)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _softmax_step(s, m_i, m_new, l_i, qk_scale, SCALE_S: tl.constexpr):
    """One online-softmax step (log2 domain): the tile's probabilities against the running max
    ``m_new``, the factor that rescales what was accumulated against ``m_i``, and the new sum.
    Rows that saw nothing yet (max -inf) use 0 as their reference. SCALE_S: ``s`` is unscaled
    and ``qk_scale`` (> 0) enters here, one FMA per score (the maxima are already scaled)."""
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if SCALE_S:
        p = tl.math.exp2(tl.fma(s, qk_scale, -m_use[:, None]))
    else:
        p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    return p, alpha, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, D_PAD] float32
    m_i,  # [BLOCK_M] float32, running max, log2 domain
    l_i,  # [BLOCK_M] float32, running sum
    q,  # [BLOCK_M, D_PAD] DOT_DTYPE
    k_base,  # pointer to this KV head in K cache [NB, BS, Hkv, D]
    v_base,  # pointer to this KV head in V cache
    bt_row,  # pointer to block_tables[seq] (int32 [max_blocks])
    qpos,  # [BLOCK_M] int32, position of each row's query
    seq_len,
    window,
    qk_scale,  # score scale, log2 domain, applied per tile when SCALE_S (else q carries it)
    tile_lo,
    tile_hi,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    MASK: tl.constexpr,
    SLIDING: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALE_S: tl.constexpr,
    OFF32: tl.constexpr,
):
    """Online-softmax over KV tiles [tile_lo, tile_hi); MASK applies causal/length/window masks."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < HEAD_DIM
    PADDED: tl.constexpr = D_PAD != HEAD_DIM
    for j in range(tile_lo, tile_hi):
        kpos = j * TILE_N + offs_n
        kmask, k_off, v_off = _kv_tile_rows(bt_row, kpos, seq_len, stride_kb, stride_ks, stride_vb, stride_vs,
                                            MASK, BLOCK_SIZE, OFF32)
        k_ptrs = k_base + k_off[None, :] + offs_d[:, None]  # [D_PAD, TILE_N]
        k = _load_tile(k_ptrs, kmask[None, :], dmask[:, None], MASK, PADDED)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION)  # [BLOCK_M, TILE_N]
        if MASK:
            s = _mask_scores(s, kpos, kmask, qpos, window, SLIDING)
        m_tile = tl.max(s, axis=1)
        if SCALE_S:  # the scale is positive: max first, the scores scale inside the exp2 (one FMA)
            m_tile = m_tile * qk_scale
        m_new = tl.maximum(m_i, m_tile)
        p, alpha, l_i = _softmax_step(s, m_i, m_new, l_i, qk_scale, SCALE_S)
        v_ptrs = v_base + v_off[:, None] + offs_d[None, :]  # [TILE_N, D_PAD]
        v = _load_tile(v_ptrs, kmask[:, None], dmask[None, :], MASK, PADDED)
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_tiles_pairs(
    acc_e,  # [BLOCK_M, H_PAD] float32: output columns 0, 2, 4, ...
    acc_o,  # [BLOCK_M, H_PAD] float32: output columns 1, 3, 5, ...
    m_i,
    l_i,
    q_e,  # [BLOCK_M, H_PAD] fp16: q's even columns (pre-scaled)
    q_o,  # [BLOCK_M, H_PAD] fp16: q's odd columns
    k_base,  # int16 view of this KV head in the fp8 K cache [NB, BS, Hkv, D/2]
    v_base,
    bt_row,
    qpos,
    seq_len,
    window,
    qk_scale,
    tile_lo,
    tile_hi,
    stride_kb,  # int16 units
    stride_ks,
    stride_vb,
    stride_vs,
    MASK: tl.constexpr,
    SLIDING: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HALF_DIM: tl.constexpr,  # HEAD_DIM // 2
    H_PAD: tl.constexpr,  # D_PAD // 2
    DOT_DTYPE: tl.constexpr,  # float16 (float32 in the interpreter)
    OFF32: tl.constexpr,
    ASM: tl.constexpr,  # e4m3_pairs' hardware conversion (not in the interpreter)
):
    """``_attend_tiles`` for an fp8 cache read as int16 pairs (``fp8_pairs``): column 2j and 2j+1
    of a K/V row share one 16-bit word, so S = q_e K_e^T + q_o K_o^T and O = (P V_e, P V_o),
    each MMA operand a 16-bit tile the compiler stages as it does bf16 ones."""
    offs_n = tl.arange(0, TILE_N)
    offs_j = tl.arange(0, H_PAD)
    jmask = offs_j < HALF_DIM
    PADDED: tl.constexpr = H_PAD != HALF_DIM
    for j in range(tile_lo, tile_hi):
        kpos = j * TILE_N + offs_n
        kmask, k_off, v_off = _kv_tile_rows(bt_row, kpos, seq_len, stride_kb, stride_ks, stride_vb, stride_vs,
                                            MASK, BLOCK_SIZE, OFF32)
        kw = _load_tile(k_base + k_off[None, :] + offs_j[:, None], kmask[None, :], jmask[:, None], MASK, PADDED)
        k_e, k_o = e4m3_pairs(kw, ASM)
        s = tl.dot(q_e, k_e.to(DOT_DTYPE))
        s = tl.dot(q_o, k_o.to(DOT_DTYPE), s)
        if MASK:
            s = _mask_scores(s, kpos, kmask, qpos, window, SLIDING)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p, alpha, l_i = _softmax_step(s, m_i, m_new, l_i, qk_scale, True)
        vw = _load_tile(v_base + v_off[:, None] + offs_j[None, :], kmask[:, None], jmask[None, :], MASK, PADDED)
        v_e, v_o = e4m3_pairs(vw, ASM)
        p16 = p.to(DOT_DTYPE)
        acc_e = tl.dot(p16, v_e.to(DOT_DTYPE), acc_e * alpha[:, None])
        acc_o = tl.dot(p16, v_o.to(DOT_DTYPE), acc_o * alpha[:, None])
        m_i = m_new
    return acc_e, acc_o, m_i, l_i


@triton.jit
def _merge_split(acc, m_run, l_run, part, m_s, l_s):
    """Folds one context split's partial (sum ``part``, max ``m_s``, denominator ``l_s``; log2
    domain) into the running (acc, m_run, l_run); an empty split weighs exp2(-inf) = 0."""
    m_new = tl.maximum(m_run, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.math.exp2(m_run - m_use)
    b = tl.math.exp2(m_s - m_use)
    return acc * a[:, None] + part * b[:, None], m_new, l_run * a + l_s * b


# Integers that change with the batch are not specialized (Triton compiles a variant per
# value class: == 1, divisible by 16, other): otherwise the first steps of a new batch mix
# compile kernels mid-run, seconds each (the slow first timed W1 run on the H200). The split
# strides (T*H*D) stay specialized: divisible by 16 whenever head_dim is (every Llama-family size).
_BATCH_INTS = ["num_seqs", "num_splits"]


@triton.jit(do_not_specialize=[*_BATCH_INTS, "stride_ms"])
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [NB, BS, Hkv, D]  (kv_cache[0])
    v_ptr,  # [NB, BS, Hkv, D]  (kv_cache[1])
    out_ptr,  # [T, H, D], or float32 [num_splits, T, H, D] partial sums when SPLIT
    m_ptr,  # float32 [num_splits, T, H] partial max (log2 domain), SPLIT only
    l_ptr,  # float32 [num_splits, T, H] partial sum, SPLIT only
    bt_ptr,  # int32 [num_seqs, max_blocks]
    seq_lens_ptr,  # int32 [num_seqs]
    qsl_ptr,  # int32 [num_seqs + 1]
    k_scale_ptr,  # float32 [1]
    v_scale_ptr,  # float32 [1]
    sm_scale,  # softmax scale
    num_kv_heads,
    num_seqs,
    num_splits,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_os,  # split stride of out/partials (SPLIT only)
    stride_mt,  # token stride of m/l (SPLIT only)
    stride_ms,  # split stride of m/l (SPLIT only)
    stride_bt,
    G: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // G query tokens per tile
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
    SLIDING: tl.constexpr,
    SPLIT: tl.constexpr,
    DECODE_ONLY: tl.constexpr,  # every request has <= 1 new token: no search, grid axis 0 = requests
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_FOLD: tl.constexpr = 0,  # 0: scores scaled per tile; 2: q carries the scale (the launcher or the caller)
    OFF32: tl.constexpr = False,  # int32 K/V offsets (the launcher checked the cache's extent)
    PAIRS: tl.constexpr = False,  # fp8 cache read as int16 pairs (_attend_tiles_pairs); k/v pointers are int16
    PAIRS_ASM: tl.constexpr = False,  # PAIRS: convert with inline PTX (not in the interpreter)
    PDL: tl.constexpr = False,  # the split-merge kernel is launched as a programmatic dependent
):
    if PDL:
        gdc_launch_dependents()  # the split-merge kernel may launch now; it waits for this grid
    kvh = tl.program_id(0) % num_kv_heads  # heads fastest: one q tile's heads run side by side
    pid = tl.num_programs(0) // num_kv_heads - 1 - tl.program_id(0) // num_kv_heads  # last q tiles first
    split = tl.program_id(1)

    if DECODE_ONLY:  # one query token per request: program = request
        seq = pid
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        q_tile = 0
        if q_len == 0:
            return
    else:  # the request of this q tile in the ragged grid (``q_tiles``)
        seq, q_start, q_len, q_tile = q_tile_of(qsl_ptr, num_seqs, pid, BLOCK_Q)
        if q_tile * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // G  # token index within the request's new tokens
    head = kvh * G + rows % G
    row_ok = (rows // G < BLOCK_Q) & (tok < q_len)
    qpos = ctx + tok
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < HEAD_DIM
    t_idx = (q_start + tok).to(tl.int64)
    q_off = t_idx[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dmask[None, :], other=0.0)
    # fp8: fp16 operands (e4m3 converts to fp16 exactly and cheaply); q pre-scaled keeps it in range
    if Q_FOLD == 0:
        q = q.to(tl.float32)
        if FP8:
            q = (q * sm_scale).to(DOT_DTYPE)
            scale = LOG2E_C * tl.load(k_scale_ptr)
        else:
            q = q.to(DOT_DTYPE)
            scale = sm_scale * LOG2E_C
    else:  # q carries softmax scale * log2(e): scores come out of the dot in the log2 domain
        q = q.to(DOT_DTYPE)
        scale = tl.load(k_scale_ptr) if FP8 else 1.0
    SCALE_S: tl.constexpr = FP8 or Q_FOLD == 0

    # KV positions this tile needs: [kv_lo, q_last], tiles of TILE_N.
    q_first = ctx + q_tile * BLOCK_Q
    q_last = tl.minimum(q_first + BLOCK_Q, seq_len) - 1
    tile_lo = 0
    if SLIDING:
        tile_lo = tl.maximum(q_first - window + 1, 0) // TILE_N
    tile_end = q_last // TILE_N + 1
    if SPLIT:
        per = tl.cdiv(tile_end - tile_lo, num_splits)
        t0 = tl.minimum(tile_lo + split * per, tile_end)
        t1 = tl.minimum(t0 + per, tile_end)
    else:
        t0 = tile_lo
        t1 = tile_end
    full_hi = t0  # with a sliding window every tile is masked
    if not SLIDING:
        full_hi = tl.minimum(tl.maximum((q_first + 1) // TILE_N, t0), t1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if PAIRS:  # fp8 cache read as int16 pairs: even / odd output columns accumulate apart
        H_PAD: tl.constexpr = D_PAD // 2
        q_e, q_o = tl.split(tl.reshape(q, [BLOCK_M, H_PAD, 2]))
        acc_e = tl.zeros([BLOCK_M, H_PAD], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_M, H_PAD], dtype=tl.float32)
        acc_e, acc_o, m_i, l_i = _attend_tiles_pairs(
            acc_e, acc_o, m_i, l_i, q_e, q_o, k_base, v_base, bt_row, qpos, seq_len, window, scale, t0, full_hi,
            stride_kb, stride_ks, stride_vb, stride_vs,
            False, SLIDING, TILE_N, BLOCK_SIZE, HEAD_DIM // 2, H_PAD, DOT_DTYPE, OFF32, PAIRS_ASM,
        )  # fmt: skip
        acc_e, acc_o, m_i, l_i = _attend_tiles_pairs(
            acc_e, acc_o, m_i, l_i, q_e, q_o, k_base, v_base, bt_row, qpos, seq_len, window, scale, full_hi, t1,
            stride_kb, stride_ks, stride_vb, stride_vs,
            True, SLIDING, TILE_N, BLOCK_SIZE, HEAD_DIM // 2, H_PAD, DOT_DTYPE, OFF32, PAIRS_ASM,
        )  # fmt: skip
        acc = tl.reshape(tl.join(acc_e, acc_o), [BLOCK_M, D_PAD])
    else:
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_base, v_base, bt_row, qpos, seq_len, window, scale, t0, full_hi,
            stride_kb, stride_ks, stride_vb, stride_vs,
            False, SLIDING, TILE_N, BLOCK_SIZE, HEAD_DIM, D_PAD, DOT_DTYPE, PRECISION, SCALE_S, OFF32,
        )  # fmt: skip
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_base, v_base, bt_row, qpos, seq_len, window, scale, full_hi, t1,
            stride_kb, stride_ks, stride_vb, stride_vs,
            True, SLIDING, TILE_N, BLOCK_SIZE, HEAD_DIM, D_PAD, DOT_DTYPE, PRECISION, SCALE_S, OFF32,
        )  # fmt: skip

    if FP8:
        acc = acc * tl.load(v_scale_ptr)
    o_mask = row_ok[:, None] & dmask[None, :]
    o_off = t_idx[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
    if SPLIT:
        tl.store(out_ptr + split.to(tl.int64) * stride_os + o_off, acc, mask=o_mask)
        ml_off = split.to(tl.int64) * stride_ms + t_idx * stride_mt + head
        tl.store(m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(l_ptr + ml_off, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=[*_BATCH_INTS, "stride_ms"])
def _reduce_splits_kernel(
    part_ptr,  # float32 [num_splits, T, H, D]
    m_ptr,  # float32 [num_splits, T, H]
    l_ptr,  # float32 [num_splits, T, H]
    out_ptr,  # [T, H, D]
    qsl_ptr,  # int32 [num_seqs + 1]
    num_seqs,
    num_splits,
    num_heads,
    stride_ps,
    stride_pt,
    stride_ms,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr = 0,  # > 0: past MERGE_SERIAL_MAX splits, load BLOCK_S at once (a round trip each)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the attention kernel
):
    """Merge the splits' partial softmax sums of BLOCK_H heads of one token."""
    t = tl.program_id(0).to(tl.int64)
    # The token count is an input of the step (written before the attention kernel ran): read
    # before the wait, its memory round trip overlaps the attention kernel's tail (H200: 1-2%
    # per decode call at 8 x 4k and 1 x 32k, both cache dtypes)
    num_tokens = tl.load(qsl_ptr + num_seqs)
    if PDL:
        gdc_wait()  # the attention kernel's partials are complete and visible
    if t >= num_tokens:
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    d = tl.arange(0, D_PAD)
    mask = hmask[:, None] & (d < HEAD_DIM)[None, :]
    m_run = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], dtype=tl.float32)
    n_serial = num_splits
    if BLOCK_S > 0:  # many splits: BLOCK_S per memory round trip (few: one by one, measured faster)
        n_block = tl.where(num_splits > MERGE_SERIAL_MAX, num_splits, 0)
        n_serial = num_splits - n_block
        for s0 in range(0, n_block, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            sm_mask = (s < num_splits)[:, None] & hmask[None, :]  # [S, H]
            ml_off = s[:, None].to(tl.int64) * stride_ms + t * num_heads + h[None, :]
            m = tl.load(m_ptr + ml_off, mask=sm_mask, other=float("-inf"))
            l_s = tl.load(l_ptr + ml_off, mask=sm_mask, other=0.0)
            p_off = s[:, None, None].to(tl.int64) * stride_ps + t * stride_pt + h[None, :, None] * HEAD_DIM
            part = tl.load(part_ptr + p_off + d[None, None, :], mask=sm_mask[:, :, None] & mask[None, :, :],
                           other=0.0)
            m_c = tl.max(m, axis=0)  # the chunk as one split, then merged like one
            w = tl.math.exp2(m - tl.where(m_c == float("-inf"), 0.0, m_c)[None, :])  # absent splits: 0
            acc, m_run, l_run = _merge_split(acc, m_run, l_run, tl.sum(part * w[:, :, None], axis=0), m_c,
                                             tl.sum(l_s * w, axis=0))
    for s in range(n_serial):
        ml_off = s * stride_ms + t * num_heads + h
        m = tl.load(m_ptr + ml_off, mask=hmask, other=float("-inf"))
        l_s = tl.load(l_ptr + ml_off, mask=hmask, other=0.0)
        part = tl.load(part_ptr + s * stride_ps + t * stride_pt + h[:, None] * HEAD_DIM + d[None, :], mask=mask,
                       other=0.0)
        acc, m_run, l_run = _merge_split(acc, m_run, l_run, part, m, l_s)
    out = acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape, launch settings and code-path variants of one paged-attention launch.

    The variant fields default to the untuned baseline; ``pick_config`` turns on the ones the
    H200 sweep measured faster, per regime (see there and the module docstring).
    """

    block_m: int  # query rows per program (tokens x heads of one KV head), power of 2 >= 16
    tile_n: int  # KV positions per inner step, power of 2 >= 16
    num_warps: int
    num_stages: int
    q_fold: int = 0  # 0 scores scaled per tile, 2 softmax scale folded into q by the launcher
    offsets32: bool = False  # int32 K/V offsets when every offset fits (checked per call)
    maxnreg: int = 0  # > 0: cap registers per thread (more programs per SM; may spill)
    fp8_pairs: bool = False  # fp8 caches: read K/V as int16 pairs (even head_dim, 16-bit queries)
    reduce_block: int = 0  # > 0: past 8 splits the split-merge kernel loads this many at once (else one by one)
    pdl: bool = False  # split-merge kernel launched as a programmatic dependent (overlaps its launch)
    programs_per_sm: int = 2  # context splits aim at this many programs per SM (match the occupancy)


SMEM_BUDGET = 227 * 1024  # shared memory one program may use: the H200's per-block opt-in maximum, 232,448 B
MERGE_BLOCK = 64  # decode: splits the merge kernel loads at once (past MERGE_SERIAL_MAX of them)
LONG_PREFILL = 4096  # prefill: KV extent past which 32-position KV tiles give way to longer ones


def smem_bytes(block_m: int, tile_n: int, stages: int, head_dim: int, kv_elem: int = 2, q_elem: int = 2) -> int:
    """Shared memory the attention kernel's main loop allocates under Triton 3.6 (upper estimate).

    16-bit dot operands: the K/V loads of a tile depend on the block ids loaded for that same
    tile, so the pipeliner issues them one stage later than the index load: ``stages - 2``
    buffers each of K and V (at least one), ``stages - 1`` of the int32 block ids, plus the q
    tile, and one 16-bit copy each of K and V when an fp8 cache is converted for the MMA.
    It gives the 231,424 B that Triton reported compiling 128/128, 8 warps, 5 stages, bf16,
    head_dim 128 for the H200 (budget 232,448 B).
    fp32 queries (FMA dots, operands converted through shared memory) keep the older, fully
    buffered estimate that the fp32 tests on the H200 were run against.
    """
    d_pad = next_pow2(head_dim)
    q_tile = block_m * d_pad * q_elem
    if q_elem != 2:
        return stages * 2 * tile_n * d_pad * kv_elem + q_tile
    kv = max(stages - 2, 1) * 2 * tile_n * d_pad * kv_elem
    converted = 2 * tile_n * d_pad * 2 if kv_elem != 2 else 0
    return kv + converted + (stages - 1) * tile_n * 4 + q_tile


def pick_config(
    max_query_len: int,
    group: int,
    head_dim: int,
    kv_elem: int = 2,
    q_elem: int = 2,
    *,
    max_seq_len: int | None = None,
    smem_budget: int = SMEM_BUDGET,
    baseline: bool = False,
) -> AttentionConfig:
    """Decode-shaped steps get small query tiles (memory bound); prefill big ones (matmul bound).

    Winners of the H200 variant sweep (docs/BENCHMARKS.md, "Variant sweep"; 32/8 heads,
    head_dim 128, bf16 unless said), per regime:

    - decode, every cache: int32 offsets, and the split merge kernel (where there is one)
      reading more than 8 splits in blocks of ``MERGE_BLOCK`` and launched as a programmatic
      dependent (2026-11-30: 1.15x at 1 x 32k and 1.21x at 1 x 4k bf16, 33 / 16 splits;
      the one-by-one loop paid a memory round trip per split; at 4 splits the blocks cost
      2-3%, hence serial up to 8).
    - decode, 16-bit cache: the splits stay merged by the second kernel: as a programmatic
      dependent it was 1.5% faster than merging in the attention kernel (the last split
      program to finish merging, behind an atomic counter) at 8 x 4k, equal at 8 x 32k
      (2026-11-30), and 5-24% faster with few programs.
    - decode, fp8 cache, 16-bit q: ``fp8_pairs`` (2026-11-29: 1.17-1.43x the fp8 baseline
      over 11 cells) with a 128-register cap (head_dim 128 takes 154 registers, 3 programs per
      SM; capped, 4) and context splits aimed at 4 programs per SM (``programs_per_sm``): at
      batch 8 the old 2-per-SM splits left half the slots empty (8 x 32k: 1.48x -> 1.82x bf16;
      8 x 4k: 1.37x -> 1.51x, 2026-11-30).
    - prefill, every dtype: int32 offsets, the softmax scale folded into q by the launcher
      (``q_fold`` 2; in the engine the rotary kernel folds it in instead, ``query_prescale``,
      and the launcher's pass over q goes; the scale inside the exp2 instead, ``q_fold`` 0, saves that elementwise
      pass, 1.08x at 2k, but SmolLM2's bf16 logprobs came out further from fp32 with it on
      the H200 and on the CPU: 0.23 vs 0.20 worst top-5 error, see docs/BENCHMARKS.md).
      16-bit q, KV extent up to ``LONG_PREFILL``: 128-row q tiles, 32-position KV tiles, 5
      stages, a 128-register cap (2 programs per SM; the 2k winner of 2026-11-29, 0.5-1%
      ahead of 256-row tiles there). Past it: 256-row q tiles (64 tokens x 4 heads at GQA 4)
      over 64-position KV tiles, 3 stages, when there are more than 128 query rows (2026-11-30,
      8k: 1.03-1.04x the 2026-11-29 pick of 128 / 128, 5 stages, which short chunks over
      long contexts keep). fp32 queries keep the baseline tile shape.

    ``baseline``: the untuned configuration (128-position tiles, 3 stages, all variant flags
    off) that ``bench kernels --variants`` times the variants against. Stages, then the KV
    tile, shrink until ``smem_bytes`` fits ``smem_budget``. int32 offsets are a request: the
    launcher falls back to int64 when the cache is too large.
    """
    d_pad = next_pow2(head_dim)
    extra: dict = {}
    sixteen = kv_elem == 2 and q_elem == 2
    if max_query_len * group <= 16:
        block_m, tile_n, warps, stages = max(16, next_pow2(group)), 128, 4, 3
        merge = {"offsets32": True, "reduce_block": MERGE_BLOCK, "pdl": True}
        if not baseline and sixteen:
            extra = merge
        elif not baseline and kv_elem == 1 and q_elem == 2 and head_dim % 2 == 0:
            # 128 registers: 4 programs per SM instead of 3 at head_dim 128; splits to match
            extra = {**merge, "fp8_pairs": True, "maxnreg": 128, "programs_per_sm": 4}
    elif d_pad <= 128:
        block_m, tile_n, warps, stages = max(128, next_pow2(group)), 128, 8, 3
        if not baseline:
            extra = {"q_fold": 2, "offsets32": True}
            long = max(max_seq_len or 0, max_query_len) > LONG_PREFILL
            wide = max(256, next_pow2(group))  # 256-row q tiles: a K/V tile feeds twice the rows
            if (q_elem == 2 and long and max_query_len * group > 128
                    and smem_bytes(wide, 64, 3, head_dim, kv_elem) <= smem_budget):
                block_m, tile_n = wide, 64
            elif q_elem == 2:
                stages = 5
                if not long:
                    tile_n, extra["maxnreg"] = 32, 128
    else:
        block_m, tile_n, warps, stages = max(64, next_pow2(group)), 64, 8, 2

    while smem_bytes(block_m, tile_n, stages, head_dim, kv_elem, q_elem) > smem_budget and (
        stages > 2 or tile_n > 16
    ):
        if stages > 2:
            stages -= 1
        else:
            tile_n //= 2
    return AttentionConfig(block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages, **extra)


_DEVICE_FACTS: dict[tuple[str, int], object] = {}  # (fact, CUDA device index) -> value, looked up once


def _device_fact(name: str, device: torch.device, compute):
    """``compute(index)`` for a CUDA device, cached per (name, device index)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if (name, idx) not in _DEVICE_FACTS:
        _DEVICE_FACTS[name, idx] = compute(idx)
    return _DEVICE_FACTS[name, idx]


def _sm_count(device: torch.device) -> int:
    return _device_fact("sms", device, lambda i: torch.cuda.get_device_properties(i).multi_processor_count)


def _smem_budget(device: torch.device) -> int:
    """Per-program shared memory a config may plan for: the device's opt-in maximum on CUDA."""
    if device.type != "cuda":
        return SMEM_BUDGET
    return _device_fact("smem", device, lambda i: int(
        getattr(torch.cuda.get_device_properties(i), "shared_memory_per_block_optin", 0) or SMEM_BUDGET))


def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (``griddepcontrol``) exists from sm_90 (Hopper) on, and in
    Triton from 3.3 (``gdc_wait`` / ``launch_pdl``)."""
    return _device_fact("pdl", device, lambda i: gdc_wait is not None and torch.cuda.get_device_capability(i)[0] >= 9)


def _fits_int32(cache: torch.Tensor) -> bool:
    """Every in-kernel offset into one head of ``cache`` [NB, BS, Hkv, D] (block, slot and
    padded dim; the head is added in 64-bit) is below 2^31."""
    nb, bs = cache.shape[0], cache.shape[1]
    return (nb - 1) * cache.stride(0) + (bs - 1) * cache.stride(1) + next_pow2(cache.shape[-1]) < 2**31


def query_prescale(query: torch.Tensor, kv_cache: torch.Tensor, scale: float, max_query_len: int,
                   max_seq_len: int) -> float | None:
    """Where ``paged_attention`` (default config) would multiply q by the softmax scale x log2(e)
    itself (``q_fold`` 2: prefill), that factor, else None. A caller that writes q anyway (the
    engine's rotary kernel, ``rotary(q_scale=)``) multiplies it in there, rounded as the
    launcher's ``torch.mul`` rounds it, and passes ``q_scaled=True``: the kernel gets the same bits
    without the launcher's elementwise pass over q."""
    hkv, d = kv_cache.shape[3], query.shape[2]
    if hkv == 0 or query.shape[1] % hkv:
        return None  # (paged_attention raises)
    cfg = pick_config(max_query_len, query.shape[1] // hkv, d, kv_cache.element_size(), query.element_size(),
                      max_seq_len=max_seq_len, smem_budget=_smem_budget(query.device))
    return scale * LOG2E if cfg.q_fold == 2 else None


def device_sms(device: torch.device) -> int | None:
    """The multiprocessor count of a CUDA device; None on the CPU (no context splits there)."""
    return _sm_count(device) if device.type == "cuda" else None


def pick_num_splits(num_programs: int, max_seq_len: int, tile_n: int, sms: int | None, per_sm: int = 2) -> int:
    """Context splits so few long requests still fill the GPU; 1 on the CPU (``sms`` None, see
    ``device_sms``) or when already full.

    About ``per_sm`` programs per SM (the config's occupancy), each split keeping >= 2 KV tiles
    (best in H200 sweeps).
    """
    if sms is None:
        return 1
    target = per_sm * sms
    max_by_len = max(1, triton.cdiv(max_seq_len, tile_n) // 2)
    return int(max(1, min(target // max(num_programs, 1), max_by_len, 64)))


def launch_plan(
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_elem: int,
    q_elem: int,
    *,
    smem_budget: int = SMEM_BUDGET,
    sms: int | None = None,
    config: AttentionConfig | None = None,
    num_splits: int | None = None,
) -> tuple[AttentionConfig, int, bool]:
    """(config, context splits, decode-only grid) of one launch: what ``paged_attention`` runs,
    and (with the cache and dtypes) which compiled kernel variant it needs. ``sms``: the GPU's
    multiprocessor count (None: the CPU, no splits)."""
    group = num_heads // num_kv_heads
    cfg = config or pick_config(max_query_len, group, head_dim, kv_elem, q_elem, max_seq_len=max_seq_len,
                                smem_budget=smem_budget)
    if cfg.block_m < group or cfg.block_m < 16 or cfg.tile_n < 16:
        raise ValueError(f"bad attention config {cfg} for {group} query heads per KV head")
    if cfg.q_fold not in (0, 2) or cfg.maxnreg < 0 or cfg.programs_per_sm < 1:
        raise ValueError(f"bad attention config {cfg}")
    block_q = cfg.block_m // group
    decode_only = max_query_len <= 1
    if num_splits is None:
        grid_q = num_seqs if decode_only else ragged_grid(num_tokens, num_seqs, block_q)
        busy = min(grid_q, num_seqs * triton.cdiv(max(max_query_len, 1), block_q))  # programs not exiting
        num_splits = pick_num_splits(busy * num_kv_heads, max_seq_len, cfg.tile_n, sms, cfg.programs_per_sm)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return cfg, num_splits, decode_only


def warmup_shapes(num_kv_heads: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
                  ) -> list[tuple[int, int, int, int]]:
    """Small step shapes (num_seqs, tokens, max_query_len, max_seq_len) that together reach every
    launch variant an engine with these limits can meet: decode-only and mixed grids, short and
    long KV tiles, with and without context splits, few and many (request, KV head) programs.
    Token counts stay small (at most 4096): compiling needs the variant, not the real size."""
    seqs = sorted({min(n, max_num_seqs) for n in (1, 2, 8, 64, 512)})
    lens = sorted({min(n, max_model_len) for n in (1, 32, LONG_PREFILL, LONG_PREFILL + 1, max_model_len)})
    most = min(max_num_batched_tokens, 4096)
    out = []
    for n in seqs:
        for q in (1, 2, 3, 17, 64, 512, most if n == 1 else 0):  # one long prompt: many programs, no split
            t = n * q
            if 0 < t <= most and q <= max_model_len:
                out.extend((n, t, q, ln) for ln in {*lens, q} if ln >= q)  # ln = q: a fresh prompt
    return sorted(set(out))


def warm_up(kv_cache: torch.Tensor, query_dtype: torch.dtype, num_heads: int, *, max_num_seqs: int,
            max_num_batched_tokens: int, max_model_len: int, max_blocks: int, sliding_window: int | None = None,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> int:
    """Compile (not run) every kernel variant ``warmup_shapes`` reaches for this cache, so that no
    step of a running engine stops to compile (seconds on a new step shape: a server's first
    request of that shape). Block tables are ``max_blocks`` wide, as the engine's step buffers.
    Compiles run in parallel where Triton supports it. Returns how many launches were planned
    (Triton skips those already compiled); 0 in the interpreter."""
    if interpreting() or kv_cache.device.type != "cuda":
        return 0
    dev = kv_cache.device
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    shapes = warmup_shapes(hkv, max_num_seqs, max_num_batched_tokens, max_model_len)
    with async_compiles():
        for n, t, q, ln in shapes:
            query = torch.empty((t, num_heads, d), dtype=query_dtype, device=dev)
            qsl = torch.arange(0, t + 1, q, dtype=torch.int32, device=dev)
            paged_attention(query, kv_cache, torch.zeros((n, max_blocks), dtype=torch.int32, device=dev),
                            torch.full((n,), ln, dtype=torch.int32, device=dev), qsl, d**-0.5, k_scale, v_scale,
                            sliding_window, max_query_len=q, max_seq_len=ln, compile_only=True)
    return len(shapes)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    out: torch.Tensor | None = None,
    compile_only: bool = False,
    q_scaled: bool = False,
) -> torch.Tensor:  # [T, H, D], dtype of query
    """Triton twin of ``paged_attention_ref``. Rows at or past ``query_start_loc[-1]`` are not written.

    ``max_query_len``/``max_seq_len`` are host ints, exact or upper bounds (computed with a
    device sync when omitted); they pick the tile shape (``config`` forces it), the number of
    context splits (``num_splits`` forces it) and, when ``max_query_len <= 1``, the
    decode-only grid (one program per request and KV head, no search).

    ``q_scaled``: ``query`` already carries the softmax scale x log2(e) (``query_prescale``); the
    kernel then takes it as it is (``q_fold`` 2 whatever the config says).

    ``compile_only`` compiles the kernels this call would launch and launches nothing (``out``
    is returned unwritten); under Triton's ``AsyncCompileMode`` the compiles run on its
    executor, which is how ``bench kernels --variants`` warms many variants in parallel.
    """
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    device = check_device(query, "query")
    t, h, d = query.shape
    check_tensor("kv_cache", kv_cache, shape=(2, None, None, None, d), dtypes=(query.dtype, FP8_DTYPE),
                 device=device)
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    if hkv == 0 or h % hkv:
        raise ValueError(f"num_heads {h} must be a multiple of num_kv_heads {hkv}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    num_seqs = block_tables.shape[0]
    check_tensor("seq_lens", seq_lens, shape=(num_seqs,), dtypes=(torch.int32,), device=device)
    check_tensor("query_start_loc", query_start_loc, shape=(num_seqs + 1,), dtypes=(torch.int32,),
                 device=device)
    if out is None:
        out = torch.empty((t, h, d), dtype=query.dtype, device=device)
    else:
        check_tensor("out", out, shape=(t, h, d), dtypes=(query.dtype,), device=device)
    if t == 0 or num_seqs == 0:
        return out
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    fp8 = kv_cache.dtype == FP8_DTYPE
    ks = scale_tensor(k_scale, device, "k_scale")
    vs = scale_tensor(v_scale, device, "v_scale")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())

    group = h // hkv
    cfg, num_splits, decode_only = launch_plan(
        t, num_seqs, max_query_len, max_seq_len, h, hkv, d, kv_cache.element_size(), query.element_size(),
        smem_budget=_smem_budget(device), sms=device_sms(device),
        config=config, num_splits=num_splits)
    block_q = cfg.block_m // group
    grid_q = num_seqs if decode_only else ragged_grid(t, num_seqs, block_q)

    kc, vc = kv_cache[0], kv_cache[1]
    if kc.stride(-1) != 1 or query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("query, kv_cache and out must be contiguous in head_dim")
    pairs = cfg.fp8_pairs and fp8 and d % 2 == 0 and query.dtype != torch.float32
    if pairs:  # the kernel reads two e4m3 values per int16 word; offsets count words
        kc, vc = kc.view(torch.int16), vc.view(torch.int16)
    split = num_splits > 1
    if split:
        # compile_only: small stand-ins (the compile needs the dtypes and the strides below only)
        ns, nt = (1, 1) if compile_only else (num_splits, t)
        part = torch.empty((ns, nt, h, d), dtype=torch.float32, device=device)
        m_buf = torch.empty((ns, nt, h), dtype=torch.float32, device=device)
        l_buf = torch.empty_like(m_buf)
        dst, o_st, o_sh, o_ss = part, h * d, d, t * h * d  # contiguous [num_splits, T, H, D]
        m_st, m_ss = h, t * h  # contiguous [num_splits, T, H]
    else:
        m_buf = l_buf = out  # unused
        dst, o_st, o_sh, o_ss = out, out.stride(0), out.stride(1), 0
        m_st = m_ss = 0
    dot_dt = dot_dtype(torch.float16 if fp8 and query.dtype != torch.float32 else query.dtype)
    precision = "ieee" if query.dtype == torch.float32 or interpreting() else "tf32"
    opts = {"maxnreg": cfg.maxnreg} if cfg.maxnreg and not interpreting() else {}
    pdl = cfg.pdl and split and not interpreting() and _has_pdl(device)
    off32 = cfg.offsets32 and _fits_int32(kc) and _fits_int32(vc)
    q_in = query
    q_fold = 2 if q_scaled else cfg.q_fold
    if cfg.q_fold == 2 and not q_scaled:  # fold softmax scale (* log2 e, the kernel's exp2 domain) into q here
        q_in = torch.mul(query, scale * LOG2E)
    if compile_only and interpreting():
        return out

    def launch(kernel, grid):  # launch, or only compile (Triton's warmup: same specialization)
        return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]

    launch(_paged_attention_kernel, (grid_q * hkv, num_splits))(
        q_in, kc, vc, dst, m_buf, l_buf, block_tables, seq_lens, query_start_loc, ks, vs,
        float(scale), hkv, num_seqs, num_splits, int(sliding_window or 0),
        q_in.stride(0), q_in.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        o_st, o_sh, o_ss, m_st, m_ss,
        block_tables.stride(0),
        G=group, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n, BLOCK_SIZE=bs,
        HEAD_DIM=d, D_PAD=next_pow2(d), FP8=fp8, SLIDING=sliding_window is not None, SPLIT=split,
        DECODE_ONLY=decode_only, DOT_DTYPE=dot_dt, PRECISION=precision,
        Q_FOLD=q_fold, OFF32=off32, PAIRS=pairs, PAIRS_ASM=pairs and not interpreting(), PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts,
    )  # fmt: skip
    if split:
        block_h = next_pow2(h) if interpreting() else 1  # the interpreter pays per program
        launch(_reduce_splits_kernel, (t, triton.cdiv(h, block_h)))(
            part, m_buf, l_buf, out, query_start_loc, num_seqs, num_splits, h,
            o_ss, o_st, m_ss, out.stride(0), out.stride(1),
            HEAD_DIM=d, D_PAD=next_pow2(d), BLOCK_H=block_h, BLOCK_S=cfg.reduce_block, PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return out

