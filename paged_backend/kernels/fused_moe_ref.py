"""Pure-torch reference of the fused mixture-of-experts op (the CPU path; the Triton kernel in
``fused_moe.py`` implements the same contract).

Contract::

    fused_moe_ref(x, w13, w2, topk_weights, topk_ids, *, apply_router_weight_on_input=False,
                  expert_map=None, w13_scale=None, w2_scale=None, block_shape=None,
                  intermediate_amax=None, w13_zeros=None, w2_zeros=None, group_size=None) -> out

    x             [M, H]      activations (any float dtype)
    w13           [E, 2I, H]  per expert: rows [0, I) the gate projection (checkpoint ``gate_proj`` /
                              ``w1``), rows [I, 2I) the up projection (``up_proj`` / ``w3``)
    w2            [E, H, I]   per expert the down projection (``down_proj`` / ``w2``)
    topk_weights  [M, K]      float32 routing weights (already normalized / scaled by the router)
    topk_ids      [M, K]      integer expert ids in [0, E) (with ``expert_map``: in [0, E_global))
    expert_map    [E_global]  optional (expert parallelism): integer, global expert id -> the index of
                              that expert in w13 / w2, or -1 for an expert this rank does not hold
    out           [M, H]      in x.dtype

    with ``expert_map``, e = expert_map[topk_ids[m, k]] and pairs with e = -1 add nothing (another
    rank adds them; the ranks' outputs sum to the whole layer's)

    for each (m, k), e = topk_ids[m, k]:
        h_k = silu(x[m] @ w13[e, :I].T) * (x[m] @ w13[e, I:].T)        [I]
        y_k = h_k @ w2[e].T                                             [H]
    out[m] = sum_k topk_weights[m, k] * y_k

With ``apply_router_weight_on_input`` the weight multiplies the expert's input instead
(``y_k = expert(topk_weights[m, k] * x[m])``, ``out[m] = sum_k y_k``), as Llama-4-style top-1 routers do.

Numerics: the two GEMMs run in x.dtype; silu-and-mul and the weighted sum run in float32
(float64 for float64 inputs); the intermediate is rounded to x.dtype before the second GEMM (as
a kernel that stores it does) and the sum is cast to x.dtype once at the end.
Only experts that received tokens are computed: tokens are grouped by expert and scattered
back with ``index_add_``.

FP8 experts (w13 and w2 float8_e4m3fn, W8A8 with dynamic activation scales), two schemes::

    block_shape (bn, bk)   w13_scale [E, ceil(2I/bn), ceil(H/bk)], w2_scale [E, ceil(H/bn), ceil(I/bk)]
                           float32, one per bn x bk weight block (checkpoint ``weight_scale_inv``);
                           activations quantized per token and per group of bk inputs
    block_shape None       w13_scale [E, 2I], w2_scale [E, H] float32, one per output feature
                           (compressed-tensors ``strategy: channel``); activations per token

    W[e] = w[e] * scale (expanded over its block / row)      a = q_a * s_a (``quantize_moe_activations_ref``)
    GEMM 1 on x's e4m3 activations, GEMM 2 on the intermediate's (rounded to x.dtype first, then
    quantized), each accumulated in float32 from the dequantized values (what a kernel summing
    ``dot(q_a, q_w) * s_a * s_w`` over the k-groups computes); the routed weight (on the input)
    scales GEMM 1's float32 result. ``intermediate_amax`` (per token, the intermediate split over
    tensor-parallel ranks): maps each row's |max| [P, 1] on this rank to the whole row's, so every
    rank quantizes as the unsplit layer would.

int4 experts (W4A16: GPTQ / AWQ checkpoints repacked at load by ``quantization/int4_moe.py``), each
expert in the int4 kernel layout of ``paged_backend/kernels/int4_gemm_ref.py`` (output features as rows, eight
inputs per int32 word)::

    w13        int32 [E, 2I, H/8]       w2        int32 [E, H, I/8]
    w13_scale  [E, G13, 2I] float       w2_scale  [E, G2, H]          G13 = H / group_size, G2 = I / group_size
    w13_zeros  uint8 [E, G13, 2I]       w2_zeros  uint8 [E, G2, H]    (group_size -1: one group, G = 1)

    W[e] = dequantize_int4_ref(w[e], scale[e], zeros[e], group_size, x.dtype).T   (fp32 math, rounded once)

and then the float contract above, only the experts that received tokens dequantized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from paged_backend.kernels.fp8_quant_ref import (
    FP8_DTYPE,
    dequantize_fp8_groups_ref,
    expand_block_scales,
    fp8_scale_from_amax,
    quantize_fp8_groups_ref,
    quantize_fp8_ref,
)
from paged_backend.kernels.int4_gemm_ref import dequantize_int4_ref


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [M, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    m, h = x.shape
    e, two_i, h13 = w13.shape
    if two_i % 2 or h13 != h or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match x {tuple(x.shape)} "
                         "(need w13 [E, 2I, H], w2 [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != m:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
                         f"must both be [M={m}, K]")
    if topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if expert_map is not None:
        check_expert_map(expert_map, e)
    bound = e if expert_map is None else expert_map.shape[0]
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= bound):
        raise ValueError(f"topk_ids must lie in [0, {bound}), got [{int(topk_ids.min())}, {int(topk_ids.max())}]")


def check_expert_map(expert_map: torch.Tensor, num_local: int) -> None:
    """ValueError unless ``expert_map`` is a 1-d integer tensor of values in [-1, num_local) (one host sync)."""
    if expert_map.dim() != 1 or expert_map.dtype.is_floating_point:
        raise ValueError(f"expert_map must be a 1-d integer tensor, got {expert_map.dtype} {tuple(expert_map.shape)}")
    if expert_map.numel() and (int(expert_map.min()) < -1 or int(expert_map.max()) >= num_local):
        raise ValueError(f"expert_map values must lie in [-1, {num_local}) (w13.shape[0] = {num_local}), got "
                         f"[{int(expert_map.min())}, {int(expert_map.max())}]")


def _expert_mlp(xe: torch.Tensor, w13_e: torch.Tensor, w2_e: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """One expert's SwiGLU MLP on its rows ``xe`` [n, H] -> [n, H] in ``acc``."""
    gate, up = F.linear(xe, w13_e).to(acc).chunk(2, dim=-1)
    h = (F.silu(gate) * up).to(xe.dtype)
    return F.linear(h, w2_e).to(acc)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    intermediate_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum per token (see the module docstring for the contract)."""
    int4 = w13.dtype == torch.int32
    if int4:
        check_int4_moe_args(w13, w2, w13_scale, w2_scale, w13_zeros, w2_zeros, group_size)
        e, two_i, _ = w13.shape
        _check_shapes(x, torch.empty(e, two_i, w13.shape[2] * 8, device="meta"),
                      torch.empty(e, w2.shape[1], w2.shape[2] * 8, device="meta"), topk_weights, topk_ids, expert_map)

        def weights_of(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (dequantize_int4_ref(w13[expert], w13_scale[expert], w13_zeros[expert], group_size, x.dtype).t(),
                    dequantize_int4_ref(w2[expert], w2_scale[expert], w2_zeros[expert], group_size, x.dtype).t())
    else:
        _check_shapes(x, w13, w2, topk_weights, topk_ids, expert_map)
        check_fp8_moe_scales(w13, w2, w13_scale, w2_scale, block_shape)
        if w13_zeros is not None or w2_zeros is not None or group_size is not None:
            raise ValueError(f"w13_zeros / w2_zeros / group_size are for int4 (int32) experts; w13 is {w13.dtype}")

        def weights_of(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
            return w13[expert], w2[expert]
    if w13.dtype == FP8_DTYPE:
        return _fused_moe_fp8_ref(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input, expert_map,
                                  w13_scale, w2_scale, block_shape, intermediate_amax)
    m, k = topk_ids.shape
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(m, x.shape[1], dtype=acc_dtype, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    if expert_map is not None:  # local expert ids; -1: pairs of experts held elsewhere
        flat_ids = expert_map.to(flat_ids.device).long()[flat_ids]
    flat_weights = topk_weights.reshape(-1).to(acc_dtype)
    order = torch.argsort(flat_ids, stable=True)  # any -1 pairs first: skipped
    skipped, *counts = torch.bincount(flat_ids + 1, minlength=w13.shape[0] + 1).tolist()
    start = skipped
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        tokens = rows // k
        weights = flat_weights[rows].unsqueeze(-1)
        xe = x.index_select(0, tokens)
        w13_e, w2_e = weights_of(expert)
        if apply_router_weight_on_input:
            y = _expert_mlp((xe.to(acc_dtype) * weights).to(x.dtype), w13_e, w2_e, acc_dtype)
        else:
            y = _expert_mlp(xe, w13_e, w2_e, acc_dtype) * weights
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


# -- int4 experts -----------------------------------------------------------------------------------


def check_int4_moe_args(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                        w2_scale: torch.Tensor | None, w13_zeros: torch.Tensor | None, w2_zeros: torch.Tensor | None,
                        group_size: int | None) -> None:
    """ValueError/TypeError naming the argument unless int4 experts (int32 ``w13``) come with the scales,
    zeros and group size of the contract (module docstring)."""
    if w2.dtype != torch.int32:
        raise TypeError(f"w2 must be int32 (packed int4) like w13, got {w2.dtype}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"int4 experts must be w13 [E, 2I, H/8], w2 [E, H, I/8]; got {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    if any(t is None for t in (w13_scale, w2_scale, w13_zeros, w2_zeros, group_size)):
        raise ValueError("int4 experts need w13_scale, w2_scale, w13_zeros, w2_zeros and group_size")
    e, two_i, h8 = w13.shape
    h, i = h8 * 8, w2.shape[2] * 8
    if two_i % 2 or tuple(w2.shape[:2]) != (e, h) or two_i // 2 != i:
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not stack as int4 experts "
                         "(need w13 [E, 2I, H/8], w2 [E, H, I/8])")
    if group_size != -1 and (group_size < 8 or h % group_size or i % group_size):
        raise ValueError(f"group_size {group_size} must be -1 or divide both H={h} and I={i}")
    groups = (1, 1) if group_size == -1 else (h // group_size, i // group_size)
    for name, t, want in (("w13_scale", w13_scale, (e, groups[0], two_i)), ("w2_scale", w2_scale, (e, groups[1], h)),
                          ("w13_zeros", w13_zeros, (e, groups[0], two_i)), ("w2_zeros", w2_zeros, (e, groups[1], h))):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} (per expert, group and output feature), "
                             f"got {tuple(t.shape)}")
        if name.endswith("zeros") and t.dtype != torch.uint8:
            raise TypeError(f"{name} must be uint8, got {t.dtype}")
        if name.endswith("scale") and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")


# -- fp8 experts ------------------------------------------------------------------------------------


def check_fp8_moe_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                         w2_scale: torch.Tensor | None, block_shape: tuple[int, int] | None) -> None:
    """ValueError/TypeError naming the argument unless e4m3 experts come with scales of the contract's
    shapes (module docstring), and unquantized experts with none."""
    if w13.dtype != FP8_DTYPE:
        if w13_scale is not None or w2_scale is not None or block_shape is not None:
            raise ValueError(f"w13_scale / w2_scale / block_shape are for e4m3 experts; w13 is {w13.dtype}")
        return
    if w2.dtype != FP8_DTYPE:
        raise TypeError(f"w2 must be {FP8_DTYPE} like w13, got {w2.dtype}")
    if w13_scale is None or w2_scale is None:
        raise ValueError("e4m3 experts need w13_scale and w2_scale")
    e, two_i, h = w13.shape
    i = w2.shape[2]
    if block_shape is not None:
        if len(block_shape) != 2 or min(block_shape) < 1:
            raise ValueError(f"block_shape must be two positive ints (bn, bk), got {block_shape!r}")
        bn, bk = block_shape
        want13, want2 = (e, -(-two_i // bn), -(-h // bk)), (e, -(-h // bn), -(-i // bk))
    else:
        want13, want2 = (e, two_i), (e, h)
    for name, scale, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {scale.dtype}")
        if tuple(scale.shape) != want:
            raise ValueError(f"{name} must have shape {want} ({'per block' if block_shape else 'per output feature'}"
                             f"), got {tuple(scale.shape)}")


def quantize_moe_activations_ref(
    x: torch.Tensor,  # [T, K]
    block_shape: tuple[int, int] | None,
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [T, K], float32 [T, ceil(K / bk)] or [T, 1])
    """A GEMM's e4m3 input over fp8 experts: per token and per group of bk inputs (``block_shape``),
    else per token (``amax_reduce``: each row's |max| [T, 1] -> the whole split row's)."""
    if block_shape is not None:
        return quantize_fp8_groups_ref(x, block_shape[1])
    amax = x.abs().amax(-1, keepdim=True).float()
    return quantize_fp8_ref(x, fp8_scale_from_amax(amax_reduce(amax) if amax_reduce is not None else amax))


def dequantize_moe_activations_ref(q: torch.Tensor, scale: torch.Tensor,
                                   block_shape: tuple[int, int] | None) -> torch.Tensor:
    """float32 values of ``quantize_moe_activations_ref``'s output."""
    return dequantize_fp8_groups_ref(q, scale, block_shape[1]) if block_shape is not None else q.float() * scale


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K] of one expert's e4m3 ``w`` [N, K] and its scales (block [ceil(N/bn), ceil(K/bk)], or [N])."""
    if block_shape is None:
        return w.float() * scale[:, None]
    return w.float() * expand_block_scales(scale, *w.shape, *block_shape)


def _fused_moe_fp8_ref(x, w13, w2, topk_weights, topk_ids, on_input, expert_map, w13_scale, w2_scale,
                       block_shape, intermediate_amax) -> torch.Tensor:
    """``fused_moe_ref`` over e4m3 experts (module docstring): both GEMMs on every pair at once, so the
    intermediate is quantized in one call (one ``intermediate_amax`` per layer)."""
    m, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        flat_ids = expert_map.to(flat_ids.device).long()[flat_ids]
    flat_weights = topk_weights.reshape(-1).float()
    order = torch.argsort(flat_ids, stable=True)
    skipped, *counts = torch.bincount(flat_ids + 1, minlength=w13.shape[0] + 1).tolist()
    groups, start = [], skipped
    for expert, count in enumerate(counts):
        if count:
            groups.append((expert, order[start : start + count]))
            start += count
    xs = dequantize_moe_activations_ref(*quantize_moe_activations_ref(x, block_shape), block_shape)
    inter = torch.zeros(m * k, w2.shape[2], dtype=x.dtype, device=x.device)  # pairs held elsewhere: zeros
    for expert, rows in groups:
        y = F.linear(xs.index_select(0, rows // k), dequantize_expert(w13[expert], w13_scale[expert], block_shape))
        if on_input:
            y = y * flat_weights[rows].unsqueeze(-1)
        gate, up = y.to(x.dtype).float().chunk(2, dim=-1)
        inter[rows] = (F.silu(gate) * up).to(x.dtype)
    hs = dequantize_moe_activations_ref(*quantize_moe_activations_ref(inter, block_shape, intermediate_amax),
                                        block_shape)
    out = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
    for expert, rows in groups:
        y = F.linear(hs.index_select(0, rows), dequantize_expert(w2[expert], w2_scale[expert], block_shape))
        out.index_add_(0, rows // k, y if on_input else y * flat_weights[rows].unsqueeze(-1))
    return out.to(x.dtype)


# -- the expert alignment of the sorted kernel path -------------------------------------------------


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most sorted rows any routing of these shapes needs, rounded up to whole tiles."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the M*K (token, slot) pairs by expert in BLOCK_M tiles, with torch ops (the reference of
    ``fused_moe.moe_align_block_size``, whose runs hold the same pairs in another order).

    Returns int32 ``sorted_token_ids`` [C] (pair ids p = m*K + k, expert by expert in pair order,
    each expert's run padded to a multiple of ``block_m`` with the sentinel M*K), ``expert_ids``
    [C / block_m] (each tile's expert; -1 for tiles past the end) and ``num_tokens_post_padded``
    [1] (the used length of ``sorted_token_ids``). C = ``padded_capacity``: fixed by the
    shapes, so nothing is read back to the host. Ids must lie in [0, num_experts).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host-side max
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order
    sorted_experts = flat[order]
    first_pair = torch.cumsum(counts, 0) - counts  # rank of each expert's first pair in ``order``
    rank = torch.arange(num_pairs, device=device) - first_pair[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(ends, tile_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_post_padded = ends[-1:].to(torch.int32) if num_experts else torch.zeros(1, dtype=torch.int32, device=device)
    return sorted_ids, expert_ids, num_post_padded
