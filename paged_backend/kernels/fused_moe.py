"""Fused mixture-of-experts MLP in Triton: top-k routed SwiGLU experts, fp32 accumulation.

Contract (as ``fused_moe_ref``)::

    fused_moe(x [M, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [M, K] float32,
              topk_ids [M, K] int32/int64, *, config=None, apply_router_weight_on_input=False,
              expert_map=None, w13_scale=None, w2_scale=None, block_shape=None,
              intermediate_amax=None, w13_zeros=None, w2_zeros=None, group_size=None) -> out [M, H] in x.dtype

Rows 0..I-1 of ``w13[e]`` are the gate projection, rows I..2I-1 the up projection. For every
(token m, slot k) pair with expert e = topk_ids[m, k] and weight w = topk_weights[m, k]::

    h = silu(x[m] @ gate.T) * (x[m] @ up.T)        y = h @ w2[e].T        out[m] = sum_k w * y

With ``apply_router_weight_on_input`` the weight scales the expert's input instead
(``x[m] * w`` feeds the expert) and the slots are summed unweighted. x, w13 and w2 share one
dtype (bf16, fp16 or fp32); the products accumulate in fp32 and the intermediates are stored
in x.dtype, as the reference rounds them (here the routed weight scales the fp32 accumulator
before that rounding).

FP8 experts (w13 / w2 float8_e4m3fn with float32 ``w13_scale`` / ``w2_scale``; the shapes and the
math are ``fused_moe_ref``'s): x and the SiLU-and-mul intermediate are quantized to e4m3 on the
device (``quantize_moe_activations``: ``paged_backend/kernels/fp8_quant.py``, per token, and per group of bk
inputs with ``block_shape`` (bn, bk)) and both GEMMs multiply e4m3 tiles (``tl.dot`` on e4m3: the
FP8 tensor cores from compute capability 8.9, whose running sums keep ~14 bits; fp16 operands below
and for fp32 activations, exact for e4m3; fp32 in the interpreter), accumulating in fp32:

    block-wise   BLOCK_K = bk, one scale group per k-step:
                 acc += dot(a_q, w_q) * a_scale[row, k-group] * w_scale[e, n // bn, k-group]
    per channel  acc = dot over all of K, then acc * a_scale[row] * w_scale[e, n]

Tuned tables for fp8 experts carry vLLM's selector (``dtype=fp8_w8a8``, block-wise also
``block_shape=[bn,bk]``); ``pick_config`` forces BLOCK_K = bk for block scales (any BLOCK_N: the
weight-scale column of each output feature is loaded, ``n // bn``). ``intermediate_amax``: per-token
scales of an intermediate split over tensor-parallel ranks (``fused_moe_ref``).

int4 experts (W4A16, int32 w13 [E, 2I, H/8] / w2 [E, H, I/8] in ``int4_gemm_ref``'s kernel layout
with ``w13_scale`` / ``w2_scale`` [E, G, N] and uint8 ``w13_zeros`` / ``w2_zeros``, ``group_size``;
``fused_moe_ref``'s contract): each k-step loads the [BLOCK_N, BLOCK_K/8] words of its tile (every
output feature's words contiguous along K) and the group's scale and zero rows (BLOCK_K divides the
group: ``pick_config(int4_group=...)``), turns the nibbles into the exact q - z (``int4_gemm``'s
``dequant_tile_pairs`` on the GPU for 16-bit activations, two values per instruction; ``dequant_tile``
elsewhere) and adds ``dot(a, q - z) * scale`` to the fp32 accumulator, so W is never rounded. Tables
carry vLLM's ``dtype=int4_w4a16`` selector.

``expert_map`` (expert parallelism, as ``fused_moe_ref``): int32/int64 [E_global], global expert id
-> index in w13 / w2, or -1 for an expert held elsewhere. The ids are mapped once (a gather on the
device); -1 pairs get no slot in the alignment and no program work in the pairs path, and their
rows of the top-k sum are zeros.

Algorithm. The M*K pairs are numbered p = m*K + k (``topk_ids.flatten()``); pair p reads token
p // K. Two grouped GEMMs run over them, one launch each, every program multiplying a tile of
pairs that all use one expert by a BLOCK_N slice of that expert's weight ([N, Kdim] row-major,
read as the transposed operand)::

    inter1 [M*K, 2I] = grouped GEMM (x rows p // K, w13)            (weights applied here with
                                                                    apply_router_weight_on_input)
    inter  [M*K, I]  = silu_and_mul(inter1)                          (paged_backend/kernels/activation.py)
    inter2 [M*K, H]  = grouped GEMM (inter rows p, w2) * topk_weights (otherwise here)
    out    [M, H]    = inter2.view(M, K, H).sum(1)                   (torch; fp32 accumulation.
                                                                    K = 1: GEMM 2 writes out)

Each GEMM program stores its rows at their pair's position p, so the top-k sum reads
contiguous [K, H] blocks and no un-permute pass is needed.

Variants (chosen by ``MoEConfig.BLOCK_M``):

``sorted`` (BLOCK_M >= 16, tensor cores): ``moe_align_block_size`` (three small Triton launches:
count, scan, scatter) groups the pairs by expert, pads each expert's group to a multiple of BLOCK_M with the sentinel M*K and lists one expert
per BLOCK_M tile; experts without tokens get no tiles. The grid is sized for the most tiles
the shapes allow (M*K + min(E, M*K) * (BLOCK_M - 1) padded rows), and programs past
``num_tokens_post_padded`` (a device scalar) exit at once: no host synchronisation anywhere,
so the launch is CUDA-graph capturable. Sentinel rows load zeros and store nothing. Program
ids are swizzled in groups of GROUP_M tile rows (the tiles of neighbouring pair tiles that
share one expert's weight slice run together, for L2 reuse).

``pairs`` (BLOCK_M = 1, no sort): one program per (pair, BLOCK_N slice), the expert read straight
from ``topk_ids``, the product a GEMV on the FMA units (``tl.dot`` needs 16 rows). At decode,
M*K is a handful of pairs that mostly hit distinct experts: the alignment would be three more
launches around a memory-bound GEMM and its 16-row tiles would be nearly empty, while every
pair's weight slice is read once either way. ``pick_config`` takes it while
M*K <= min(PAIRS_MAX, E) (at most about one pair per expert).

``MoEConfig`` fields: BLOCK_M (pairs per program: 1 selects ``pairs``, else a power of two
>= 16), BLOCK_N (output features per program), BLOCK_K (reduction step), GROUP_M (program-id
swizzle width in tile rows, 1 = none), num_warps, num_stages (software-pipeline depth). One
config serves both GEMMs. ``pick_config(M, E, N, K, dtype)`` (vLLM's naming: N the intermediate
size I, K the hidden size H) has a decode and a prefill default and consults an optional tuned
table: ``load_config_table(path)`` reads a JSON file named like vLLM's
(``config_file_name(E, N, device_name)`` -> ``E=8,N=14336,device_name=NVIDIA_H200.json``) mapping
a token count M to ``{"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
"num_warps", "num_stages"}``; the entry of the nearest M is used. ``fused_moe(config=None)`` on a
CUDA bf16/fp16 input looks the table up by (E, N, the device's name) in
``$PAGED_BACKEND_MOE_CONFIG_DIR``, then in ``paged_backend/kernels/fused_moe_configs/`` (tables written by
``paged-backend bench moe --tune``; read once per process), and falls back to the defaults.

Host work per call: the checks (with ``check=True`` the id range check is one host sync, skipped
while a CUDA graph is captured), the routing (torch ops on the device), three buffers and the
launches.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from paged_backend.kernels._launch import (
    FLOAT_DTYPES,
    check_device,
    check_tensor,
    dot_dtype,
    interpreting,
    next_pow2,
)
from paged_backend.kernels.activation import silu_and_mul
from paged_backend.kernels.fp8_quant import quantize_fp8, quantize_fp8_groups
from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, fp8_scale_from_amax
from paged_backend.kernels.fused_moe_ref import (
    check_expert_map,
    check_fp8_moe_scales,
    check_int4_moe_args,
    padded_capacity,
)
from paged_backend.kernels.int4_gemm import EXPONENT_BITS, dequant_tile, dequant_tile_pairs

PAIRS_MAX = 16  # pick_config: the unsorted pairs path for up to this many (token, slot) pairs (and <= E)
_ID_DTYPES = (torch.int32, torch.int64)
_VLLM_KEYS = {"BLOCK_SIZE_M": "BLOCK_M", "BLOCK_SIZE_N": "BLOCK_N", "BLOCK_SIZE_K": "BLOCK_K",
              "GROUP_SIZE_M": "GROUP_M", "num_warps": "num_warps", "num_stages": "num_stages"}


@dataclass(frozen=True)
class MoEConfig:
    """One launch configuration of both grouped GEMMs (see the module docstring)."""

    BLOCK_M: int = 16  # pairs per program: 1 = the unsorted pairs path, else a power of two >= 16
    BLOCK_N: int = 64  # output features per program
    BLOCK_K: int = 32  # reduction step
    GROUP_M: int = 1  # program ids swizzled in groups of this many tile rows (L2 reuse); 1 = row-major
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.BLOCK_M != 1 and (self.BLOCK_M < 16 or self.BLOCK_M & (self.BLOCK_M - 1)):
            raise ValueError(f"MoEConfig.BLOCK_M must be 1 (pairs path) or a power of two >= 16, got {self.BLOCK_M}")
        for name in ("BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoEConfig.{name} must be a power of two >= 16, got {v}")
        for name in ("GROUP_M", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def sorted(self) -> bool:
        """True for the sorted (tensor-core) path, False for the pairs path."""
        return self.BLOCK_M > 1

    @classmethod
    def from_vllm(cls, entry: dict) -> MoEConfig:
        """A config from one entry of a vLLM-format tuning table (extra keys are ignored)."""
        missing = [k for k in _VLLM_KEYS if k not in entry and k not in ("num_warps", "num_stages")]
        if missing:
            raise ValueError(f"MoE tuning entry lacks {missing}: {entry}")
        return cls(**{ours: int(entry[theirs]) for theirs, ours in _VLLM_KEYS.items() if theirs in entry})


# -- config selection ------------------------------------------------------------------------------


def config_file_name(num_experts: int, intermediate: int, device_name: str, dtype: str | None = None,
                     block_shape: tuple[int, int] | None = None) -> str:
    """vLLM's tuning-table file name: ``E=..,N=..,device_name=...[,dtype=...][,block_shape=[bn,bk]].json``
    (spaces -> _); fp8 experts use ``dtype=fp8_w8a8`` (``FP8_SELECTOR``), block-wise ones the block too."""
    selector = f",dtype={dtype}" if dtype else ""
    if block_shape:
        selector += f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    return f"E={num_experts},N={intermediate},device_name={device_name.replace(' ', '_')}{selector}.json"


FP8_SELECTOR = "fp8_w8a8"  # vLLM's dtype selector of fp8 weights with fp8 activations
INT4_SELECTOR = "int4_w4a16"  # ... and of int4 weights with 16-bit activations


CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_moe_configs")
CONFIG_DIR_ENV = "PAGED_BACKEND_MOE_CONFIG_DIR"


def load_config_table(path: str | os.PathLike) -> dict[int, MoEConfig]:
    """A tuning table: JSON mapping token counts to vLLM-format entries (see the module docstring)."""
    with open(path) as f:
        raw = json.load(f)
    return {int(m): MoEConfig.from_vllm(entry) for m, entry in raw.items()}


@functools.cache
def tuned_table(num_experts: int, intermediate: int, device_name: str, dtype: str | None = None,
                block_shape: tuple[int, int] | None = None) -> dict[int, MoEConfig] | None:
    """The tuned table for this shape, device (and fp8 selector), or None where there is none."""
    name = config_file_name(num_experts, intermediate, device_name, dtype, block_shape)
    for folder in (os.environ.get(CONFIG_DIR_ENV), CONFIG_DIR):
        if folder and os.path.isfile(os.path.join(folder, name)):
            return load_config_table(os.path.join(folder, name))
    return None


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_for(x: torch.Tensor, num_experts: int, intermediate: int, fp8: bool = False,
              block_shape: tuple[int, int] | None = None, int4: bool = False) -> dict[int, MoEConfig] | None:
    """The tuned table ``fused_moe`` uses for activations ``x`` (CUDA bf16/fp16 only), if any; ``fp8``:
    e4m3 experts (``block_shape``: block-wise scales), whose tables carry vLLM's fp8 selector; ``int4``:
    int4 experts (vLLM's int4_w4a16 selector)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or interpreting():
        return None
    selector = FP8_SELECTOR if fp8 else INT4_SELECTOR if int4 else None
    return tuned_table(num_experts, intermediate, _device_name(x.device.index or 0),
                       selector, tuple(block_shape) if fp8 and block_shape else None)


@functools.cache
def _fp8_mma(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_dot_dtype(device: torch.device, exact: bool = False):  # -> triton.language.dtype
    """Operand type of ``tl.dot`` for e4m3 tiles: e4m3 itself (FP8 tensor cores) from compute
    capability 8.9, fp16 below (exact for every e4m3 value), float32 in the interpreter.

    ``exact`` (fp32 activations, the checking mode): fp16 operands on every GPU, whose products and fp32
    accumulation are exact to fp32 rounding; Hopper's FP8 MMAs keep only about 14 bits of the running
    sum (as in vLLM's kernel and DeepGEMM, which add each block's partial sum in fp32)."""
    if interpreting() or device.type != "cuda":
        return tl.float32
    if exact:
        return tl.float16
    return tl.float8e4nv if _fp8_mma(device.index if device.index is not None else torch.cuda.current_device()) \
        else tl.float16


_DECODE = MoEConfig(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
_SMALL = MoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
_PREFILL = MoEConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)


def pick_config(M: int, E: int, N: int, K: int, dtype: torch.dtype, *, top_k: int = 1,
                table: dict[int, MoEConfig] | None = None, fp8: bool = False,
                block_shape: tuple[int, int] | None = None, int4_group: int | None = None) -> MoEConfig:
    """The config for M tokens routed to ``top_k`` of E experts, intermediate size N, hidden size K.

    ``table`` (``load_config_table``): the entry of the nearest token count. Otherwise untuned
    defaults: the pairs path while M * top_k <= min(PAIRS_MAX, E); 16-row tiles while M <= E
    (few pairs per expert); 64-row tiles swizzled by 8 beyond (vLLM's untuned default shapes).
    fp32 takes one pipeline stage less (twice the bytes a tile). Under the CPU interpreter the N
    and K tiles grow to cover the small test shapes in one step (fewer interpreted programs).

    ``fp8`` (e4m3 experts): the reduction step is at least 64 (the 8-bit MMAs' k is 32); with
    ``block_shape`` (bn, bk) it is exactly bk, one activation scale group per step, whatever the
    table says (any BLOCK_N: the kernel loads each column's weight scale, ``n // bn``).

    ``int4_group`` (int4 experts' group size, -1 for one group): the reduction step stays inside one
    group (at most the group size, which is a power of two).
    """
    cfg = _default_config(M, E, N, K, dtype, top_k, table)
    if int4_group is not None and int4_group != -1 and cfg.BLOCK_K > int4_group:
        return replace(cfg, BLOCK_K=int4_group)
    if fp8 and block_shape is not None:
        return replace(cfg, BLOCK_K=int(block_shape[1]))
    if fp8 and not interpreting():
        return replace(cfg, BLOCK_K=max(64, cfg.BLOCK_K))
    return cfg


def _default_config(M: int, E: int, N: int, K: int, dtype: torch.dtype, top_k: int,
                    table: dict[int, MoEConfig] | None) -> MoEConfig:
    if table:
        return table[min(table, key=lambda m: (abs(m - M), m))]
    if M * top_k <= min(PAIRS_MAX, E):
        cfg = _DECODE
    elif M <= E:
        cfg = _SMALL
    else:
        cfg = _PREFILL
    if dtype == torch.float32:
        cfg = replace(cfg, num_stages=max(1, cfg.num_stages - 1))
    if interpreting():
        tile = max(16, min(128, next_pow2(max(2 * N, K))))
        cfg = replace(cfg, BLOCK_N=tile, BLOCK_K=tile, num_stages=1)
    return cfg


# -- routing ---------------------------------------------------------------------------------------


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the M*K (token, slot) pairs by expert in BLOCK_M tiles: three small Triton launches.

    Returns int32 ``sorted_token_ids`` [C] (pair ids p = m*K + k, expert by expert, each expert's
    run padded to a multiple of ``block_m`` with the sentinel M*K), ``expert_ids`` [C / block_m]
    (each tile's expert; -1 for tiles past the end) and ``num_tokens_post_padded`` [1] (the used
    length of ``sorted_token_ids``). C = ``padded_capacity``: fixed by the shapes, so nothing is
    read back to the host. Ids must lie in [0, num_experts), or be -1 (an expert not held here,
    ``expert_map``): such pairs get no slot.

    The same tiles as ``fused_moe_ref.moe_align_block_size_ref``, except that the pairs inside an
    expert's run come in the order the scatter's atomics hand out slots (each row's product does
    not depend on the others in its tile, so the MoE output is the same)::

        _align_count    every program: its share of sorted_token_ids set to the sentinel, and
                        counts[e] += 1 per pair (atomics)
        _align_offsets  one program: runs padded to whole tiles, their starts (an exclusive scan)
                        as the scatter's cursors, the used length, and each tile's expert
        _align_scatter  every program: slot = cursor[e]++ (atomics) per pair; sorted[slot] = p
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    num_tiles = capacity // block_m
    sorted_ids = torch.empty((capacity,), dtype=torch.int32, device=device)
    expert_ids = torch.empty((num_tiles,), dtype=torch.int32, device=device)
    num_post_padded = torch.empty((1,), dtype=torch.int32, device=device)
    counts = torch.zeros((2, num_experts), dtype=torch.int32, device=device)  # counts, then cursors
    chunk = 1024
    grid = (triton.cdiv(max(capacity, num_pairs), chunk),)
    _align_count_kernel[grid](flat, sorted_ids, counts, num_pairs, capacity, CHUNK=chunk)
    e_pow2 = next_pow2(max(num_experts, 2))
    _align_offsets_kernel[(1,)](counts, counts[1], expert_ids, num_post_padded, num_experts, num_tiles,
                                BLOCK_M=block_m, E_POW2=e_pow2, TILES=max(1, min(128, 16384 // e_pow2)))
    _align_scatter_kernel[(triton.cdiv(num_pairs, chunk),)](flat, sorted_ids, counts[1], num_pairs, CHUNK=chunk)
    return sorted_ids, expert_ids, num_post_padded


@triton.jit(do_not_specialize=["num_pairs", "capacity"])
def _align_count_kernel(ids_ptr, sorted_ptr, counts_ptr, num_pairs, capacity, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(sorted_ptr + offs, tl.full((CHUNK,), 0, tl.int32) + num_pairs, mask=offs < capacity)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    ok = ok & (expert >= 0)  # -1: an expert held elsewhere
    tl.atomic_add(counts_ptr + expert, tl.full((CHUNK,), 1, tl.int32), mask=ok, sem="relaxed")


@triton.jit(do_not_specialize=["num_tiles"])
def _align_offsets_kernel(counts_ptr, cursor_ptr, experts_ptr, ntpp_ptr, num_experts, num_tiles,
                          BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, TILES: tl.constexpr):
    e = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + e, ends - padded, mask=e < num_experts)
    tl.store(ntpp_ptr, tl.sum(padded, 0))
    for t0 in range(0, num_tiles, TILES):
        t = t0 + tl.arange(0, TILES)
        # a tile's expert: how many runs end at or before its first row (experts past E end at the
        # total, so tiles past the used length count them all and get -1)
        expert = tl.sum((ends[None, :] <= (t * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(experts_ptr + t, tl.where(expert < num_experts, expert, -1), mask=t < num_tiles)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(ids_ptr, sorted_ptr, cursor_ptr, num_pairs, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    ok = ok & (expert >= 0)
    slot = tl.atomic_add(cursor_ptr + expert, tl.full((CHUNK,), 1, tl.int32), mask=ok, sem="relaxed")
    tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=ok)


@dataclass(frozen=True)
class Routing:
    """Which pairs each GEMM program multiplies by which expert (the output of ``route``)."""

    num_pairs: int  # M * K
    expert_ids: torch.Tensor  # sorted: expert per tile; pairs: topk_ids flattened (expert per pair)
    sorted_token_ids: torch.Tensor | None = None  # sorted path only (see moe_align_block_size)
    num_tokens_post_padded: torch.Tensor | None = None


def route(topk_ids: torch.Tensor, num_experts: int, config: MoEConfig) -> Routing:
    """The routing for ``config``'s path: sorted into tiles, or the pairs as they are."""
    if not config.sorted:
        return Routing(topk_ids.numel(), topk_ids.reshape(-1))
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, config.BLOCK_M, num_experts)
    return Routing(topk_ids.numel(), expert_ids, sorted_ids, num_post_padded)


# -- kernel ----------------------------------------------------------------------------------------


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), tile rows in groups of GROUP_M (column-major inside)."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows_here, (pid % per_group) // rows_here


@triton.jit
def _load_k(ptrs, mask, k_ok, EVEN_K: tl.constexpr):
    """A tile whose other dims are masked by ``mask``; the reduction dim by ``k_ok`` unless EVEN_K."""
    if EVEN_K:
        t = tl.load(ptrs, mask=mask, other=0.0)
    else:
        t = tl.load(ptrs, mask=mask & k_ok, other=0.0)
    return t



@triton.jit
def _int4_step(acc, a, w_ptrs, s_ptrs, z_ptrs, n_ok, w_ok, e23, e19, e15, e11, e7, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SORTED: tl.constexpr, EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
               IEEE: tl.constexpr, PAIRS: tl.constexpr):
    """One k-step over int4 weights: the [BN, BK/8] words at ``w_ptrs`` (``w_ok``: words inside K),
    dequantized to the exact q - z (``int4_gemm``'s tiles; BLOCK_K lies inside one group, whose scale
    and zero rows are at ``s_ptrs`` / ``z_ptrs``), their product with ``a`` [BM, BK] times the group's
    scale added to ``acc`` (W itself is never rounded)."""
    s = tl.load(s_ptrs, mask=n_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptrs, mask=n_ok, other=0).to(tl.int32)
    words = _load_k(w_ptrs, n_ok[:, None], w_ok[None, :], EVEN_K)
    if PAIRS:
        b = dequant_tile_pairs(words, z[:, None], s[:, None], BLOCK_N, BLOCK_K, False, DOT_DTYPE)
    else:
        b = dequant_tile(words, z.to(tl.float32)[:, None], s[:, None], e23, e19, e15, e11, e7, BLOCK_N, BLOCK_K,
                          False, DOT_DTYPE)
    if SORTED:
        if IEEE:
            part = tl.dot(a.to(DOT_DTYPE), tl.trans(b), input_precision="ieee")
        else:
            part = tl.dot(a.to(DOT_DTYPE), tl.trans(b))
    else:  # the [1, BK] row against the [BN, BK] tile
        part = tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)[None, :]
    return acc + part * s[None, :]


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])  # batch sizes only: one compile for all
def _moe_gemm_kernel(
    a_ptr,  # [T, Kd]: pair p reads row p // PAIRS_PER_ROW
    w_ptr,  # [E, N, Kd], last dim contiguous
    c_ptr,  # [P, N]: pair p's output row
    rw_ptr,  # float32 [P]: routed weights (MUL_ROUTED_WEIGHT)
    rows_ptr,  # int32 [C]: sorted pair ids (SORTED)
    experts_ptr,  # SORTED: int32 [C / BLOCK_M] expert per tile; else int32/int64 [P] expert per pair
    ntpp_ptr,  # int32 [1]: used sorted rows (SORTED)
    as_ptr,  # float32 activation scales (QUANT): [T, Kd / BLOCK_K] per k-group (1), [T] per row (2)
    ws_ptr,  # float32 weight scales (QUANT): [E, N / SCALE_BN, Kd / BLOCK_K] per block (1), [E, N] (2);
             # QUANT 3: [E, G, N] group scales (float), beside uint8 zeros z_ptr of the same shape and strides
    z_ptr,
    N,
    Kd,
    num_pairs,
    num_pid_m,  # tile rows in the grid (SORTED: C / BLOCK_M; else P)
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    stride_asm,  # activation scales: row stride (k-groups contiguous)
    stride_wse,
    stride_wsn,
    stride_wsk,
    group_size,  # QUANT 3: inputs per scale group (Kd when one group spans them)
    e23,  # QUANT 3: float bits of 2^23, 2^19, .., 2^7 (int4_gemm's dequant_tile)
    e19,
    e15,
    e11,
    e7,
    PAIRS_PER_ROW: tl.constexpr,  # K for x (GEMM 1), 1 for the activated intermediate (GEMM 2)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SORTED: tl.constexpr,  # False: one pair per program (BLOCK_M 1), an FMA GEMV
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,  # Kd % BLOCK_K == 0
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: full-precision tl.dot (not TF32)
    QUANT: tl.constexpr = 0,  # e4m3 a and w: 0 none, 1 block scales per k-step, 2 row x column scales after;
                              # 3: int4 w (packed [E, N, Kd/8]), its group's scale after each k-step
    SCALE_BN: tl.constexpr = 128,  # QUANT 1: output features per weight-scale block
    INT4_PAIRS: tl.constexpr = False,  # QUANT 3: dequantize two 16-bit values per instruction (GPU)
    DENSE: tl.constexpr = False,  # one expert, rows in order: a plain GEMM (``dense_gemm``), no routing read
):
    pid_m, pid_n = _swizzle(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SORTED and not DENSE:
        if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
            return  # a tile past the routing's end (the grid is sized for the worst case)
        rows = tl.load(rows_ptr + offs_m)
    else:
        rows = offs_m
    row_ok = rows < num_pairs  # sentinel rows: zeros in, nothing out
    if DENSE:
        expert = 0
    else:
        expert = tl.load(experts_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return  # pairs path: a pair of an expert held elsewhere (expert_map -1); its row stays 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // PAIRS_PER_ROW).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    if QUANT == 3:  # int4: the [BN, BK/8] words of a k-step, each output feature's contiguous along K
        WORDS: tl.constexpr = BLOCK_K // 8
        offs_w = tl.arange(0, WORDS)
        w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_w[None, :]
        s_ptrs = ws_ptr + expert * stride_wse + offs_n.to(tl.int64) * stride_wsn
        z_ptrs = z_ptr + expert * stride_wse + offs_n.to(tl.int64) * stride_wsn
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    if QUANT == 1:  # this tile's activation scales (k-group 0) and weight-scale blocks (column n // SCALE_BN)
        as_ptrs = as_ptr + (rows // PAIRS_PER_ROW).to(tl.int64) * stride_asm
        ws_ptrs = ws_ptr + expert * stride_wse + (offs_n // SCALE_BN).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, Kd, BLOCK_K):
        k_ok = offs_k < Kd - k0
        a = _load_k(a_ptrs, row_ok[:, None], k_ok[None, :], EVEN_K)
        if QUANT == 3:
            acc = _int4_step(acc, a, w_ptrs, s_ptrs + (k0 // group_size) * stride_wsk,
                             z_ptrs + (k0 // group_size) * stride_wsk, n_ok, offs_w * 8 < Kd - k0,
                             e23, e19, e15, e11, e7, BLOCK_N, BLOCK_K, SORTED, EVEN_K, DOT_DTYPE, IEEE, INT4_PAIRS)
            w_ptrs += WORDS
        else:
            b = _load_k(w_ptrs, n_ok[None, :], k_ok[:, None], EVEN_K)
            if QUANT == 1:  # one k-step is one scale group: its e4m3 product, then both scales
                if SORTED:
                    part = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))
                else:
                    part = tl.sum(tl.trans(a.to(tl.float32)) * b.to(tl.float32), axis=0)[None, :]
                a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)
                b_s = tl.load(ws_ptrs, mask=n_ok, other=0.0)
                acc += part * a_s[:, None] * b_s[None, :]
                as_ptrs += 1
                ws_ptrs += stride_wsk
            elif SORTED:
                if IEEE:
                    acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)
            else:  # [1, BK] row: a column times the [BK, BN] tile, summed over k
                acc += tl.sum(tl.trans(a.to(tl.float32)) * b.to(tl.float32), axis=0)[None, :]
            w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if QUANT == 2:  # per-row activation scale x per-column weight scale, once after the k loop
        a_s = tl.load(as_ptr + (rows // PAIRS_PER_ROW).to(tl.int64) * stride_asm, mask=row_ok, other=0.0)
        b_s = tl.load(ws_ptr + expert * stride_wse + offs_n.to(tl.int64) * stride_wsn, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(rw_ptr + rows, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# -- launchers -------------------------------------------------------------------------------------


def moe_gemm(
    a: torch.Tensor,  # [T, Kd]
    w: torch.Tensor,  # [E, N, Kd]
    out: torch.Tensor,  # [P, N]
    routing: Routing | None,  # None: one expert (E = 1), row t = a[t] @ w[0].T (``dense_gemm``)
    config: MoEConfig,
    *,
    pairs_per_row: int = 1,
    routed_weights: torch.Tensor | None = None,  # float32 [P], contiguous
    a_scale: torch.Tensor | None = None,  # fp8: float32 [T, ceil(Kd / bk)] (block_shape), else [T, 1]
    w_scale: torch.Tensor | None = None,  # fp8: float32 [E, ceil(N / bn), ceil(Kd / bk)] (block_shape), else [E, N]
    block_shape: tuple[int, int] | None = None,  # fp8: (bn, bk) weight-scale blocks; config.BLOCK_K == bk
    w_zeros: torch.Tensor | None = None,  # int4: uint8 [E, G, N] beside w_scale [E, G, N]
    group_size: int | None = None,  # int4: inputs per group (-1: one group); config.BLOCK_K divides it
    fp8_exact: bool = False,  # fp8: fp16 MMAs instead of e4m3 ones (``fp8_dot_dtype``)
) -> torch.Tensor:
    """One grouped GEMM into ``out``: row p = a[p // pairs_per_row] @ w[expert(p)].T, times
    ``routed_weights[p]`` when given. Rows of pairs the routing leaves out are not written.
    e4m3 ``a`` and ``w`` (the fp8 path) come with their scales: per (row, k-group) and per weight
    block with ``block_shape``, else per row and per output feature (module docstring); int4 ``w``
    (int32 [E, N, Kd/8]) with its group scales and zeros.
    A building block of ``fused_moe``, which checks the arguments; here only ``out``'s shape."""
    num_experts, n, kd = w.shape
    dense = routing is None
    if dense:
        if num_experts != 1 or not config.sorted:
            raise ValueError(f"a dense GEMM takes one expert and a tiled config, got {num_experts} experts, "
                             f"BLOCK_M {config.BLOCK_M}")
        routing = Routing(a.shape[0], out)  # (expert ids unused)
    check_tensor("out", out, shape=(routing.num_pairs, n))
    if routing.num_pairs == 0 or n == 0:
        return out
    quant, scale_bn, groups = 0, 128, kd
    if w.dtype == torch.int32:
        quant, kd = 3, kd * 8
        groups = kd if group_size == -1 else int(group_size)
        if w_scale is None or w_zeros is None or w_zeros.stride() != w_scale.stride():
            raise ValueError("int4 weights need w_scale and w_zeros of one shape and strides")
        if group_size != -1 and groups % config.BLOCK_K:
            raise ValueError(f"int4 weights need BLOCK_K to divide the group size {groups}, got {config.BLOCK_K}")
    elif w.dtype == FP8_DTYPE:
        if a_scale is None or w_scale is None or a.dtype != FP8_DTYPE:
            raise ValueError("e4m3 weights need e4m3 activations and both scales (a_scale, w_scale)")
        if block_shape is not None:
            quant, scale_bn = 1, block_shape[0]
            if config.BLOCK_K != block_shape[1]:
                raise ValueError(f"block-wise fp8 needs BLOCK_K == the scale block's {block_shape[1]} inputs, "
                                 f"got {config.BLOCK_K}")
        else:
            quant = 2
    strides_s = (0, 0, 0, 0)
    if quant == 3:  # [E, G, N]: the kernel's "n" stride is the feature's, its "k" stride the group's
        strides_s = (0, w_scale.stride(0), w_scale.stride(2), w_scale.stride(1))
    elif quant:
        strides_s = (a_scale.stride(0), w_scale.stride(0), w_scale.stride(1),
                     w_scale.stride(2) if w_scale.dim() == 3 else 0)
    if dense:
        num_pid_m = triton.cdiv(routing.num_pairs, config.BLOCK_M)
        rows = ntpp = out  # unused
    elif config.sorted:
        num_pid_m = routing.expert_ids.numel()
        rows, ntpp = routing.sorted_token_ids, routing.num_tokens_post_padded
    else:
        num_pid_m = routing.num_pairs
        rows = ntpp = routing.expert_ids  # unused
    rw = routed_weights if routed_weights is not None else out
    grid = (num_pid_m * triton.cdiv(n, config.BLOCK_N),)
    _moe_gemm_kernel[grid](
        a, w, out, rw, rows, routing.expert_ids, ntpp, a_scale if quant in (1, 2) else out,
        w_scale if quant else out, w_zeros if quant == 3 else out,
        n, kd, routing.num_pairs, num_pid_m,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), *strides_s, groups, *EXPONENT_BITS,
        PAIRS_PER_ROW=pairs_per_row, BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        GROUP_M=config.GROUP_M, SORTED=config.sorted, MUL_ROUTED_WEIGHT=routed_weights is not None,
        EVEN_K=kd % config.BLOCK_K == 0,
        DOT_DTYPE=fp8_dot_dtype(a.device, fp8_exact) if quant in (1, 2) else dot_dtype(a.dtype),
        IEEE=a.dtype == torch.float32, QUANT=quant, SCALE_BN=scale_bn,
        INT4_PAIRS=quant == 3 and a.is_cuda and not interpreting() and a.dtype in (torch.bfloat16, torch.float16),
        DENSE=dense, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _check_ids_in_range(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None = None) -> None:
    """ValueError unless every id lies in [0, num_experts) (with ``expert_map``: in [0, its length), its
    values in [-1, num_experts)): host syncs (not while capturing)."""
    if topk_ids.numel() == 0 or (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bound, what = (num_experts, "E = w13.shape[0]") if expert_map is None else (len(expert_map), "expert_map's length")
    lo, hi = (int(v) for v in torch.aminmax(topk_ids))
    if lo < 0 or hi >= bound:
        raise ValueError(f"topk_ids must lie in [0, {bound}) ({what}), got ids from {lo} to {hi}")
    if expert_map is not None:
        check_expert_map(expert_map, num_experts)


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, check_ids: bool = True, expert_map: torch.Tensor | None = None,
                   w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                   block_shape: tuple[int, int] | None = None, w13_zeros: torch.Tensor | None = None,
                   w2_zeros: torch.Tensor | None = None, group_size: int | None = None) -> None:
    """ValueError/TypeError naming the argument unless the tensors fit the contract (module docstring)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = check_device(x, "x")
    m, h = x.shape
    int4 = w13.dtype == torch.int32
    w_dtypes = (FP8_DTYPE,) if w13.dtype == FP8_DTYPE else (torch.int32,) if int4 else (x.dtype,)
    check_tensor("w13", w13, ndim=3, dtypes=w_dtypes, device=device)
    num_experts, two_i, _ = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 must stack gate and up projections ([E, 2I, H]), got an odd dim 1: {tuple(w13.shape)}")
    pack = 8 if int4 else 1  # int4: eight inputs per int32 word
    if h % pack:
        raise ValueError(f"int4 experts need a hidden size that is a multiple of 8, got {h}")
    check_tensor("w13", w13, shape=(num_experts, two_i, h // pack), contiguous=int4)
    check_tensor("w2", w2, shape=(num_experts, h, two_i // 2 // pack), dtypes=w_dtypes, device=device,
                 contiguous=int4)
    if int4:
        check_int4_moe_args(w13, w2, w13_scale, w2_scale, w13_zeros, w2_zeros, group_size)
        if group_size != -1 and (group_size < 16 or group_size & (group_size - 1)):
            raise ValueError(f"group_size {group_size}: the kernel's reduction step lies inside one group, which "
                             "must be -1 or a power of two >= 16 (fused_moe_ref takes any)")
        for name, t in (("w13_zeros", w13_zeros), ("w2_zeros", w2_zeros)):
            check_tensor(name, t, device=device, contiguous=True)
    else:
        if w13_zeros is not None or w2_zeros is not None or group_size is not None:
            raise ValueError(f"w13_zeros / w2_zeros / group_size are for int4 (int32) experts; w13 is {w13.dtype}")
        if block_shape is not None and (block_shape[1] < 16 or block_shape[1] & (block_shape[1] - 1)):
            raise ValueError(f"block_shape {tuple(block_shape)}: the kernel's reduction step is the scale block's "
                             "inputs, which must be a power of two >= 16 (fused_moe_ref takes any)")
        check_fp8_moe_scales(w13, w2, w13_scale, w2_scale, block_shape)
    if w13_scale is not None:
        check_tensor("w13_scale", w13_scale, device=device, contiguous=True)
        check_tensor("w2_scale", w2_scale, device=device, contiguous=True)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES, device=device, contiguous=True)
    if topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids must have one row per token ({m}), got shape {tuple(topk_ids.shape)}")
    check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape), dtypes=(torch.float32,),
                 device=device, contiguous=True)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=_ID_DTYPES, device=device, contiguous=True)
    if check_ids:
        _check_ids_in_range(topk_ids, num_experts, expert_map)


def fused_moe(
    x: torch.Tensor,  # [M, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # float32 [M, K]
    topk_ids: torch.Tensor,  # int32/int64 [M, K]
    *,
    config: MoEConfig | None = None,
    apply_router_weight_on_input: bool = False,
    check: bool = True,
    expert_map: torch.Tensor | None = None,  # [E_global] -> local expert or -1 (module docstring)
    w13_scale: torch.Tensor | None = None,  # e4m3 experts: float32 scales (module docstring)
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,  # (bn, bk): block-wise scales, per-token-group activations
    intermediate_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,  # per-token scales under TP
    w13_zeros: torch.Tensor | None = None,  # int4 experts: uint8 zero points beside w13_scale / w2_scale
    w2_zeros: torch.Tensor | None = None,
    group_size: int | None = None,  # int4 experts: inputs per scale group (-1: one group)
) -> torch.Tensor:  # [M, H], x.dtype
    """The routed experts' SwiGLU MLPs summed over each token's top-k slots (module docstring).

    ``config=None`` uses ``pick_config`` with this device's tuned table where one exists.
    ``check=False`` skips the argument checks, among them the id range check's host sync (the layer checks its weights at load;
    out-of-range ids are then undefined behaviour).
    """
    if check:
        check_moe_args(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, w13_scale=w13_scale,
                       w2_scale=w2_scale, block_shape=block_shape, w13_zeros=w13_zeros, w2_zeros=w2_zeros,
                       group_size=group_size)
    m, h = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    pairs = m * top_k
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out.zero_()
    fp8, int4 = w13.dtype == FP8_DTYPE, w13.dtype == torch.int32
    block = (int(block_shape[0]), int(block_shape[1])) if fp8 and block_shape is not None else None
    config = config or pick_config(m, num_experts, two_i // 2, h, x.dtype, top_k=top_k, fp8=fp8, block_shape=block,
                                   int4_group=group_size if int4 else None,
                                   table=table_for(x, num_experts, two_i // 2, fp8, block, int4))
    if expert_map is not None:
        topk_ids = expert_map.index_select(0, topk_ids.reshape(-1)).view(topk_ids.shape)
    routing = route(topk_ids, num_experts, config)
    weights = topk_weights.reshape(-1)
    inter1 = torch.empty((pairs, two_i), dtype=x.dtype, device=x.device)
    scales1 = scales2 = {}
    if int4:
        scales1 = dict(w_scale=w13_scale, w_zeros=w13_zeros, group_size=group_size)
        scales2 = dict(w_scale=w2_scale, w_zeros=w2_zeros, group_size=group_size)
    if fp8:  # e4m3 activations: x per token (per group of bk inputs with block scales), then the intermediate
        xq, xs = quantize_moe_activations(x, block)
        exact = x.dtype == torch.float32  # fp32 activations: exact fp16 MMAs over the e4m3 values
        x, scales1 = xq, dict(a_scale=xs, w_scale=w13_scale, block_shape=block, fp8_exact=exact)
    moe_gemm(x, w13, inter1, routing, config, pairs_per_row=top_k,
             routed_weights=weights if apply_router_weight_on_input else None, **scales1)
    inter = silu_and_mul(inter1)
    if fp8:
        inter, i_scale = quantize_moe_activations(inter, block, intermediate_amax)
        scales2 = dict(a_scale=i_scale, w_scale=w2_scale, block_shape=block, fp8_exact=exact)
    inter2 = out if top_k == 1 else torch.empty((pairs, h), dtype=out.dtype, device=out.device)
    if expert_map is not None:
        inter2.zero_()  # rows of pairs held elsewhere are not written
    moe_gemm(inter, w2, inter2, routing, config, routed_weights=None if apply_router_weight_on_input else weights,
             **scales2)
    if top_k > 1:
        torch.sum(inter2.view(m, top_k, h), dim=1, out=out)
    return out


def quantize_moe_activations(
    x: torch.Tensor,  # [T, K] bf16/fp16/fp32
    block_shape: tuple[int, int] | None,
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [T, K], float32 [T, ceil(K / bk)] or [T, 1])
    """The e4m3 activations of a GEMM over fp8 experts (``fused_moe_ref.quantize_moe_activations_ref``):
    per token and per group of bk inputs (``block_shape``), else per token; ``amax_reduce`` maps each
    row's |max| [T, 1] to the whole row's when the row is split over ranks (per token only)."""
    if block_shape is not None:
        return quantize_fp8_groups(x, block_shape[1])
    if amax_reduce is None:
        return quantize_fp8(x)
    return quantize_fp8(x, fp8_scale_from_amax(amax_reduce(x.abs().amax(-1, keepdim=True).float())).contiguous())
