"""W4A16 GEMM in Triton: int4 weights dequantized in registers, fp32 accumulation.

Weights in the kernel layout of ``int4_gemm_ref``: int32 [N, K/8] (each output column's nibbles
contiguous along K), per-group scales [G, N] and uint8 zeros [G, N], optional act-order
permutation ``perm`` of the activation columns (sorted at load, so groups are contiguous). Three
kernels, chosen by ``Int4Config.path`` (``default_config`` picks it from M and the activations):

``gemv`` (decode, one to four rows): no tensor cores. A program owns BLOCK_N output columns and
one of ``split_k`` slices of K; per k-block (inside one group) it loads the [BLOCK_N, BLOCK_K/8]
words (every row a contiguous run: 16-byte loads), the group's scale and zero rows once, and for
each of the BLOCK_M activation rows::

    v_j = float(word & (0xF << 4j) | exponent bits of 2^(23 - 4j))   = 2^(23-4j) + q, one LOP3
    t[n, w] = sum_j x[m, 8w + c_j] * (v_j - 2^(23-4j))               exact q: FADD (immediate), FFMA
    acc[m][n, w] += s[n] * (t[n, w] - z[n] * sum_j x[m, 8w + j])      reduced over w once, at the end

(nibbles 4..7 the same way from word >> 12; c_j: the column of nibble j). Everything stays in
the layout of the loaded words, about 4.4 instructions per weight nibble for one row in the sm_90
SASS; no offsets held per column, so 168 registers (250 with the next k-block's words in flight,
``num_stages`` 2). The group's scale and zero rows and (one row) the activations are loaded one
k-block ahead. Act-order: the activations are gathered through ``perm`` in the kernel
(``gather_x``; they are a few KB and cached), else one ``index_select`` first.

``dot`` (prefill, and decode batches from two rows): on the GPU with bf16/fp16 activations the
kernel layout's nibble order pays off: columns 2i and 2i + 1 of a word sit at bits 4i and 16 + 4i,
so a shift, one LOP3 (mask 0x000F000F, OR the bits of 128.0 / 1024.0 in both halves: each nibble
becomes the units place of a 16-bit mantissa) and one paired subtract of 128 + z give the exact
q - z of two columns, already packed as the tensor cores take them (``dequant_tile_pairs``, 1.4
instructions per weight instead of ~2.7). Elsewhere the exact fp32 route of the GEMV, rounded to
bf16/fp16. The planes are joined into the [BLOCK_N, BLOCK_K] tile, one ``tl.dot`` per
k-block with the group scale applied to the fp32 block product (``scale_after``: cheaper than
scaling every weight when BLOCK_M < BLOCK_K, and W is never rounded) or folded into the weights
before the dot (the reference's rounding). ``swap_ab`` computes y^T = W^T x^T, so the weight tile
is the MMA's M side and a few tokens fill its N side. The group's scale and zero rows (too
narrow for the pipeliner's async copies) are loaded one k-block ahead by hand. Act-order: one
``x.index_select(1, perm)`` before the launch.

``mma`` (decode, up to 16 rows; GPU, bf16/fp16 activations, groups of whole 128-k blocks): tensor
cores through inline PTX, with every lane's data placed by hand. Each tensor is one element per
thread (element r = lane r % 32 of warp r // 32), so the lane (g, c) of an m16n8k16 MMA loads
(``ld.global.nc.v4``) words 4c .. 4c + 3 of the k-block for output columns g and g + 8 of its
warp's 16, and the same four words' x pairs of activation row g. Word pairs i (bits 4i and
16 + 4i) become A fragments with a shift, a LOP3 and a paired subtract (exact q - z, as in the dot
path), two MMAs per word (A's k order is the lanes' word order; B, x, follows it); C (16 columns
x 8 rows, fp32) takes the group scale after each k-block. ~1.4 dequantization instructions per
weight nibble, no shared memory, no layout conversion; 48-56 registers (90 at 16 rows, 128 with
two tiles). Rows 9-16 are a second 8-row group of B and C. With ``mma_cols`` 32 a warp owns two
16-column tiles whose MMAs take the same x fragments (each lane's x loads, 4x its weight loads at
16 rows, then serve twice the columns). A program's warps either own ``mma_cols`` columns each or
split its K slice between them (``block_n`` < ``mma_cols`` x ``num_warps``; summed through shared
memory at the end, which spares the split-K partials). The CPU interpreter cannot run it (tests on
CUDA only); the GEMV is its fallback.

Split-K (every path), ``Int4Config.reduce``:

- ``last``: programs write fp32 partials; the last program of a tile to finish (an atomic
  ticket per tile) sums them in a fixed order, adds the bias, writes y and resets the ticket:
  one launch, deterministic. Tickets live in a per-device int32 buffer made once (zeroed) and
  left at zero by every launch, so the kernel is CUDA-graph capturable; launches on one device
  must not run concurrently on different streams (they share the tickets).
- ``kernel``: the partials are summed by a second small kernel (two launches).

No host synchronisation anywhere; per call the host allocates y (and the partials) and launches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from paged_backend.kernels._launch import FLOAT_DTYPES, check_device, check_tensor, dot_dtype, interpreting

PATHS = ("gemv", "dot", "mma")
REDUCES = ("last", "kernel")
TICKETS = 1 << 16  # split-K tickets per device (tiles per launch); larger grids use reduce="kernel"
EXPONENT_BITS = tuple((127 + p) << 23 for p in (23, 19, 15, 11, 7))  # float bits of 2^p (see _nibble)


@dataclass(frozen=True)
class Int4Config:
    """One launch configuration (``split_k=None``: chosen from the grid by ``pick_split_k``)."""

    path: str = "gemv"  # "gemv" (FMA, 1/2/4 rows per program), "dot" (tl.dot) or "mma" (GPU, <= 16 rows)
    block_m: int = 1  # activation rows per program
    block_n: int = 128  # output columns per program
    block_k: int = 128  # k per step; capped at the group size's largest power-of-two factor
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 2  # dot: software pipeline depth; gemv: 2 / 3 load words 1 / 2 k-blocks ahead
    reduce: str = "last"  # split-K: "last" program sums the partials, or a "kernel" after
    swap_ab: bool = False  # dot path: y^T = W^T x^T
    gather_x: bool = True  # gemv path with act-order: gather x through perm in the kernel (else index_select)
    scale_after: bool | None = None  # dot path; None: block_m < block_k
    pairs: bool = True  # dot path, GPU, bf16/fp16: dequantize two values per instruction
    mma_cols: int = 16  # mma path: output columns per warp (16, or 32: two column tiles share the x loads)

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"Int4Config.path must be one of {PATHS}, got {self.path!r}")
        if self.reduce not in REDUCES:
            raise ValueError(f"Int4Config.reduce must be one of {REDUCES}, got {self.reduce!r}")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Int4Config.{name} must be a power of two, got {v}")
        if self.block_k < 8:
            raise ValueError(f"Int4Config.block_k must be >= 8, got {self.block_k}")
        if self.path == "dot" and min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError("Int4Config: the dot path needs block_m, block_n, block_k >= 16")
        if self.path == "mma" and (self.block_m not in (8, 16) or self.block_k != 128 or self.mma_cols not in (16, 32)
                                   or self.block_n < self.mma_cols or (self.num_warps * self.mma_cols) % self.block_n):
            raise ValueError("Int4Config: the mma path takes block_m 8 or 16, block_k 128, mma_cols 16 or 32 and "
                             "block_n = mma_cols x a divisor of num_warps (the other warps split K)")

    def label(self) -> str:
        sk = "auto" if self.split_k is None else str(self.split_k)
        extra = ""
        if self.path == "dot":
            extra = (" swap" if self.swap_ab else "") + {None: "", True: " post", False: " pre"}[self.scale_after]
            extra += "" if self.pairs else " fp32dq"
        if self.path == "mma" and self.mma_cols != 16:
            extra = f" c{self.mma_cols}"
        return (f"{self.path} bm{self.block_m} bn{self.block_n} bk{self.block_k} sk{sk} "
                f"w{self.num_warps} s{self.num_stages} {self.reduce}{extra}")


# -- kernels ------------------------------------------------------------------------------------


@triton.jit
def _nibble(words, w12, j: tl.constexpr, e):
    """Nibble j of int32 words as the fp32 2^p + q, exact, in one LOP3: the nibble stays where it
    is (bit 4j of the word, or bit 4(j - 3) of ``w12 = words >> 12`` for j >= 4) and ``e`` (the
    float bits of 2^p, p = 23 - that bit) makes its lowest bit the units place."""
    if j < 4:
        bits = (words & (0xF << (4 * j))) | e
    else:
        bits = (w12 & (0xF << (4 * (j - 3)))) | e
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_opt(ptr, mask, other):
    """tl.load with ``mask=None`` meaning no mask (the address is known to be valid)."""
    if mask is None:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=other)
    return v


@triton.jit
def _group_of(k, group_size, GROUP_LOG2: tl.constexpr):
    """The group of column k: a shift when the group size is a power of two (GROUP_LOG2 >= 0;
    31 when one group spans K), else a division."""
    if GROUP_LOG2 >= 0:
        g = k >> GROUP_LOG2
    else:
        g = k // group_size
    return g


@triton.jit
def _group_row(s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, mask_n):
    """Group g's scales (fp32) and zeros (int32) of the columns offs_n (0 where masked; mask_n
    None: all valid)."""
    s = _load_opt(s_ptr + g * stride_sg + offs_n, mask_n, 0.0).to(tl.float32)
    z = _load_opt(z_ptr + g * stride_zg + offs_n, mask_n, 0).to(tl.int32)
    return s, z


@triton.jit
def _load_words(rows, kw, mask_n, k_end, EVEN_K: tl.constexpr):
    """int32 [BN, W] words ``kw`` of the rows (0 outside N / past k_end; ``mask_n`` None: every
    row exists, e.g. clamped to N); EVEN_K: no K mask, so every row's W words are 16-byte loads."""
    if EVEN_K:
        if mask_n is None:
            mask = None
        else:
            mask = mask_n[:, None]
    else:
        if mask_n is None:
            mask = (kw * 8 < k_end)[None, :]
        else:
            mask = mask_n[:, None] & (kw * 8 < k_end)[None, :]
    return _load_opt(rows + kw[None, :], mask, 0)


@triton.jit
def _x_load(x_ptr, perm_ptr, row, M, stride_xm, kw, mask_k, X_MODE: tl.constexpr):
    """The raw loads of x[row, 8 kw + c] for c = 0..7 (0 past K or for rows >= M), converted by
    ``_x_vals`` where they are used (so a k-block's loads can be issued one block ahead).
    X_MODE 0/1: bf16/fp16 pairs (four 32-bit loads per word column; the last four entries repeat
    them), 2: one load per value (fp32 activations), 3: gathered through ``perm`` (act-order)."""
    if mask_k is None:  # the caller knows every column and the row are valid
        mask = None
    else:
        mask = mask_k & (tl.zeros_like(kw) + row < M)  # (a tensor: the interpreter rejects scalar masks)
    if X_MODE < 2:
        x32 = (x_ptr + row * stride_xm).to(tl.pointer_type(tl.int32)) + kw * 4
        p0 = _load_opt(x32, mask, 0)
        p1 = _load_opt(x32 + 1, mask, 0)
        p2 = _load_opt(x32 + 2, mask, 0)
        p3 = _load_opt(x32 + 3, mask, 0)
        raw = (p0, p1, p2, p3, p0, p1, p2, p3)
    elif X_MODE == 3:
        base = x_ptr + row * stride_xm
        k = kw * 8
        raw = (_load_opt(base + _load_opt(perm_ptr + k, mask_k, 0), mask, 0.0),
                _load_opt(base + _load_opt(perm_ptr + k + 1, mask_k, 0), mask, 0.0),
                _load_opt(base + _load_opt(perm_ptr + k + 2, mask_k, 0), mask, 0.0),
                _load_opt(base + _load_opt(perm_ptr + k + 3, mask_k, 0), mask, 0.0),
                _load_opt(base + _load_opt(perm_ptr + k + 4, mask_k, 0), mask, 0.0),
                _load_opt(base + _load_opt(perm_ptr + k + 5, mask_k, 0), mask, 0.0),
                _load_opt(base + _load_opt(perm_ptr + k + 6, mask_k, 0), mask, 0.0),
                _load_opt(base + _load_opt(perm_ptr + k + 7, mask_k, 0), mask, 0.0))
    else:
        base = x_ptr + row * stride_xm
        k = kw * 8
        raw = (_load_opt(base + k, mask, 0.0), _load_opt(base + k + 1, mask, 0.0),
               _load_opt(base + k + 2, mask, 0.0), _load_opt(base + k + 3, mask, 0.0),
               _load_opt(base + k + 4, mask, 0.0), _load_opt(base + k + 5, mask, 0.0),
               _load_opt(base + k + 6, mask, 0.0), _load_opt(base + k + 7, mask, 0.0))
    return raw


@triton.jit
def _x_vals(raw, X_MODE: tl.constexpr):
    """``_x_load``'s values as eight fp32 [W] vectors, by column."""
    r0, r1, r2, r3, r4, r5, r6, r7 = raw
    if X_MODE == 0:  # bf16 -> fp32 is the 16 bits moved up
        xs = ((r0 << 16).to(tl.float32, bitcast=True), (r0 & -65536).to(tl.float32, bitcast=True),
                (r1 << 16).to(tl.float32, bitcast=True), (r1 & -65536).to(tl.float32, bitcast=True),
                (r2 << 16).to(tl.float32, bitcast=True), (r2 & -65536).to(tl.float32, bitcast=True),
                (r3 << 16).to(tl.float32, bitcast=True), (r3 & -65536).to(tl.float32, bitcast=True))
    elif X_MODE == 1:
        xs = (r0.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (r0 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                r1.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (r1 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                r2.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (r2 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                r3.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (r3 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))
    else:
        xs = (r0.to(tl.float32), r1.to(tl.float32), r2.to(tl.float32), r3.to(tl.float32),
              r4.to(tl.float32), r5.to(tl.float32), r6.to(tl.float32), r7.to(tl.float32))
    return xs


@triton.jit
def _row_block(words, w12, z, s, e23, e19, e15, e11, e7, xs):
    """s * sum_j x_j[w] * (q_j - z) for one activation row: [BN, W] fp32, as
    s * (sum_j x_j q_j - z sum_j x_j): the nibble's offset 2^p is an immediate operand, so no
    per-column offsets occupy registers (the nibbles are re-derived per row; ptxas keeps them
    when registers allow)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs  # by column; nibble j holds column 2j (j < 4), 2(j - 4) + 1
    t = (_nibble(words, w12, 0, e23) - 8388608.0) * x0[None, :]
    t += (_nibble(words, w12, 1, e19) - 524288.0) * x2[None, :]
    t += (_nibble(words, w12, 2, e15) - 32768.0) * x4[None, :]
    t += (_nibble(words, w12, 3, e11) - 2048.0) * x6[None, :]
    t += (_nibble(words, w12, 4, e19) - 524288.0) * x1[None, :]
    t += (_nibble(words, w12, 5, e15) - 32768.0) * x3[None, :]
    t += (_nibble(words, w12, 6, e11) - 2048.0) * x5[None, :]
    t += (_nibble(words, w12, 7, e7) - 128.0) * x7[None, :]
    xsum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    return (t - z * xsum[None, :]) * s


@triton.jit
def dequant_tile(words, z, s, e23, e19, e15, e11, e7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCALE: tl.constexpr, DTYPE: tl.constexpr):
    """int32 words [BN, BK/8] -> [BN, BK] in DTYPE: q - z (exact in bf16/fp16), times ``s`` when
    SCALE (then rounded once, as the reference). The eight nibble planes are joined in column
    order, every join adding an in-thread dimension (no data movement). The interpreter's and
    fp32's path; ``dequant_tile_pairs`` is the GPU's for 16-bit dtypes."""
    w12 = words >> 12
    q0 = _nibble(words, w12, 0, e23) - (z + 8388608.0)
    q1 = _nibble(words, w12, 1, e19) - (z + 524288.0)
    q2 = _nibble(words, w12, 2, e15) - (z + 32768.0)
    q3 = _nibble(words, w12, 3, e11) - (z + 2048.0)
    q4 = _nibble(words, w12, 4, e19) - (z + 524288.0)
    q5 = _nibble(words, w12, 5, e15) - (z + 32768.0)
    q6 = _nibble(words, w12, 6, e11) - (z + 2048.0)
    q7 = _nibble(words, w12, 7, e7) - (z + 128.0)
    if SCALE:
        q0 *= s
        q1 *= s
        q2 *= s
        q3 *= s
        q4 *= s
        q5 *= s
        q6 *= s
        q7 *= s
    q0 = q0.to(DTYPE)
    q1 = q1.to(DTYPE)
    q2 = q2.to(DTYPE)
    q3 = q3.to(DTYPE)
    q4 = q4.to(DTYPE)
    q5 = q5.to(DTYPE)
    q6 = q6.to(DTYPE)
    q7 = q7.to(DTYPE)
    # q_j is nibble j = column c with KERNEL_NIBBLE[c] = j; column 8w + c of the tile:
    # c = 4 * (innermost join) + 2 * (middle) + (outermost)
    planes = tl.join(tl.join(tl.join(q0, q2), tl.join(q1, q3)), tl.join(tl.join(q4, q6), tl.join(q5, q7)))
    return tl.reshape(planes, (BLOCK_N, BLOCK_K))


def _pairs_asm(bf16: bool, scale: bool) -> str:
    """PTX of ``dequant_tile_pairs`` for one word ($8): nibble pair i is bits 4i and 16 + 4i,
    ORed into the mantissas of a 16-bit pair of 2^e (bf16 128, fp16 1024: the units place is
    the mantissa's lowest bit), then ``fma(t, 1, -(2^e + z))`` ($9 holds that pair) leaves q - z
    exactly; with ``scale`` one more paired multiply by s ($10), rounded once."""
    magic, one, fma = (0x43004300, 0x3F803F80, "fma.rn.bf16x2") if bf16 else (0x64006400, 0x3C003C00, "fma.rn.f16x2")
    body = [f"mov.b32 one, {one:#x};", "mov.b32 neg0, 0x80008000;"]
    for i in range(4):
        src = "$8"
        if i:
            body.append(f"shr.u32 t, $8, {4 * i};")
            src = "t"
        body.append(f"lop3.b32 t, {src}, 0x000F000F, {magic:#x}, 0xEA;")  # (a & b) | c
        body.append(f"{fma} d, t, one, $9;")
        if scale:
            body.append(f"{fma} d, d, $10, neg0;")
        body.append(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, d;")
    return "{ .reg .b32 t, d, one, neg0; " + " ".join(body) + " }"


_PAIRS_BF16 = tl.constexpr(_pairs_asm(True, False))
_PAIRS_BF16_SCALE = tl.constexpr(_pairs_asm(True, True))
_PAIRS_FP16 = tl.constexpr(_pairs_asm(False, False))
_PAIRS_FP16_SCALE = tl.constexpr(_pairs_asm(False, True))


@triton.jit
def dequant_tile_pairs(words, z, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr,
                        DTYPE: tl.constexpr):
    """``dequant_tile`` on the GPU for a 16-bit DTYPE, two values per instruction (``_pairs_asm``),
    for the kernel layout's word order (nibble pair i = columns 8w + 2i, 8w + 2i + 1). ``z``
    int32, ``s`` fp32."""
    if DTYPE == tl.bfloat16:
        zz = (z | 0xC300) * 0x10001  # -(128 + z) in both halves
        if SCALE:
            asm: tl.constexpr = _PAIRS_BF16_SCALE
        else:
            asm: tl.constexpr = _PAIRS_BF16
    else:
        zz = (z | 0xE400) * 0x10001  # -(1024 + z)
        if SCALE:
            asm: tl.constexpr = _PAIRS_FP16_SCALE
        else:
            asm: tl.constexpr = _PAIRS_FP16
    if SCALE:  # s rounded to DTYPE, in both halves
        ss = (tl.cast(s.to(DTYPE), tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) * 0x10001
    else:
        ss = zz  # (unused)
    if DTYPE == tl.bfloat16:  # (the builtin takes dtypes, not constexprs)
        out: tl.constexpr = (tl.bfloat16,) * 8
    else:
        out: tl.constexpr = (tl.float16,) * 8
    q0, q1, q2, q3, q4, q5, q6, q7 = tl.inline_asm_elementwise(
        asm=asm,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
        args=[words, tl.broadcast_to(zz, words.shape), tl.broadcast_to(ss, words.shape)],
        dtype=out,
        is_pure=True,
        pack=1,
    )
    # q_c is column c (8w + c): c = 4 * (innermost join) + 2 * (middle) + (outermost)
    planes = tl.join(tl.join(tl.join(q0, q4), tl.join(q2, q6)), tl.join(tl.join(q1, q5), tl.join(q3, q7)))
    return tl.reshape(planes, (BLOCK_N, BLOCK_K))


def _mma_asm(bf16: bool, groups: int) -> str:
    """PTX of one ``_int4_mma_kernel`` word step for one lane: lane (g, c) of a warp holds word w_A
    of output column g and w_B of column g + 8 (the same 8 k), pairs i = bits 4i / 16 + 4i as in
    ``_pairs_asm``: shift, LOP3 into the mantissas of 2^e, one paired subtract of 2^e + z (exact
    q - z). Pairs 0, 1 then 2, 3 are one m16n8k16 MMA each (A = 16 columns x 16 k, its k order
    being the lanes' words: any order works when B uses the same), B = the lane's x pairs of those
    k for activation row g (+ 8q for group q), accumulating into C = 16 columns x 8 rows."""
    magic, one, fma, ty = ((0x43004300, 0x3F803F80, "fma.rn.bf16x2", "bf16") if bf16
                           else (0x64006400, 0x3C003C00, "fma.rn.f16x2", "f16"))
    n_out = 4 * groups
    w_a, w_b, nz_a, nz_b = (f"${2 * n_out + i}" for i in range(4))
    x0 = 2 * n_out + 4
    body = [f"mov.b32 one, {one:#x};"]
    for i in range(4):
        for src, nz, dst in ((w_a, nz_a, f"a{i}"), (w_b, nz_b, f"b{i}")):
            if i:
                body.append(f"shr.u32 t, {src}, {4 * i};")
                src = "t"
            body.append(f"lop3.b32 t, {src}, 0x000F000F, {magic:#x}, 0xEA;")
            body.append(f"{fma} {dst}, t, one, {nz};")
    for q in range(groups):
        d = ", ".join(f"${4 * q + i}" for i in range(4))
        body += [f"mov.b32 ${4 * q + i}, ${n_out + 4 * q + i};" for i in range(4)]
        for p in (0, 2):
            body.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{d}}}, "
                        f"{{a{p}, b{p}, a{p + 1}, b{p + 1}}}, {{${x0 + 4 * q + p}, ${x0 + 4 * q + p + 1}}}, {{{d}}};")
    return "{ .reg .b32 t, one, a0, a1, a2, a3, b0, b1, b2, b3; " + " ".join(body) + " }"


def _mma_constraints(groups: int) -> str:
    return ",".join(["=f"] * (4 * groups) + ["f"] * (4 * groups) + ["r"] * (4 + 4 * groups))


@triton.jit
def _sum_partials(part_ptr, offs, mask, splits, stride_ps, total, CG: tl.constexpr):
    """total + sum over s of partial[s] in the order s = 0, 1, ..: CHUNK independent loads are
    in flight at a time (a plain loop would wait out one memory round trip per split)."""
    CHUNK: tl.constexpr = 8
    for s0 in range(0, splits, CHUNK):
        for t in tl.static_range(CHUNK):
            split = tl.zeros_like(offs) + s0 + t  # int64, like offs
            ok = mask & (split < splits)  # past the last split: + 0.0, exact
            if CG:  # written by other SMs during this launch: read through L2, never a stale L1 line
                total += tl.load(part_ptr + split * stride_ps + offs, mask=ok, other=0.0, cache_modifier=".cg")
            else:
                total += tl.load(part_ptr + split * stride_ps + offs, mask=ok, other=0.0)
    return total


@triton.jit
def _epilogue(acc, offs, mask, bias_offs, out_ptr, part_ptr, ticket_ptr, bias_ptr, tile, pid_k, splits,
              stride_ps, REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Stores a tile's fp32 ``acc`` (``offs`` = m * N + n): y directly (REDUCE 0), a split-K
    partial (1: summed by ``_split_k_reduce_kernel``), or a partial + the last program's sum in
    split order (2: the same bits as the reduce kernel)."""
    if REDUCE == 0:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + bias_offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k.to(tl.int64) * stride_ps + offs, acc, mask=mask)
        if REDUCE == 2:
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == splits - 1:  # the last program of this tile: all partials are visible
                total = _sum_partials(part_ptr, offs, mask, splits, stride_ps, tl.zeros_like(acc), True)
                if HAS_BIAS:
                    total += tl.load(bias_ptr + bias_offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _int4_gemv_kernel(
    x_ptr,  # [M, K]
    qw_ptr,  # int32 [N, K/8]
    s_ptr,  # [G, N]
    z_ptr,  # uint8 [G, N]
    perm_ptr,  # int32 [K] (X_MODE 3)
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N]
    part_ptr,  # fp32 [splits, M, N] (REDUCE > 0)
    ticket_ptr,  # int32 [m_tiles * n_tiles] (REDUCE 2)
    M,
    N,
    K,
    group_size,
    k_per_split,  # multiple of BLOCK_K
    splits,
    stride_xm,
    stride_qn,
    stride_sg,
    stride_zg,
    stride_ps,
    e23,  # float bits of 2^23, 2^19, .., 2^7 (arguments, not literals: ptxas then folds each
    e19,  # nibble's mask and exponent into one LOP3 instead of re-materialising constants)
    e15,
    e11,
    e7,
    BLOCK_M: tl.constexpr,  # 1, 2 or 4 activation rows per program
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides group_size (or G = 1): one scale row per k-block
    GROUP_LOG2: tl.constexpr,  # see _group_of
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K (16-byte weight loads)
    PREFETCH: tl.constexpr,  # k-blocks of weight words loaded ahead of their use: 0, 1 or 2
    X_MODE: tl.constexpr,  # see _x_load
    REDUCE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)  # one tile (BLOCK_M >= M) unless a weird group size sent many rows here
    W: tl.constexpr = BLOCK_K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, W)
    m0 = pid_m * BLOCK_M
    # rows past N read row N - 1 (their results are never stored): no load needs an N mask
    offs_nc = tl.minimum(offs_n, N - 1)
    rows = qw_ptr + offs_nc.to(tl.int64)[:, None] * stride_qn
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    k_last = k_start + (k_end - 1 - k_start) // BLOCK_K * BLOCK_K  # the slice's last k-block
    acc0 = tl.zeros((BLOCK_N, W), dtype=tl.float32)  # per output column and word column;
    acc1 = tl.zeros((BLOCK_N, W), dtype=tl.float32)  # the sum over W happens once, at the end
    acc2 = tl.zeros((BLOCK_N, W), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, W), dtype=tl.float32)
    # The next k-block's loads are issued before this one's arithmetic: the group's scale and
    # zero rows, the activations (one row; with more rows the registers are not there) and,
    # with PREFETCH, the weight words. Each k-block's arithmetic then waits on nothing loaded in
    # it (a round trip per k-block left every warp stalled, even on activations from L2). The
    # last k-block "prefetches" itself again (cached; no mask): no load in the loop is masked
    # unless K has a partial k-block.
    kw0 = tl.multiple_of(k_start // 8, W) + offs_w
    if PREFETCH > 0:
        words = _load_words(rows, kw0, None, k_end, EVEN_K)
    if PREFETCH > 1:
        words1 = _load_words(rows, tl.multiple_of(tl.minimum(k_start + BLOCK_K, k_last) // 8, W) + offs_w, None,
                             k_end, EVEN_K)
    s_next, z_next = _group_row(s_ptr, z_ptr, _group_of(k_start, group_size, GROUP_LOG2), stride_sg, stride_zg,
                                offs_nc, None)
    if EVEN_K:
        xr0 = _x_load(x_ptr, perm_ptr, m0, M, stride_xm, kw0, None, X_MODE)
    else:
        xr0 = _x_load(x_ptr, perm_ptr, m0, M, stride_xm, kw0, kw0 * 8 < k_end, X_MODE)
    for k0 in range(k_start, k_end, BLOCK_K):
        kw = tl.multiple_of(k0 // 8, W) + offs_w
        k_next = tl.minimum(k0 + BLOCK_K, k_last)
        kw_next = tl.multiple_of(k_next // 8, W) + offs_w
        if PREFETCH == 1:
            nxt = _load_words(rows, kw_next, None, k_end, EVEN_K)
        elif PREFETCH == 2:
            kw_after = tl.multiple_of(tl.minimum(k0 + 2 * BLOCK_K, k_last) // 8, W) + offs_w
            nxt = _load_words(rows, kw_after, None, k_end, EVEN_K)
        else:
            words = _load_words(rows, kw, None, k_end, EVEN_K)
        s = s_next[:, None]
        z = z_next.to(tl.float32)[:, None]
        s_next, z_next = _group_row(s_ptr, z_ptr, _group_of(k_next, group_size, GROUP_LOG2), stride_sg, stride_zg,
                                    offs_nc, None)
        w12 = words >> 12
        mask_k = kw * 8 < k_end
        if BLOCK_M == 1:
            xs = _x_vals(xr0, X_MODE)
            if EVEN_K:
                xr0 = _x_load(x_ptr, perm_ptr, m0, M, stride_xm, kw_next, None, X_MODE)
            else:
                xr0 = _x_load(x_ptr, perm_ptr, m0, M, stride_xm, kw_next, kw_next * 8 < k_end, X_MODE)
        else:
            xs = _x_vals(_x_load(x_ptr, perm_ptr, m0, M, stride_xm, kw, mask_k, X_MODE), X_MODE)
        acc0 += _row_block(words, w12, z, s, e23, e19, e15, e11, e7, xs)
        if BLOCK_M > 1:
            xs = _x_vals(_x_load(x_ptr, perm_ptr, m0 + 1, M, stride_xm, kw, mask_k, X_MODE), X_MODE)
            acc1 += _row_block(words, w12, z, s, e23, e19, e15, e11, e7, xs)
        if BLOCK_M > 2:
            xs = _x_vals(_x_load(x_ptr, perm_ptr, m0 + 2, M, stride_xm, kw, mask_k, X_MODE), X_MODE)
            acc2 += _row_block(words, w12, z, s, e23, e19, e15, e11, e7, xs)
            xs = _x_vals(_x_load(x_ptr, perm_ptr, m0 + 3, M, stride_xm, kw, mask_k, X_MODE), X_MODE)
            acc3 += _row_block(words, w12, z, s, e23, e19, e15, e11, e7, xs)
        if PREFETCH == 1:
            words = nxt
        elif PREFETCH == 2:
            words = words1
            words1 = nxt
    offs_m = m0 + tl.arange(0, BLOCK_M)
    sel = tl.arange(0, BLOCK_M)[:, None]
    y = tl.where(sel == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if BLOCK_M > 1:
        y = tl.where(sel == 1, tl.sum(acc1, axis=1)[None, :], y)
    if BLOCK_M > 2:
        y = tl.where(sel == 2, tl.sum(acc2, axis=1)[None, :], y)
        y = tl.where(sel == 3, tl.sum(acc3, axis=1)[None, :], y)
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]  # (M * N may pass 2^31 in a long prefill)
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    _epilogue(y, offs, mask, offs_n[None, :], out_ptr, part_ptr, ticket_ptr, bias_ptr, tile, pid_k, splits,
              stride_ps, REDUCE, HAS_BIAS)


@triton.jit
def _int4_dot_kernel(
    x_ptr,  # [M, K] (already permuted for act-order)
    qw_ptr,  # int32 [N, K/8]
    s_ptr,  # [G, N]
    z_ptr,  # uint8 [G, N]
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N]
    part_ptr,  # fp32 [splits, M, N] (REDUCE > 0)
    ticket_ptr,  # int32 [m_tiles * n_tiles] (REDUCE 2)
    M,
    N,
    K,
    group_size,
    k_per_split,
    splits,
    stride_xm,
    stride_qn,
    stride_sg,
    stride_zg,
    stride_ps,
    e23,  # see _int4_gemv_kernel
    e19,
    e15,
    e11,
    e7,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides group_size (or G = 1)
    GROUP_LOG2: tl.constexpr,  # see _group_of
    EVEN_K: tl.constexpr,
    REDUCE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 activations: full-precision tl.dot (not TF32)
    PAIRS: tl.constexpr = False,  # dequantize two values per instruction (GPU, 16-bit DOT_DTYPE)
):
    pid_m = tl.program_id(0)  # fastest: the m tiles of one weight tile run together (L2 reuse)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    W: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_w = tl.arange(0, W)
    rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # the group's scales and zeros are one value per thread (too narrow for the pipeliner's
    # async copies): loaded one k-block ahead by hand, or every k-block waits out a DRAM trip
    s_next, z_next = _group_row(s_ptr, z_ptr, _group_of(k_start, group_size, GROUP_LOG2), stride_sg, stride_zg, offs_n, mask_n)
    for k0 in range(k_start, k_end, BLOCK_K):
        s = s_next
        z_i = z_next
        z = z_i.to(tl.float32)
        more = tl.zeros_like(offs_n) + k0 + BLOCK_K < k_end
        s_next, z_next = _group_row(s_ptr, z_ptr, _group_of(k0 + BLOCK_K, group_size, GROUP_LOG2), stride_sg, stride_zg, offs_n,
                                    mask_n & more)
        kw = tl.multiple_of(k0 // 8, W) + offs_w
        words = _load_words(rows, kw, mask_n, k_end, EVEN_K)
        offs_k = tl.multiple_of(k0, BLOCK_K) + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < k_end)[None, :], other=0.0)
        if PAIRS:
            w = dequant_tile_pairs(words, z_i[:, None], s[:, None], BLOCK_N, BLOCK_K, not SCALE_AFTER, DOT_DTYPE)
        else:
            w = dequant_tile(words, z[:, None], s[:, None], e23, e19, e15, e11, e7, BLOCK_N, BLOCK_K,
                              not SCALE_AFTER, DOT_DTYPE)
        x = x.to(DOT_DTYPE)
        if SCALE_AFTER:  # the block's fp32 product times the group's scale: W is never rounded
            if SWAP_AB:
                if IEEE:
                    part = tl.dot(w, tl.trans(x), input_precision="ieee")
                else:
                    part = tl.dot(w, tl.trans(x))
                acc += part * s[:, None]
            else:
                if IEEE:
                    part = tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(w))
                acc += part * s[None, :]
        else:
            if SWAP_AB:
                if IEEE:
                    acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, tl.trans(x), acc)
            else:
                if IEEE:
                    acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
    tile = pid_m * tl.num_programs(1) + pid_n
    if SWAP_AB:
        offs = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        mask = mask_m[None, :] & mask_n[:, None]
        bias_offs = offs_n[:, None]
    else:
        offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        bias_offs = offs_n[None, :]
    _epilogue(acc, offs, mask, bias_offs, out_ptr, part_ptr, ticket_ptr, bias_ptr, tile, pid_k, splits,
              stride_ps, REDUCE, HAS_BIAS)


_MMA_BF16_1 = tl.constexpr(_mma_asm(True, 1))
_MMA_BF16_2 = tl.constexpr(_mma_asm(True, 2))
_MMA_FP16_1 = tl.constexpr(_mma_asm(False, 1))
_MMA_FP16_2 = tl.constexpr(_mma_asm(False, 2))
_MMA_CONSTRAINTS_1 = tl.constexpr(_mma_constraints(1))
_MMA_CONSTRAINTS_2 = tl.constexpr(_mma_constraints(2))


@triton.jit
def _ldg4(ptr):
    """Four int32 from a 16-byte aligned address of each lane (``ld.global.nc.v4``): the lane
    owns exactly these words, whatever layout Triton would give a [R, 4] load."""
    return tl.inline_asm_elementwise("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)


@triton.jit
def _mma_word(c, w_a, w_b, nz_a, nz_b, xq, j: tl.constexpr, GROUPS: tl.constexpr, BF16: tl.constexpr):
    """One word step (``_mma_asm``) of every lane: C (4 fp32 per activation-row group) += the
    lane's words ``j`` (of w_a / w_b) times its x pairs of those words."""
    if BF16:
        if GROUPS == 1:
            asm: tl.constexpr = _MMA_BF16_1
        else:
            asm: tl.constexpr = _MMA_BF16_2
    else:
        if GROUPS == 1:
            asm: tl.constexpr = _MMA_FP16_1
        else:
            asm: tl.constexpr = _MMA_FP16_2
    if GROUPS == 1:
        cons: tl.constexpr = _MMA_CONSTRAINTS_1
        c0, c1, c2, c3 = c
        x0 = xq[0]
        out = tl.inline_asm_elementwise(
            asm, cons, [c0, c1, c2, c3, w_a[j], w_b[j], nz_a, nz_b,
                        x0[4 * j], x0[4 * j + 1], x0[4 * j + 2], x0[4 * j + 3]],
            dtype=(tl.float32,) * 4, is_pure=False, pack=1)
    else:
        cons: tl.constexpr = _MMA_CONSTRAINTS_2
        c0, c1, c2, c3, c4, c5, c6, c7 = c
        x0 = xq[0]
        x1 = xq[1]
        out = tl.inline_asm_elementwise(
            asm, cons, [c0, c1, c2, c3, c4, c5, c6, c7, w_a[j], w_b[j], nz_a, nz_b,
                        x0[4 * j], x0[4 * j + 1], x0[4 * j + 2], x0[4 * j + 3],
                        x1[4 * j], x1[4 * j + 1], x1[4 * j + 2], x1[4 * j + 3]],
            dtype=(tl.float32,) * 8, is_pure=False, pack=1)
    return out


@triton.jit
def _mma_x(x32, k0):
    """The lane's 16 int32 of x (four words' bf16/fp16 pairs) for the k-block at k0."""
    a0, a1, a2, a3 = _ldg4(x32 + k0 // 2)
    b0, b1, b2, b3 = _ldg4(x32 + k0 // 2 + 4)
    c0, c1, c2, c3 = _ldg4(x32 + k0 // 2 + 8)
    d0, d1, d2, d3 = _ldg4(x32 + k0 // 2 + 12)
    return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3)


@triton.jit
def _mma_loads(wa_ptr, wb_ptr, x0_ptr, x1_ptr, s_ptr, z_ptr, ca, cb, k0, group_size, stride_sg, stride_zg,
               GROUP_LOG2: tl.constexpr, GROUPS: tl.constexpr):
    """Everything the k-block at k0 reads: the lane's two weight words x 4, its x pairs, and the
    group's scales and zeros of its two columns."""
    w_a = _ldg4(wa_ptr + k0 // 8)
    w_b = _ldg4(wb_ptr + k0 // 8)
    if GROUPS == 1:
        xq = (_mma_x(x0_ptr, k0),)
    else:
        xq = (_mma_x(x0_ptr, k0), _mma_x(x1_ptr, k0))
    grp = _group_of(k0, group_size, GROUP_LOG2)
    sa, za = _group_row(s_ptr, z_ptr, grp, stride_sg, stride_zg, ca, None)
    sb, zb = _group_row(s_ptr, z_ptr, grp, stride_sg, stride_zg, cb, None)
    return w_a, w_b, xq, sa, sb, za, zb


@triton.jit
def _mma_tile_loads(wc_ptr, wd_ptr, s_ptr, z_ptr, cc, cd, k0, group_size, stride_sg, stride_zg,
                    GROUP_LOG2: tl.constexpr):
    """A second column tile's share of ``_mma_loads`` (its words, scales and zeros; x is shared)."""
    w_c = _ldg4(wc_ptr + k0 // 8)
    w_d = _ldg4(wd_ptr + k0 // 8)
    grp = _group_of(k0, group_size, GROUP_LOG2)
    sc, zc = _group_row(s_ptr, z_ptr, grp, stride_sg, stride_zg, cc, None)
    sd, zd = _group_row(s_ptr, z_ptr, grp, stride_sg, stride_zg, cd, None)
    return w_c, w_d, sc, sd, zc, zd


@triton.jit
def _mma_tile_out(acc, GROUPS: tl.constexpr):
    """One column tile's C fragments joined as the epilogue stores them: [lane, row pair, column a / b]
    (and the 8-row group last when GROUPS == 2)."""
    y = tl.join(tl.join(acc[0], acc[1]), tl.join(acc[2], acc[3]))
    if GROUPS == 2:
        y = tl.join(y, tl.join(tl.join(acc[4], acc[5]), tl.join(acc[6], acc[7])))
    return y


@triton.jit
def _mma_block(acc, w_a, w_b, xq, sa, sb, za, zb, GROUPS: tl.constexpr, BF16: tl.constexpr):
    """acc (4 fp32 per activation-row group) += one k-block: the exact integer products of the
    lane's words (``_mma_word`` x 4), times the group's scale of each C row (column a / b)."""
    if BF16:
        nz_a = (za | 0xC300) * 0x10001  # -(128 + z) in both bf16 halves
        nz_b = (zb | 0xC300) * 0x10001
    else:
        nz_a = (za | 0xE400) * 0x10001  # -(1024 + z) in both fp16 halves
        nz_b = (zb | 0xE400) * 0x10001
    zero = tl.zeros_like(sa)
    if GROUPS == 1:
        t = (zero, zero, zero, zero)
    else:
        t = (zero, zero, zero, zero, zero, zero, zero, zero)
    t = _mma_word(t, w_a, w_b, nz_a, nz_b, xq, 0, GROUPS, BF16)
    t = _mma_word(t, w_a, w_b, nz_a, nz_b, xq, 1, GROUPS, BF16)
    t = _mma_word(t, w_a, w_b, nz_a, nz_b, xq, 2, GROUPS, BF16)
    t = _mma_word(t, w_a, w_b, nz_a, nz_b, xq, 3, GROUPS, BF16)
    if GROUPS == 1:
        out = (acc[0] + t[0] * sa, acc[1] + t[1] * sa, acc[2] + t[2] * sb, acc[3] + t[3] * sb)
    else:
        out = (acc[0] + t[0] * sa, acc[1] + t[1] * sa, acc[2] + t[2] * sb, acc[3] + t[3] * sb,
               acc[4] + t[4] * sa, acc[5] + t[5] * sa, acc[6] + t[6] * sb, acc[7] + t[7] * sb)
    return out


@triton.jit
def _warp_sum(a, WK: tl.constexpr, COLS: tl.constexpr):
    """A [WK * COLS] accumulator summed over its WK warp rows (fixed order)."""
    return tl.sum(tl.reshape(a, (WK, COLS)), axis=0)


@triton.jit
def _sum_warps(acc, WK: tl.constexpr, COLS: tl.constexpr):
    """``_warp_sum`` of each accumulator of ``acc`` (4 or 8)."""
    out = (_warp_sum(acc[0], WK, COLS), _warp_sum(acc[1], WK, COLS), _warp_sum(acc[2], WK, COLS),
           _warp_sum(acc[3], WK, COLS))
    if len(acc) == 8:
        out = out + (_warp_sum(acc[4], WK, COLS), _warp_sum(acc[5], WK, COLS), _warp_sum(acc[6], WK, COLS),
                     _warp_sum(acc[7], WK, COLS))
    return out


@triton.jit
def _int4_mma_kernel(
    x_ptr,  # [M, K] bf16/fp16, rows 16-byte aligned (already permuted for act-order)
    qw_ptr,  # int32 [N, K/8]
    s_ptr,  # [G, N]
    z_ptr,  # uint8 [G, N]
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N]
    part_ptr,  # fp32 [splits, M, N] (REDUCE > 0)
    ticket_ptr,  # int32 [m_tiles * n_tiles] (REDUCE 2)
    M,
    N,
    K,  # multiple of 128
    group_size,  # multiple of 128, or K
    k_per_split,  # multiple of 128
    splits,
    stride_xm,
    stride_qn,
    stride_sg,
    stride_zg,
    stride_ps,
    WARPS: tl.constexpr,  # = num_warps
    WK: tl.constexpr,  # warps splitting the program's K slice (k-blocks wk, wk + WK, ..); WARPS / WK
    # warps side by side own 16 output columns each
    GROUPS: tl.constexpr,  # activation rows / 8 (1 or 2)
    GROUP_LOG2: tl.constexpr,  # see _group_of
    REDUCE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16: tl.constexpr,
    TILES: tl.constexpr = 1,  # 16-column tiles per warp; with 2 the second (columns + 16) reuses the x loads
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    R: tl.constexpr = 32 * WARPS
    WN: tl.constexpr = WARPS // WK
    r = tl.arange(0, R)  # one element per thread: element r is lane r % 32 of warp r // 32
    lane = r % 32
    g = lane // 4  # the MMA's group: output columns g, g + 8 (A rows) and activation row g (B column)
    c = lane % 4  # the MMA's thread in group: words 4c .. 4c + 3 of every k-block (A/B k order)
    col_a = pid_n * (16 * TILES * WN) + (r // 32) % WN * (16 * TILES) + g
    col_b = col_a + 8
    ca = tl.minimum(col_a, N - 1)  # rows past N read row N - 1 (never stored)
    cb = tl.minimum(col_b, N - 1)
    wa_ptr = qw_ptr + ca.to(tl.int64) * stride_qn + c * 4
    wb_ptr = qw_ptr + cb.to(tl.int64) * stride_qn + c * 4
    if TILES == 2:  # the warp's second tile: columns g + 16, g + 24
        cc = tl.minimum(col_a + 16, N - 1)
        cd = tl.minimum(col_a + 24, N - 1)
        wc_ptr = qw_ptr + cc.to(tl.int64) * stride_qn + c * 4
        wd_ptr = qw_ptr + cd.to(tl.int64) * stride_qn + c * 4
    m0 = pid_m * (8 * GROUPS)
    row0 = tl.minimum(m0 + g, M - 1)  # rows past M repeat row M - 1 (their columns of C are never stored)
    x0_ptr = (x_ptr + row0.to(tl.int64) * stride_xm).to(tl.pointer_type(tl.int32)) + c * 16
    row1 = tl.minimum(m0 + 8 + g, M - 1)
    x1_ptr = (x_ptr + row1.to(tl.int64) * stride_xm).to(tl.pointer_type(tl.int32)) + c * 16
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    k_last = k_end - 128
    k_warp = k_start + r // (32 * WN) * 128  # the warp's first k-block
    zero = tl.zeros((R,), dtype=tl.float32)
    if GROUPS == 1:
        acc = (zero, zero, zero, zero)
    else:
        acc = (zero, zero, zero, zero, zero, zero, zero, zero)
    # everything a k-block reads is loaded one k-block ahead; past the slice's end a warp re-reads
    # the last k-block, with scale 0
    k_first = tl.minimum(k_warp, k_last)
    w_a, w_b, xq, sa, sb, za, zb = _mma_loads(wa_ptr, wb_ptr, x0_ptr, x1_ptr, s_ptr, z_ptr, ca, cb, k_first,
                                              group_size, stride_sg, stride_zg, GROUP_LOG2, GROUPS)
    if WK > 1:
        sa = tl.where(k_warp < k_end, sa, 0.0)
        sb = tl.where(k_warp < k_end, sb, 0.0)
    if TILES == 2:
        acc2 = acc  # the second tile's C
        w_c, w_d, sc, sd, zc, zd = _mma_tile_loads(wc_ptr, wd_ptr, s_ptr, z_ptr, cc, cd, k_first, group_size,
                                                   stride_sg, stride_zg, GROUP_LOG2)
        if WK > 1:
            sc = tl.where(k_warp < k_end, sc, 0.0)
            sd = tl.where(k_warp < k_end, sd, 0.0)
    for k0 in range(k_start, k_end, 128 * WK):
        k_next = k_warp + (k0 - k_start) + 128 * WK
        k_load = tl.minimum(k_next, k_last)
        # (the asm statements are not pure: the compiler keeps this order, the next k-block's
        # loads before this one's MMAs; ptxas still moves them down to save registers)
        w_a1, w_b1, xq1, sa1, sb1, za1, zb1 = _mma_loads(wa_ptr, wb_ptr, x0_ptr, x1_ptr, s_ptr, z_ptr, ca, cb,
                                                         k_load, group_size, stride_sg, stride_zg, GROUP_LOG2,
                                                         GROUPS)
        if WK > 1:
            sa1 = tl.where(k_next < k_end, sa1, 0.0)
            sb1 = tl.where(k_next < k_end, sb1, 0.0)
        if TILES == 2:
            w_c1, w_d1, sc1, sd1, zc1, zd1 = _mma_tile_loads(wc_ptr, wd_ptr, s_ptr, z_ptr, cc, cd, k_load,
                                                             group_size, stride_sg, stride_zg, GROUP_LOG2)
            if WK > 1:
                sc1 = tl.where(k_next < k_end, sc1, 0.0)
                sd1 = tl.where(k_next < k_end, sd1, 0.0)
        acc = _mma_block(acc, w_a, w_b, xq, sa, sb, za, zb, GROUPS, BF16)
        if TILES == 2:
            acc2 = _mma_block(acc2, w_c, w_d, xq, sc, sd, zc, zd, GROUPS, BF16)
            w_c, w_d, sc, sd, zc, zd = w_c1, w_d1, sc1, sd1, zc1, zd1
        w_a, w_b, xq, sa, sb, za, zb = w_a1, w_b1, xq1, sa1, sb1, za1, zb1
    if WK > 1:  # the warps of one column group summed in warp order (through shared memory)
        acc = _sum_warps(acc, WK, 32 * WN)
        if TILES == 2:
            acc2 = _sum_warps(acc2, WK, 32 * WN)
        r = tl.arange(0, 32 * WN)
        lane = r % 32
        g = lane // 4
        c = lane % 4
        col_a = pid_n * (16 * TILES * WN) + r // 32 * (16 * TILES) + g
    # C of group q: c0, c1 = (column a, rows 8q + 2c, 8q + 2c + 1), c2, c3 = the same of column b
    two = tl.arange(0, 2)
    m_off = (m0 + 2 * c)[:, None, None] + two[None, :, None]
    n_off = col_a[:, None, None] + 8 * two[None, None, :]
    y = _mma_tile_out(acc, GROUPS)
    if GROUPS == 2:
        m_off = m_off[:, :, :, None] + 8 * two[None, None, None, :]
        n_off = n_off[:, :, :, None] + 0 * two[None, None, None, :]
    if TILES == 2:  # the second tile on a last axis of its own, 16 columns on
        y = tl.join(y, _mma_tile_out(acc2, GROUPS))
        if GROUPS == 1:
            m_off = m_off[:, :, :, None] + 0 * two[None, None, None, :]
            n_off = n_off[:, :, :, None] + 16 * two[None, None, None, :]
        else:
            m_off = m_off[:, :, :, :, None] + 0 * two[None, None, None, None, :]
            n_off = n_off[:, :, :, :, None] + 16 * two[None, None, None, None, :]
    offs = m_off.to(tl.int64) * N + n_off
    mask = (m_off < M) & (n_off < N)
    tile = pid_m * tl.num_programs(0) + pid_n
    _epilogue(y, offs, mask, n_off, out_ptr, part_ptr, ticket_ptr, bias_ptr, tile, pid_k, splits,
              stride_ps, REDUCE, HAS_BIAS)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,  # fp32 [S, M*N]
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M*N] in the output dtype
    total,  # M * N
    N,
    splits,
    stride_ps,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = _sum_partials(part_ptr, offs, mask, splits, stride_ps, tl.zeros((BLOCK,), dtype=tl.float32), False)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# -- planning -------------------------------------------------------------------------------------


@functools.cache
def _sm_count(device_index: int | None) -> int:
    if device_index is None:
        return 8  # the interpreter
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


_TICKETS: dict[int | None, torch.Tensor] = {}


def _tickets(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed split-K tickets (made once, kept forever: captured graphs point at
    them); None while a CUDA graph is being captured before they exist (made outside a capture
    only, so the zeroing really ran)."""
    key = _device_index(device)
    t = _TICKETS.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        t = _TICKETS[key] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return t


def pick_split_k(m: int, k: int, tiles: int, k_blocks: int, sms: int, programs_per_sm: int = 4) -> int:
    """K slices for a memory-bound launch: up to ``programs_per_sm`` programs per SM (enough weight
    bytes in flight, in one wave), at most 32 slices and one k-block per slice, and the fp32 partials
    (written and read back: 8 * splits * M * N bytes) at most the weight's K * N / 2 bytes."""
    cap = min(32, k_blocks, max(1, k // (16 * max(1, m))))
    return max(1, min((programs_per_sm * sms) // tiles, cap))  # at most one wave: no straggler tail


def _group_log2(group_size: int, k: int) -> int:
    """The kernels' GROUP_LOG2: 31 for one group over K, log2 of a power-of-two group size, else -1."""
    if group_size >= k:
        return 31
    return group_size.bit_length() - 1 if pow2_factor(group_size) == group_size else -1


def pow2_factor(v: int) -> int:
    """The largest power of two dividing v (v > 0)."""
    return v & -v


def mma_fits(m: int, k: int, group_size: int) -> bool:
    """The mma path's shapes: up to 16 rows, whole 128-k blocks, each inside one group."""
    return m <= 16 and k % 128 == 0 and (group_size % 128 == 0 or group_size >= k)


def default_config(m: int, n: int, k: int, group_size: int, act_order: bool = False,
                   mma_ok: bool = False) -> Int4Config:
    """The launch configuration for an [m, k] x [k, n] product (split-K left to ``pick_split_k``).

    One row: the FMA GEMV, 4 output columns x 4 words per thread, the next k-block's words in
    flight (~4 instructions per nibble in the sm_90 SASS). On the GPU with 16-bit activations the
    mma path up to 8 rows, and for 9-16 rows on an N or K of 8192+ (two column tiles per warp).
    More rows: tensor cores, W^T x^T while the tokens fit the MMA's N side (paired dequantization,
    ~3 instructions per nibble with everything else, flat in M), x W with 128-row tiles beyond 64
    tokens.
    ``bench quant --sweep`` times these against the alternatives on the GPU."""
    if interpreting():  # small tiles keep the CPU interpreter fast
        if m <= 4:
            return Int4Config("gemv", block_m=triton.next_power_of_2(m), block_n=32, block_k=32, num_stages=1)
        return Int4Config("dot", block_m=16, block_n=32, block_k=32, num_stages=1)
    # act-order: the mma path gathers x first (one more launch, ~6.6 us on the H200); the GEMV's
    # in-kernel gather costs less than that on small weights
    small_act_order = act_order and m == 1 and n * k <= 1 << 25
    if mma_ok and m <= 8 and mma_fits(m, k, group_size) and not small_act_order:  # (16 rows: dot was faster)
        # one 16-column group per program, its warps splitting K: no split-K partials once the
        # groups alone are 256+ programs; 4 warps from 512 groups (N >= 8192), else 8 (16 for a
        # long K: ~4-8 k-blocks per warp)
        warps = 4 if n >= 8192 else (8 if k <= 8192 else 16)
        return Int4Config("mma", block_m=8, block_n=16, block_k=128, num_warps=warps,
                          split_k=1 if n >= 256 * 16 else None)
    if mma_ok and 8 < m <= 16 and mma_fits(m, k, group_size) and not act_order and max(n, k) >= 8192:
        # two 16-column tiles per warp, sharing the x loads (measured on the H200, 2026-11-30, K x N:
        # 4096 x 14336 27.1-27.5 -> 20.2-20.6 us, 14336 x 4096 24.5-25.0 -> 23.4-24.0; at 4096 x 4096
        # the dot path stays, 10.8-11.0 us against 11.0-11.3)
        return Int4Config("mma", block_m=16, block_n=64 if n >= 8192 else 32, block_k=128, num_warps=8,
                          mma_cols=32, split_k=1 if n >= 256 * 16 else None)
    # the H200 sweeps' picks (bench quant --sweep, 2026-11-30, docs/BENCHMARKS.md)
    if m == 1:
        # act-order gathers the activations in the kernel: two warps (half the gathers per weight)
        return Int4Config("gemv", block_m=1, block_n=128, block_k=128, num_warps=2 if act_order else 4,
                          num_stages=2)
    if m <= 16:
        return Int4Config("dot", block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4, swap_ab=True)
    if m <= 32:  # split-K partials summed by the reduce kernel: the tickets' barriers cost 0-14% here
        return Int4Config("dot", block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4, swap_ab=True,
                          reduce="kernel")
    if m <= 64:
        return Int4Config("dot", block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, swap_ab=True,
                          reduce="kernel")
    return Int4Config("dot", block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4)


@dataclass(frozen=True)
class Plan:
    """Everything a launch needs besides the tensors (cached per problem)."""

    cfg: Int4Config
    block_m: int
    block_k: int
    splits: int
    k_per_split: int
    grid: tuple[int, ...]
    reduce: int  # 0: direct store, 1: partials + reduce kernel, 2: partials + last program
    scale_after: bool


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, group_size: int, device_index: int | None, config: Int4Config | None,
          act_order: bool = False, mma_ok: bool = False) -> Plan:
    cfg = config or default_config(m, n, k, group_size, act_order, mma_ok)
    if cfg.path == "mma" and not (mma_ok and mma_fits(m, k, group_size)):
        raise ValueError(f"Int4Config path 'mma' needs a GPU, bf16/fp16 activations with 16-byte aligned rows, "
                         f"M <= 16, K % 128 == 0 and groups of a multiple of 128 (M={m}, K={k}, group {group_size})")
    aligned = group_size >= k  # one group: any k-block lies in it
    block_k = cfg.block_k if aligned else min(cfg.block_k, pow2_factor(group_size))
    path = cfg.path
    if path == "dot" and block_k < 16:  # a group size with no 16-row blocks: the FMA path
        path = "gemv"
    if path != cfg.path:  # a group size with no 16-row blocks: the FMA path, tiles of 4 rows
        cfg = replace(cfg, path=path, block_m=4)
    block_m = min(cfg.block_m, 4) if path == "gemv" else cfg.block_m
    m_tiles = triton.cdiv(m, block_m)
    n_tiles = triton.cdiv(n, cfg.block_n)
    k_blocks = triton.cdiv(k, block_k)
    split_k = cfg.split_k
    if split_k is None:
        # resident programs per SM: 4 FMA programs (255 registers x 64 threads), 2 tensor-core ones,
        # 32 warps of mma programs (~56 registers)
        split_k = pick_split_k(m, k, m_tiles * n_tiles, k_blocks, _sm_count(device_index),
                               programs_per_sm={"gemv": 4, "dot": 2, "mma": max(1, 32 // cfg.num_warps)}[path])
    split_k = max(1, min(int(split_k), k_blocks))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slices
    reduce = 0
    if split_k > 1:
        reduce = 2 if cfg.reduce == "last" and m_tiles * n_tiles <= TICKETS else 1
    grid = (m_tiles, n_tiles, split_k) if path == "dot" else (n_tiles, split_k, m_tiles)
    scale_after = cfg.scale_after if cfg.scale_after is not None else block_m < block_k
    return Plan(cfg, block_m, block_k, split_k, k_per_split, grid, reduce, scale_after)


def _mma_ok(x: torch.Tensor) -> bool:
    """x suits the mma path: compiled (not the interpreter), 16-bit, rows on 16-byte boundaries."""
    return (not interpreting() and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0)


def _pairs_ok(cfg: Int4Config, plan: Plan, x_dtype: torch.dtype, scales_dtype: torch.dtype) -> bool:
    """The dot path's paired dequantization gives the fp32 route's bits: on the GPU, for 16-bit
    activations, and when a scale folded in before the dot is held exactly in x's dtype (then the
    paired multiply rounds the exact product once, as the fp32 route does)."""
    if not cfg.pairs or interpreting() or x_dtype not in (torch.bfloat16, torch.float16):
        return False
    return plan.scale_after or scales_dtype == x_dtype


# -- launcher -------------------------------------------------------------------------------------


def check_int4_weights(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> int:
    """Validates the kernel layout of one weight (ValueError/TypeError naming the tensor); returns
    the effective group size. Layers call this once at load and launch with ``check=False``."""
    device = qweight.device
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), contiguous=True)
    n, k = qweight.shape[0], qweight.shape[1] * 8
    group_size = k if group_size == -1 else int(group_size)
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide K={k}")
    if group_size < k and group_size % 8:
        raise ValueError(f"group_size {group_size} must be a multiple of 8 (groups of whole int32 words)")
    groups = k // group_size
    check_tensor("scales", scales, shape=(groups, n), dtypes=FLOAT_DTYPES, device=device)
    check_tensor("zeros", zeros, shape=(groups, n), dtypes=(torch.uint8,), device=device)
    if perm is not None:
        check_tensor("perm", perm, shape=(k,), dtypes=(torch.int32,), device=device, contiguous=True)
    if bias is not None:
        check_tensor("bias", bias, shape=(n,), dtypes=FLOAT_DTYPES, device=device, contiguous=True)
    return group_size


def int4_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    qweight: torch.Tensor,  # int32 [N, K/8]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # uint8 [G, N]
    group_size: int,
    perm: torch.Tensor | None = None,  # int32 [K]
    bias: torch.Tensor | None = None,  # [N]
    split_k: int | None = None,
    config: Int4Config | None = None,
    check: bool = True,
) -> torch.Tensor:  # [M, N], x.dtype
    """``x[:, perm] @ W + bias`` with W dequantized on the fly (see ``int4_gemm_ref``).

    ``config=None`` uses ``default_config``; ``split_k`` overrides the config's (None: chosen
    from the grid). ``check=False`` skips the argument checks (weights checked at load with
    ``check_int4_weights``; x must then be an [M, K] float tensor, contiguous along K, on their
    device). Host work per call: the output (and split-K partials) allocation and the launch.
    """
    if check:
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
        device = check_device(x, "x")
        if x.shape[1] % 8:
            raise ValueError(f"K={x.shape[1]} must be a multiple of 8")
        check_tensor("qweight", qweight, shape=(None, x.shape[1] // 8), dtypes=(torch.int32,), device=device)
        group_size = check_int4_weights(qweight, scales, zeros, group_size, perm, bias)
    m, k = x.shape
    n = qweight.shape[0]
    if group_size == -1:
        group_size = k
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    mma_ok = _mma_ok(x)
    if split_k is not None:
        config = replace(config or default_config(m, n, k, group_size, perm is not None, mma_ok), split_k=split_k)
    plan = _plan(m, n, k, group_size, _device_index(x.device), config, perm is not None, mma_ok)
    cfg = plan.cfg
    reduce = plan.reduce
    tickets = None
    if reduce == 2:
        tickets = _tickets(x.device)
        if tickets is None:
            reduce = 1
    part = torch.empty((plan.splits, m, n), dtype=torch.float32, device=x.device) if reduce else out
    bias_arg = bias if bias is not None else scales
    ticket_arg = tickets if tickets is not None else qweight
    if cfg.path == "mma":
        if perm is not None:
            x = x.index_select(1, perm)
        _int4_mma_kernel[plan.grid](
            x, qweight, scales, zeros, bias_arg, out, part, ticket_arg,
            m, n, k, group_size, plan.k_per_split, plan.splits,
            x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), part.stride(0) if reduce else 0,
            WARPS=cfg.num_warps, WK=cfg.num_warps * cfg.mma_cols // cfg.block_n, GROUPS=plan.block_m // 8,
            TILES=cfg.mma_cols // 16,
            GROUP_LOG2=_group_log2(group_size, k), REDUCE=reduce,
            HAS_BIAS=bias is not None, BF16=x.dtype == torch.bfloat16,
            num_warps=cfg.num_warps, num_stages=1,
        )
    elif cfg.path == "gemv":
        if perm is not None and not cfg.gather_x:
            x, perm = x.index_select(1, perm), None
        if perm is not None:
            x_mode = 3
        else:
            pairs = x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0  # rows start on 32-bit words
            x_mode = {torch.bfloat16: 0, torch.float16: 1}.get(x.dtype, 2) if pairs else 2
        _int4_gemv_kernel[plan.grid](
            x, qweight, scales, zeros, perm if perm is not None else qweight, bias_arg, out, part, ticket_arg,
            m, n, k, group_size, plan.k_per_split, plan.splits,
            x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), part.stride(0) if reduce else 0,
            *EXPONENT_BITS,
            BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=plan.block_k, GROUP_LOG2=_group_log2(group_size, k),
            EVEN_K=k % plan.block_k == 0, PREFETCH=min(cfg.num_stages - 1, 2), X_MODE=x_mode, REDUCE=reduce, HAS_BIAS=bias is not None,
            num_warps=cfg.num_warps, num_stages=1,
        )
    else:
        if perm is not None:
            x = x.index_select(1, perm)  # one gather, then contiguous groups for the tiles
        _int4_dot_kernel[plan.grid](
            x, qweight, scales, zeros, bias_arg, out, part, ticket_arg,
            m, n, k, group_size, plan.k_per_split, plan.splits,
            x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), part.stride(0) if reduce else 0,
            *EXPONENT_BITS,
            BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=plan.block_k, GROUP_LOG2=_group_log2(group_size, k),
            EVEN_K=k % plan.block_k == 0, REDUCE=reduce, HAS_BIAS=bias is not None, SWAP_AB=cfg.swap_ab, SCALE_AFTER=plan.scale_after,
            DOT_DTYPE=dot_dtype(x.dtype), IEEE=x.dtype == torch.float32,
            PAIRS=_pairs_ok(cfg, plan, x.dtype, scales.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if reduce == 1:
        total, block = m * n, 1024
        _split_k_reduce_kernel[(triton.cdiv(total, block),)](
            part, bias_arg, out, total, n, plan.splits, part.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return out
