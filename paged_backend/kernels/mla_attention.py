"""Multi-head latent attention over a paged latent cache in Triton (``mla_attention_ref``'s contract).

``write_latent_cache`` stores the step's new latents [T, D] at ``slot_mapping`` (-1: skipped; e4m3 caches
store latent / kv_scale). ``mla_attention`` then attends: one program per (query row, BLOCK_H heads), the
row's request and position found on the device (``row_positions``: no host sync, CUDA-graph capturable).
Each program loads its heads' absorbed query once, in two parts (the latent's DV dims and the rotary
DR dims, so D = DV + DR = 576 needs no padding to 1024), and walks the request's keys, BLOCK_N a step
(``DECODE_KEYS``: gathered across cache blocks through the block table), with an online softmax::

    s   = (q_lat . k_lat + q_pe . k_pe) * scale * kv_scale       [BLOCK_H, BLOCK_N], keys past the row's
                                                                 position masked
    acc = acc * exp(m_old - m_new) + exp(s - m_new) @ k_lat      [BLOCK_H, DV]   (the latent is the value)
    out = acc / l * kv_scale

All heads of a request share the latents, so a program reads each cached token once for BLOCK_H heads (MQA:
DeepSeek-V2-Lite's 16 heads in one program). Few rows over long contexts (decode at small batch) split each
row's blocks over ``splits`` programs (``pick_splits``: two programs per SM); each writes its unnormalised
fp32 sum and its running max and denominator, and ``_mla_merge_kernel`` combines them by log-sum-exp.

Steps with a prompt chunk (``max_query_len`` > 1) run ``_mla_prefill_kernel`` instead: one program per
(ROWS consecutive rows of one request, BLOCK_H heads; ``q_tiles``' ragged grid, so a step's decode rows beside
a long chunk cost one program each), its ROWS * BLOCK_H query rows sharing each key read,
BLOCK_N keys a step gathered across cache blocks, causal per row (``prefill_tile_for``). The absorbed form
costs (DV + DR + DV) / (qk_nope + qk_rope + v) ~ 3.4x the FLOPs of attention over decompressed per-head
K/V (DeepSeek's dims); it reads no more than the latent cache. DV and DR must be powers of two >= 16 (``supported``);
``tl.dot`` needs 16 rows, so BLOCK_H is at least 16 (padded heads load zeros and store nothing). The
products accumulate in fp32; fp32 queries use full-precision dots.

e4m3 latents, 16-bit queries: decode reads the cache as int16 words of two values (``reads_pairs``,
``e4m3_pairs``): the even and odd dims of each latent become two fp16 tiles, the queries are loaded split the
same way, and the even and odd output dims accumulate apart, so the latent tile is pipelined through shared
memory and the value operand is a 16-bit tile (read as bytes, the compiler loads the transposed 8-bit value
tile from shared memory one byte at a time and cannot pipeline the load that feeds both products). A step with
prompt chunks follows ``step_plan``: given the host's query lengths (exactly the step's rows: not a step padded
for a CUDA graph), its single-row requests' rows are gathered into the decode kernel and put back, the prefill
kernel skipping them; the prefill kernel reads a 16-bit copy of the chunks' blocks made first
(``dequantize_blocks``: each block converted once, not once per tile of rows that reads it), within
``DEQUANTIZE_MAX_BYTES``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_backend.kernels._launch import dot_dtype, interpreting, next_pow2
from paged_backend.kernels.e4m3_pairs import e4m3_pairs
from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX
from paged_backend.kernels.q_tiles import q_tile_of, ragged_grid


def supported(v_dim: int, rope_dim: int) -> bool:
    """Whether the kernel takes a latent of ``v_dim`` + ``rope_dim`` dims (both powers of two >= 16)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (v_dim, rope_dim))


@triton.jit
def _latent_write_kernel(latent_ptr, cache_ptr, slots_ptr, scale_ptr, stride_lt, D, FP8: tl.constexpr,
                         BLOCK_D: tl.constexpr, LIMIT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(latent_ptr + t * stride_lt + offs, mask=ok, other=0.0).to(tl.float32)
    if FP8:
        x = tl.clamp(x / tl.load(scale_ptr), -LIMIT, LIMIT)
    tl.store(cache_ptr + slot.to(tl.int64) * D + offs, x.to(cache_ptr.dtype.element_ty), mask=ok)


def write_latent_cache(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_scale: torch.Tensor | None = None) -> None:
    """``write_latent_cache_ref`` as one launch (``cache`` contiguous [num_blocks, block_size, D])."""
    t, d = latent.shape
    if t == 0:
        return
    fp8 = cache.dtype == FP8_DTYPE
    scale = kv_scale if kv_scale is not None else torch.ones((), dtype=torch.float32, device=latent.device)
    _latent_write_kernel[(t,)](latent, cache, slot_mapping, scale, latent.stride(0), d, FP8=fp8,
                               BLOCK_D=next_pow2(d), LIMIT=FP8_MAX)


def row_positions(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_rows: int) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """int32 (request, position) of each of the step's ``num_rows`` query rows, on the device."""
    rows = torch.arange(num_rows, device=seq_lens.device, dtype=torch.int32)
    req = torch.searchsorted(query_start_loc[1:].to(torch.int32), rows, right=True).to(torch.int32)
    pos = seq_lens.to(torch.int32)[req] - (query_start_loc.to(torch.int32)[req + 1] - rows)
    return req, pos


@triton.jit
def _key_rows(cache_ptr, table, stride_cb, keys, k_ok, BLOCK_SIZE: tl.constexpr, WIDTH: tl.constexpr):
    """Pointers [keys, 1] to each key's latent (``WIDTH`` cache elements a token), through the block ``table``."""
    block = tl.load(table + keys // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    return cache_ptr + block[:, None] * stride_cb + (keys % BLOCK_SIZE)[:, None] * WIDTH


@triton.jit
def _softmax_update(s, visible, qk_scale, m_i, l_i):
    """The online softmax over one step's scores ``s`` [rows, keys]: (p, the old sums' rescale, new max, new
    denominator)."""
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _key_step(q_lat, q_pe, cache_ptr, table, stride_cb, keys, k_ok, visible, qk_scale, m_i, l_i, acc,
              BLOCK_SIZE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, DOT_DTYPE: tl.constexpr,
              IEEE: tl.constexpr):
    """One online-softmax step over ``keys`` (gathered through the block ``table``; ``k_ok``: loaded,
    ``visible`` [rows, keys]: attended), both kernels' loop body; returns the new (m, l, acc)."""
    base = _key_rows(cache_ptr, table, stride_cb, keys, k_ok, BLOCK_SIZE, DV + DR)
    dv = tl.arange(0, DV)
    dr = tl.arange(0, DR)
    k_lat = tl.load(base + dv[None, :], mask=k_ok[:, None], other=0.0).to(DOT_DTYPE)
    k_pe = tl.load(base + DV + dr[None, :], mask=k_ok[:, None], other=0.0).to(DOT_DTYPE)
    if IEEE:
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
    else:
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_pe, tl.trans(k_pe), s)
    p, alpha, m_new, l_i = _softmax_update(s, visible, qk_scale, m_i, l_i)
    if IEEE:
        acc = tl.dot(p.to(DOT_DTYPE), k_lat, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(DOT_DTYPE), k_lat, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _key_step_pairs(q_a, q_b, qr_a, qr_b, cache_ptr, table, stride_cb, keys, k_ok, visible, qk_scale, m_i, l_i,
                    acc_a, acc_b, BLOCK_SIZE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """``_key_step`` over an e4m3 cache read as int16 words (``cache_ptr`` int16, ``stride_cb`` in words):
    ``e4m3_pairs`` splits each latent into its even (a) and odd (b) dims, the queries come split the same way,
    and the even and odd output dims accumulate apart (``acc_a``, ``acc_b``)."""
    base = _key_rows(cache_ptr, table, stride_cb, keys, k_ok, BLOCK_SIZE, (DV + DR) // 2)
    jv = tl.arange(0, DV // 2)
    jr = tl.arange(0, DR // 2)
    k_a, k_b = e4m3_pairs(tl.load(base + jv[None, :], mask=k_ok[:, None], other=0), ASM)
    r_a, r_b = e4m3_pairs(tl.load(base + DV // 2 + jr[None, :], mask=k_ok[:, None], other=0), ASM)
    k_a = k_a.to(DOT_DTYPE)
    k_b = k_b.to(DOT_DTYPE)
    s = tl.dot(q_a, tl.trans(k_a))
    s = tl.dot(q_b, tl.trans(k_b), s)
    s = tl.dot(qr_a, tl.trans(r_a.to(DOT_DTYPE)), s)
    s = tl.dot(qr_b, tl.trans(r_b.to(DOT_DTYPE)), s)
    p, alpha, m_new, l_i = _softmax_update(s, visible, qk_scale, m_i, l_i)
    p = p.to(DOT_DTYPE)
    acc_a = tl.dot(p, k_a, acc_a * alpha[:, None])
    acc_b = tl.dot(p, k_b, acc_b * alpha[:, None])
    return m_new, l_i, acc_a, acc_b


@triton.jit
def _load_pairs(rows, ok, D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Dims 0, 2, 4, ... and 1, 3, 5, ... of ``D`` values at each of ``rows`` (pointers [R, 1])."""
    j = tl.arange(0, D // 2)
    a = tl.load(rows + 2 * j[None, :], mask=ok[:, None], other=0.0).to(DOT_DTYPE)
    b = tl.load(rows + 2 * j[None, :] + 1, mask=ok[:, None], other=0.0).to(DOT_DTYPE)
    return a, b


@triton.jit
def _store_pairs(rows, ok, a, b, D: tl.constexpr):
    """``a`` into dims 0, 2, 4, ... and ``b`` into dims 1, 3, 5, ... of ``D`` values at each of ``rows``."""
    j = tl.arange(0, D // 2)
    tl.store(rows + 2 * j[None, :], a.to(rows.dtype.element_ty), mask=ok[:, None])
    tl.store(rows + 2 * j[None, :] + 1, b.to(rows.dtype.element_ty), mask=ok[:, None])


@triton.jit(do_not_specialize=["H", "T", "keys_per_split"])  # batch sizes: one compile for all
def _mla_attention_kernel(
    q_ptr,  # [T, H, DV + DR]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, DV + DR]
    tables_ptr,  # int32 [num_seqs, max_blocks]
    req_ptr,  # int32 [T]
    pos_ptr,  # int32 [T]
    scale_ptr,  # float32 [] kv_scale
    out_ptr,  # [T, H, DV]; SPLITS > 1: float32 partial sums [SPLITS, T, H, DV]
    ml_ptr,  # SPLITS > 1: float32 [SPLITS, T, H, 2]: each split's running max and sum
    H,
    T,
    sm_scale,
    keys_per_split,  # a multiple of BLOCK_N
    stride_qt,
    stride_qh,
    stride_cb,
    stride_bt,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DV: tl.constexpr,
    DR: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per step (they may span cache blocks)
    PAIRS: tl.constexpr = False,  # e4m3 cache read as int16 words (_key_step_pairs); cache_ptr is int16
    ASM: tl.constexpr = False,  # PAIRS: e4m3_pairs' hardware conversion (not in the interpreter)
):
    t = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    req = tl.load(req_ptr + t)
    pos = tl.load(pos_ptr + t)
    dv = tl.arange(0, DV)
    dr = tl.arange(0, DR)
    q_rows = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    kv_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * kv_scale
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    first = split * keys_per_split
    last = tl.minimum(first + keys_per_split, pos + 1)  # this split's keys (maybe none)
    table = tables_ptr + req.to(tl.int64) * stride_bt
    o_rows = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    row = (split * T + t).to(tl.int64) * H + heads  # SPLITS > 1: this program's partial rows
    if PAIRS:
        q_a, q_b = _load_pairs(q_rows, h_ok, DV, DOT_DTYPE)
        qr_a, qr_b = _load_pairs(q_rows + DV, h_ok, DR, DOT_DTYPE)
        acc_a = tl.zeros((BLOCK_H, DV // 2), tl.float32)
        acc_b = tl.zeros((BLOCK_H, DV // 2), tl.float32)
        for k0 in range(first, last, BLOCK_N):
            keys = k0 + tl.arange(0, BLOCK_N)
            ok = keys < last
            m_i, l_i, acc_a, acc_b = _key_step_pairs(q_a, q_b, qr_a, qr_b, cache_ptr, table, stride_cb, keys, ok,
                                                     ok[None, :], qk_scale, m_i, l_i, acc_a, acc_b, BLOCK_SIZE,
                                                     DV, DR, DOT_DTYPE, ASM)
        if SPLITS == 1:
            norm = kv_scale / l_i[:, None]
            _store_pairs(o_rows, h_ok, acc_a * norm, acc_b * norm, DV)
        else:
            _store_pairs(out_ptr + row[:, None] * DV, h_ok, acc_a, acc_b, DV)
    else:
        q_lat = tl.load(q_rows + dv[None, :], mask=h_ok[:, None], other=0.0).to(DOT_DTYPE)
        q_pe = tl.load(q_rows + DV + dr[None, :], mask=h_ok[:, None], other=0.0).to(DOT_DTYPE)
        acc = tl.zeros((BLOCK_H, DV), tl.float32)
        for k0 in range(first, last, BLOCK_N):
            keys = k0 + tl.arange(0, BLOCK_N)
            ok = keys < last
            m_i, l_i, acc = _key_step(q_lat, q_pe, cache_ptr, table, stride_cb, keys, ok, ok[None, :], qk_scale,
                                      m_i, l_i, acc, BLOCK_SIZE, DV, DR, DOT_DTYPE, IEEE)
        if SPLITS == 1:
            out = acc / l_i[:, None] * kv_scale
            tl.store(o_rows + dv[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
        else:
            tl.store(out_ptr + row[:, None] * DV + dv[None, :], acc, mask=h_ok[:, None])
    if SPLITS > 1:  # unnormalised partials, merged by _mla_merge_kernel (a split without keys: m = -inf, l = 0)
        tl.store(ml_ptr + row * 2, m_i, mask=h_ok)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=h_ok)


@triton.jit(do_not_specialize=["H", "num_seqs"])
def _mla_prefill_kernel(
    q_ptr,  # [T, H, DV + DR]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, DV + DR]
    tables_ptr,  # int32 [num_seqs, max_blocks]
    seq_lens_ptr,  # int32 [num_seqs]
    qsl_ptr,  # int32 [num_seqs + 1]
    scale_ptr,  # float32 [] kv_scale
    out_ptr,  # [T, H, DV]
    H,
    num_seqs,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_bt,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,  # query rows of one request per program: ROWS * BLOCK_H MMA rows
    BLOCK_N: tl.constexpr,  # keys per step (they may span cache blocks)
    DV: tl.constexpr,
    DR: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    SKIP_SINGLE: tl.constexpr = False,  # requests of one row are the decode kernel's
):
    """Steps with prompt chunks: ROWS consecutive rows of one request x BLOCK_H heads a program, so each key
    read serves ROWS * BLOCK_H query rows (row r, head h at MMA row r * BLOCK_H + h); causal per row. Programs
    find their request and tile in the ragged grid (``q_tiles``), the last tiles (the most keys) first."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    req, q0, qlen, tile = q_tile_of(qsl_ptr, num_seqs, pid, ROWS)
    if tile * ROWS >= qlen:
        return  # past this request's rows (the grid has room for every request's last, partial tile)
    if SKIP_SINGLE and qlen == 1:
        return
    ctx = tl.load(seq_lens_ptr + req) - qlen
    M: tl.constexpr = ROWS * BLOCK_H
    m = tl.arange(0, M)
    row = tile * ROWS + m // BLOCK_H
    heads = tl.program_id(1) * BLOCK_H + m % BLOCK_H
    ok = (row < qlen) & (heads < H)
    pos = ctx + row  # rows past qlen: beyond every key walked below (no empty softmax)
    dv = tl.arange(0, DV)
    dr = tl.arange(0, DR)
    q_rows = q_ptr + (q0 + row).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + dv[None, :], mask=ok[:, None], other=0.0).to(DOT_DTYPE)
    q_pe = tl.load(q_rows + DV + dr[None, :], mask=ok[:, None], other=0.0).to(DOT_DTYPE)
    kv_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * kv_scale
    m_i = tl.full((M,), float("-inf"), tl.float32)
    l_i = tl.zeros((M,), tl.float32)
    acc = tl.zeros((M, DV), tl.float32)
    n_keys = ctx + tl.minimum(tile * ROWS + ROWS, qlen)  # the tile's last row sees keys 0 .. n_keys - 1
    table = tables_ptr + req.to(tl.int64) * stride_bt
    for k0 in range(0, n_keys, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        k_ok = keys < n_keys
        m_i, l_i, acc = _key_step(q_lat, q_pe, cache_ptr, table, stride_cb, keys, k_ok,
                                  keys[None, :] <= pos[:, None], qk_scale, m_i, l_i, acc, BLOCK_SIZE, DV, DR,
                                  DOT_DTYPE, IEEE)
    out = acc / l_i[:, None] * kv_scale
    o_rows = out_ptr + (q0 + row).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(o_rows + dv[None, :], out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _dequantize_blocks_kernel(cache_ptr, tables_ptr, seq_lens_ptr, base_ptr, out_ptr, stride_cb, stride_bt,
                              BLOCK_ELEMS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    """CHUNK values of cache block j of request r (while it holds some of the request's tokens) into ``out``
    block base[r] + j (base < 0: not this request), converted to ``out``'s dtype (exact: every e4m3 value is a
    bf16 / fp16 value)."""
    r = tl.program_id(0)
    j = tl.program_id(1)
    base = tl.load(base_ptr + r)
    if (base < 0) | (j * BLOCK_SIZE >= tl.load(seq_lens_ptr + r)):
        return
    block = tl.load(tables_ptr + r.to(tl.int64) * stride_bt + j).to(tl.int64)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < BLOCK_ELEMS
    x = tl.load(cache_ptr + block * stride_cb + offs, mask=ok)
    tl.store(out_ptr + (base + j).to(tl.int64) * BLOCK_ELEMS + offs, x.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _mla_merge_kernel(part_ptr, ml_ptr, scale_ptr, out_ptr, H, T, stride_ot, stride_oh, SPLITS: tl.constexpr,
                      DV: tl.constexpr):
    """out[t, h] = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s * kv_scale, over the splits, one split at
    a time (a split without keys, l_s = 0, is skipped and its partial sum not read)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.arange(0, DV)
    m = float("-inf")
    lsum = 0.0
    acc = tl.zeros((DV,), tl.float32)
    for s in range(SPLITS):
        row = (s * T + t).to(tl.int64) * H + h
        l_s = tl.load(ml_ptr + row * 2 + 1)
        valid = l_s > 0
        m_s = tl.where(valid, tl.load(ml_ptr + row * 2), float("-inf"))
        a_s = tl.load(part_ptr + row * DV + dv, mask=dv < tl.where(valid, DV, 0), other=0.0)
        m_new = tl.maximum(m, m_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        beta = tl.where(valid, tl.exp(m_s - m_ref), 0.0)
        acc = acc * alpha + a_s * beta
        lsum = lsum * alpha + l_s * beta
        m = m_new
    out = acc / lsum * tl.load(scale_ptr)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty))


def mla_attention(
    q: torch.Tensor,  # [T, H, D]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, D]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
    v_dim: int,
    kv_scale: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,  # the step's longest request (host int): picks the context split
    splits: int | None = None,  # programs a row's context is split over (default: from max_seq_len)
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,  # ``row_positions``, if the caller has them
    max_query_len: int | None = None,  # the step's most new rows of one request (host int); > 1: prefill kernel
    prefill_tile: tuple[int, int] | None = None,  # (ROWS, BLOCK_N) of the prefill kernel (default: prefill_tile_for)
    fp8_fp16_dots: bool = True,  # e4m3 read as bytes, 16-bit q: fp16 MMA operands (``mla_dot_dtype``); False: q's
    # dtype (word pairs are always fp16: what their conversion gives)
    decode_tile: tuple[int, int, int] | None = None,  # decode (BLOCK_N, num_warps, num_stages): decode_tile_for
    fp8_pairs: bool = True,  # decode, e4m3 cache, 16-bit q: read as int16 words (``reads_pairs``); False: as bytes
    dequantize: bool = True,  # prefill, e4m3 cache, 16-bit q: convert the chunks' blocks first (``dequantizes``)
    host_lens: tuple[list[int], list[int]] | None = None,  # (query lens, seq lens) on the host: ``step_plan``
    plan: StepPlan | None = None,  # a prefill step's ``step_plan``, if the caller has it
) -> torch.Tensor:  # [T, H, v_dim]
    """``mla_attention_ref`` in one launch, or a split launch and a merge; steps with a prompt chunk
    (``max_query_len`` > 1) in the prefill kernel, their single-row requests in the decode kernel where the
    step's plan says so (module docstring)."""
    t, h, d = q.shape
    rope = d - v_dim
    if latent_cache.shape[-1] != d or not supported(v_dim, rope):
        raise ValueError(f"mla_attention takes latents of v_dim + rope dims, both powers of two >= 16; got q "
                         f"{tuple(q.shape)}, cache {tuple(latent_cache.shape)}, v_dim {v_dim}")
    out = torch.empty((t, h, v_dim), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if kv_scale is None:
        kv_scale = torch.ones((), dtype=torch.float32, device=q.device)
    bs = latent_cache.shape[1]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * bs
    pairs = fp8_pairs and reads_pairs(q.dtype, latent_cache.dtype, v_dim, rope, h)
    if max_query_len is None or max_query_len <= 1:
        req, pos = rows if rows is not None else row_positions(seq_lens, query_start_loc, t)
        _decode(q, latent_cache, block_tables, req, pos, kv_scale, out, scale, v_dim, max_seq_len, splits,
                decode_tile, fp8_fp16_dots, pairs)
        return out
    if plan is None:
        plan = step_plan(seq_lens, query_start_loc, max_seq_len, bs, host_lens, pairs)
    if plan.decode_rows:  # the single-row requests' rows, gathered, attended, put back
        rows_d = plan.decode_row_ids
        out_d = torch.empty((plan.decode_rows, h, v_dim), dtype=q.dtype, device=q.device)
        _decode(q.index_select(0, rows_d), latent_cache, block_tables, plan.decode_req, plan.decode_pos, kv_scale,
                out_d, scale, v_dim, plan.decode_max_seq_len, splits, decode_tile, fp8_fp16_dots, pairs)
        out.index_copy_(0, rows_d, out_d)
    cache, tables, dots = latent_cache, block_tables, _dots(q.dtype, latent_cache.dtype, h, fp8_fp16_dots, False)
    if dequantize and dequantizes(q.dtype, latent_cache, plan.chunk_slots * plan.chunk_blocks):
        cache, tables = dequantize_blocks(latent_cache, block_tables, seq_lens, plan, q.dtype)
        dots = dot_dtype(q.dtype)
    rows_per, block_n = prefill_tile or prefill_tile_for(h, q.dtype)
    num_seqs, block_h = seq_lens.shape[0], _block_h(h)
    _mla_prefill_kernel[(ragged_grid(t, num_seqs, rows_per), triton.cdiv(h, block_h))](
        q, cache, tables, seq_lens, query_start_loc, kv_scale, out, h, num_seqs, scale,
        q.stride(0), q.stride(1), cache.stride(0), tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=bs, BLOCK_H=block_h, ROWS=rows_per, BLOCK_N=block_n, DV=v_dim, DR=rope,
        DOT_DTYPE=dots, IEEE=q.dtype == torch.float32, SKIP_SINGLE=plan.decode_rows > 0,
        num_warps=4 if v_dim <= 128 else 8, num_stages=2,
    )
    return out


@dataclass(frozen=True)
class StepPlan:
    """How a step with prompt chunks runs (once per step, every layer's): ``decode_rows`` single-row requests
    (the longest ``decode_max_seq_len`` tokens) in the decode kernel, gathered from rows ``decode_row_ids``
    (int64) with their requests ``decode_req`` and positions ``decode_pos`` (int32), the rest in the prefill
    kernel (``decode_rows`` 0: every request). A converted copy of the prefill kernel's blocks holds
    ``chunk_slots`` requests of ``chunk_blocks`` blocks, request r's from block ``chunk_base[r]`` (int32 on the
    device; -1: not in the copy)."""

    decode_rows: int
    decode_max_seq_len: int
    chunk_slots: int
    chunk_blocks: int
    chunk_base: torch.Tensor
    decode_req: torch.Tensor | None = None
    decode_pos: torch.Tensor | None = None
    decode_row_ids: torch.Tensor | None = None


def step_plan(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_seq_len: int, block_size: int,
              host_lens: tuple[list[int], list[int]] | None, pairs: bool) -> StepPlan:
    """Single-row requests move to the decode kernel where it reads e4m3 word pairs (the prefill kernel would
    spend a 64-row tile on each, over e4m3 bytes) and the host has (query lens, seq lens); else none move.
    Device work only (no host sync)."""
    num_seqs, dev = seq_lens.shape[0], seq_lens.device
    blocks = _copy_width(max_seq_len, block_size)
    if host_lens is None or not pairs or 1 not in host_lens[0] or max(host_lens[0]) <= 1:
        base = torch.arange(num_seqs, dtype=torch.int32, device=dev) * blocks
        return StepPlan(0, 0, num_seqs, blocks, base)
    qlens, lens = host_lens
    chunk_lens = [n for n, q in zip(lens, qlens, strict=True) if q > 1]
    chunk_blocks = _copy_width(max(chunk_lens), block_size)
    qlens_d = query_start_loc[1:] - query_start_loc[:-1]
    is_chunk = qlens_d > 1
    base = torch.where(is_chunk, (torch.cumsum(is_chunk, 0) - 1) * chunk_blocks, -1).to(torch.int32)
    singles = qlens.count(1)  # their requests, in order: the first ``singles`` of a stable sort on qlen != 1
    req = torch.argsort((qlens_d != 1).to(torch.int8), stable=True)[:singles]
    row_ids = query_start_loc[req].long()
    pos = (seq_lens[req] - 1).to(torch.int32)
    decode_len = max(n for n, q in zip(lens, qlens, strict=True) if q == 1)
    return StepPlan(singles, decode_len, len(chunk_lens), chunk_blocks, base, req.to(torch.int32), pos, row_ids)


COPY_TABLE_ALIGN = 16  # the converted copy's block-table rows are a multiple of this many blocks wide


def _copy_width(max_seq_len: int, block_size: int) -> int:
    """Blocks a request takes in a converted copy: its longest request's, rounded up to ``COPY_TABLE_ALIGN``
    (Triton specializes the prefill kernel on its table stride's divisibility by 16: so every step, and the
    warm-up's, launches one compiled variant)."""
    blocks = -(-max_seq_len // block_size)
    return -(-blocks // COPY_TABLE_ALIGN) * COPY_TABLE_ALIGN


def _dots(q_dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int, fp16_dots: bool, pairs: bool):
    """The MMA operand type of a launch (``mla_dot_dtype``; fp16 over word pairs: what their conversion gives)."""
    if pairs:
        return dot_dtype(torch.float16)
    return mla_dot_dtype(q_dtype, cache_dtype, _block_h(num_heads)) if fp16_dots else dot_dtype(q_dtype)


def _decode(q, latent_cache, block_tables, req, pos, kv_scale, out, scale, v_dim, max_seq_len, splits,
            decode_tile, fp16_dots, pairs) -> None:
    """The decode kernel over q's rows (request ``req``, position ``pos`` each; the longest ``max_seq_len``
    tokens: it picks the context split), then the split merge."""
    t, h, d = q.shape
    bs = latent_cache.shape[1]
    block_h = _block_h(h)
    dots = _dots(q.dtype, latent_cache.dtype, h, fp16_dots, pairs)
    cache = latent_cache.view(torch.int16) if pairs else latent_cache  # two e4m3 values a word; strides in words
    max_blocks = -(-max_seq_len // bs)
    head_blocks = triton.cdiv(h, block_h)
    if splits is None:
        splits = pick_splits(t * head_blocks, max_blocks, _sm_count(q.device))
    splits = max(1, min(next_pow2(splits), next_pow2(max_blocks)))
    block_n, warps, stages = decode_tile or decode_tile_for(block_h, q.dtype, v_dim, pairs)
    per_split = triton.cdiv(triton.cdiv(max_blocks * bs, splits), block_n) * block_n  # keys
    part, ml = out, out
    if splits > 1:
        part = torch.empty((splits, t, h, v_dim), dtype=torch.float32, device=q.device)
        ml = torch.empty((splits, t, h, 2), dtype=torch.float32, device=q.device)
    _mla_attention_kernel[(t, head_blocks, splits)](
        q, cache, block_tables, req, pos, kv_scale, part, ml, h, t, scale, per_split,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=bs, BLOCK_H=block_h, DV=v_dim, DR=d - v_dim,
        DOT_DTYPE=dots, IEEE=q.dtype == torch.float32, SPLITS=splits, BLOCK_N=block_n, PAIRS=pairs,
        ASM=pairs and not interpreting(),
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        _mla_merge_kernel[(t, h)](part, ml, kv_scale, out, h, t, out.stride(0), out.stride(1), SPLITS=splits,
                                  DV=v_dim)


DEQUANTIZE_MAX_BYTES = 64 << 20  # the most a prefill step's converted copy of its blocks may take
DEQUANTIZE_CHUNK = 4096  # values a conversion program takes (a 16 x 576 block: three programs)


def dequantizes(q_dtype: torch.dtype, latent_cache: torch.Tensor, blocks: int) -> bool:
    """Whether a prefill step over an e4m3 cache first converts its requests' blocks to q's dtype: 16-bit q, and
    ``blocks`` (the copy's requests x its table width, ``StepPlan``) within ``DEQUANTIZE_MAX_BYTES``. The
    prefill kernel reads each key once per tile of rows that sees it; converting each block once and running
    the 16-bit kernel beats converting every read (at DeepSeek-V2-Lite's shapes the kernel over e4m3 ran 1.45x
    the bf16 kernel's time)."""
    per_block = latent_cache.shape[1] * latent_cache.shape[2] * 2
    return (latent_cache.dtype == FP8_DTYPE and q_dtype in (torch.bfloat16, torch.float16)
            and blocks * per_block <= DEQUANTIZE_MAX_BYTES)


def dequantize_blocks(latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      plan: StepPlan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(a ``dtype`` copy of the blocks holding the tokens of each request in ``plan``'s copy, request r's block j
    at ``chunk_base[r]`` + j; the block tables of that copy), values as stored (the scale stays kv_scale's)."""
    num_seqs = seq_lens.shape[0]
    _, bs, d = latent_cache.shape
    out = torch.empty((plan.chunk_slots * plan.chunk_blocks, bs, d), dtype=dtype, device=latent_cache.device)
    steps = torch.arange(plan.chunk_blocks, dtype=torch.int32, device=latent_cache.device)
    chunk = min(DEQUANTIZE_CHUNK, next_pow2(bs * d))
    _dequantize_blocks_kernel[(num_seqs, plan.chunk_blocks, triton.cdiv(bs * d, chunk))](
        latent_cache, block_tables, seq_lens, plan.chunk_base, out, latent_cache.stride(0), block_tables.stride(0),
        BLOCK_ELEMS=bs * d, BLOCK_SIZE=bs, CHUNK=chunk)
    return out, plan.chunk_base[:, None] + steps[None, :]


def warm_up(latent_cache: torch.Tensor, query_dtype: torch.dtype, num_heads: int, v_dim: int, max_model_len: int,
            kv_scale: torch.Tensor | None = None) -> int:
    """Compile every kernel variant a step can launch on this cache (one per context split count, up to the
    most ``pick_splits`` gives a single row of ``max_model_len`` tokens), by launching each once on one row
    that reads only block 0 and writes nothing to the cache. Returns the ``mla_attention`` calls made (0 on the
    CPU)."""
    if latent_cache.device.type != "cuda":
        return 0
    dev, d, bs = latent_cache.device, latent_cache.shape[-1], latent_cache.shape[1]
    max_blocks = -(-max_model_len // bs)
    q = torch.zeros((1, num_heads, d), dtype=query_dtype, device=dev)
    tables = torch.zeros((1, max_blocks), dtype=torch.int32, device=dev)
    seq_lens = torch.full((1,), max_blocks * bs, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    most = pick_splits(triton.cdiv(num_heads, _block_h(num_heads)), max_blocks, _sm_count(dev))
    variants = [1 << i for i in range(most.bit_length())]
    for splits in variants:
        mla_attention(q, latent_cache, tables, seq_lens, qsl, d**-0.5, v_dim, kv_scale, max_seq_len=max_blocks * bs,
                      splits=splits)
    # the prefill kernel on a two-row chunk over one block (a short context: the converted copy fits); over e4m3
    # also reading e4m3 (a step too big to convert), and with 16-bit q the split step of a chunk beside a decode row
    q2 = torch.zeros((2, num_heads, d), dtype=query_dtype, device=dev)
    one_block = torch.full((1,), bs, dtype=torch.int32, device=dev)
    qsl2 = torch.tensor([0, 2], dtype=torch.int32, device=dev)
    q3 = torch.zeros((3, num_heads, d), dtype=query_dtype, device=dev)
    qsl3 = torch.tensor([0, 2, 3], dtype=torch.int32, device=dev)
    split = reads_pairs(query_dtype, latent_cache.dtype, v_dim, d - v_dim, num_heads)
    launched = len(variants)
    for dequantize in (True, False) if latent_cache.dtype == FP8_DTYPE else (True,):
        mla_attention(q2, latent_cache, tables, one_block, qsl2, d**-0.5, v_dim, kv_scale, max_query_len=2,
                      max_seq_len=bs, dequantize=dequantize)
        launched += 1
        if split:
            mla_attention(q3, latent_cache, tables.repeat(2, 1), one_block.repeat(2), qsl3, d**-0.5, v_dim, kv_scale,
                          max_query_len=2, max_seq_len=bs, host_lens=([2, 1], [bs, bs]), dequantize=dequantize)
            launched += 1
    return launched


def _block_h(num_heads: int) -> int:
    return max(16, min(64, next_pow2(num_heads)))


DECODE_KEYS = 64  # keys a decode program takes a step (4 blocks of 16: 2.5x one block a step on the H200)
SMALL_HEAD_BLOCK_TILE = (32, 4, 2)  # (keys, warps, stages) for head blocks of 16: 1.15-1.25x (64, 8, 2) on an H100
PAIRS_TILE = (64, 4, 2)  # the same over e4m3 word pairs: 1.10-1.14x (32, 4, 2) on an H100


def decode_tile_for(block_h: int, dtype: torch.dtype, v_dim: int, pairs: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel: 32 keys a step on 4 warps for 16-head blocks
    (DeepSeek-V2-Lite: the fp32 accumulator is 16 x DV, and a smaller tile keeps more programs resident),
    64 over e4m3 word pairs (half the bytes a key: ``PAIRS_TILE``), ``DECODE_KEYS`` on 8 warps for wider
    blocks or values (128 heads: the 64-key tile was fastest); half the keys for fp32 (twice the bytes a key)."""
    if dtype == torch.float32:
        return DECODE_KEYS // 2, 4 if v_dim <= 128 else 8, 2
    if block_h <= 16:
        return PAIRS_TILE if pairs else SMALL_HEAD_BLOCK_TILE
    return DECODE_KEYS, 4 if v_dim <= 128 else 8, 2


PREFILL_ROWS_X_HEADS = 64  # MMA rows a prefill program fills (ROWS query rows x BLOCK_H heads)
PREFILL_KEYS = 64  # keys a prefill program takes a step


def prefill_tile_for(num_heads: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(ROWS, BLOCK_N) of the prefill kernel for this many heads: 64 x 64 tiles (the best of 1-4 rows x 16-64
    keys on the H200, 3-4x the per-row kernel at 16 heads); half of each for fp32 (twice the bytes a tile)."""
    rows_x_heads, keys = (PREFILL_ROWS_X_HEADS, PREFILL_KEYS) if dtype != torch.float32 else (32, 32)
    return max(1, rows_x_heads // _block_h(num_heads)), keys


def reads_pairs(q_dtype: torch.dtype, cache_dtype: torch.dtype, v_dim: int, rope_dim: int, num_heads: int) -> bool:
    """Whether the decode kernel reads an e4m3 cache as int16 words of two values (``e4m3_pairs``: 16-bit MMA
    operands staged as bf16 ones, the value operand without byte-wise shared-memory reads): 16-bit queries,
    halves of both latent parts at least an MMA's 16, head blocks of at most 32 (on an H100 1.2-1.6x the
    byte reads at DeepSeek-V2-Lite's 16 heads, 0.6x at 128: the two fp32 accumulators of a 64-head block)."""
    return (cache_dtype == FP8_DTYPE and q_dtype in (torch.bfloat16, torch.float16)
            and min(v_dim, rope_dim) >= 32 and _block_h(num_heads) <= 32)


def mla_dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype, block_h: int):  # -> triton.language.dtype
    """MMA operand type over a cache read as bytes: q's, except fp16 over an e4m3 cache for 16-bit queries in
    head blocks of at most 32 (on the H200 ~1.4x faster than bf16 operands at 16 heads, slower at 64-head blocks,
    2026-12-02). The absorbed queries stay far inside fp16's range (|q| < 65504), the probabilities in [0, 1]."""
    if (cache_dtype == FP8_DTYPE and q_dtype in (torch.bfloat16, torch.float16) and block_h <= 32
            and not interpreting()):
        return tl.float16
    return dot_dtype(q_dtype)


SPLIT_MIN_BLOCKS = 8  # cache blocks a split walks at the least
MAX_SPLITS = 64  # at most (a CUDA graph sized for max_model_len splits a short row this many ways)


def pick_splits(programs: int, max_blocks: int, sms: int) -> int:
    """Context splits per row: enough programs for two per SM, each split at least ``SPLIT_MIN_BLOCKS``
    blocks of the longest request, at most ``MAX_SPLITS`` (a power of two, 1 when the rows already fill the
    GPU)."""
    if programs >= 2 * sms:
        return 1
    want = -(-2 * sms // max(programs, 1))
    return max(1, min(next_pow2(want), next_pow2(max(1, max_blocks // SPLIT_MIN_BLOCKS)), MAX_SPLITS))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one split unless asked
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def host_lens_of(meta, num_rows: int) -> tuple[list[int], list[int]] | None:
    """The metadata's host (query lens, seq lens) where they describe the device's rows exactly: not in a step
    padded for a CUDA graph (more requests than lengths, or requests spread over padded rows) and not while a
    graph is captured (a plan sized from this step's lengths would be replayed for other lengths)."""
    qlens, lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if qlens is None or lens is None or len(qlens) != meta.num_seqs or len(lens) != len(qlens):
        return None
    if sum(qlens) != num_rows or (meta.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return qlens, lens


def mla_forward(query: torch.Tensor, latent: torch.Tensor, latent_cache: torch.Tensor, meta, scale: float,
                v_dim: int, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``mla_forward_ref`` with the kernels: the write, then the attention (``meta``: ``AttentionMetadata``)."""
    if latent_cache.shape[1] != meta.block_size:
        raise ValueError(f"latent cache block size {latent_cache.shape[1]} != metadata block_size {meta.block_size}")
    write_latent_cache(latent, latent_cache, meta.slot_mapping, kv_scale)
    t, h, d = query.shape
    rows, plan = None, None
    if meta.max_query_len <= 1:  # once per step, not per layer
        key = ("mla_rows", t)
        if key not in meta.step_cache:
            meta.step_cache[key] = row_positions(meta.seq_lens, meta.query_start_loc, t)
        rows = meta.step_cache[key]
    else:
        pairs = reads_pairs(query.dtype, latent_cache.dtype, v_dim, d - v_dim, h)
        key = ("mla_plan", t, pairs, latent_cache.shape[1])
        if key not in meta.step_cache:
            meta.step_cache[key] = step_plan(meta.seq_lens, meta.query_start_loc, meta.max_seq_len,
                                             latent_cache.shape[1], host_lens_of(meta, t), pairs)
        plan = meta.step_cache[key]
    return mla_attention(query, latent_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, v_dim,
                         kv_scale, max_seq_len=meta.max_seq_len, rows=rows, max_query_len=meta.max_query_len,
                         plan=plan)
