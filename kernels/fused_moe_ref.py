"""Pure-torch reference of the fused mixture-of-experts op (the CPU path; the Triton kernel in
``fused_moe.py`` implements the same contract).

Contract::

    fused_moe_ref(x, w13, w2, topk_weights, topk_ids, *, apply_router_weight_on_input=False) -> out

    x             [M, H]      activations (any float dtype)
    w13           [E, 2I, H]  per expert: rows [0, I) the gate projection (checkpoint ``gate_proj`` /
                              ``w1``), rows [I, 2I) the up projection (``up_proj`` / ``w3``)
    w2            [E, H, I]   per expert the down projection (``down_proj`` / ``w2``)
    topk_weights  [M, K]      float32 routing weights (already normalized / scaled by the router)
    topk_ids      [M, K]      integer expert ids in [0, E)
    out           [M, H]      in x.dtype

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
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
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e):
        raise ValueError(f"topk_ids must lie in [0, {e}), got [{int(topk_ids.min())}, {int(topk_ids.max())}]")


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
) -> torch.Tensor:
    """The routed experts' weighted sum per token (see the module docstring for the contract)."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    m, k = topk_ids.shape
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(m, x.shape[1], dtype=acc_dtype, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).to(acc_dtype)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        tokens = rows // k
        weights = flat_weights[rows].unsqueeze(-1)
        xe = x.index_select(0, tokens)
        if apply_router_weight_on_input:
            y = _expert_mlp((xe.to(acc_dtype) * weights).to(x.dtype), w13[expert], w2[expert], acc_dtype)
        else:
            y = _expert_mlp(xe, w13[expert], w2[expert], acc_dtype) * weights
        out.index_add_(0, tokens, y)
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
