"""What the int4 formats share: unpacking helpers, the repack into the kernel layout (see
``paged_backend/kernels/int4_gemm_ref.py``) and the forward (Triton on CUDA, dequantize + matmul elsewhere).

Each format's ``process_weights_after_loading`` unpacks its tensors to plain
``q uint8 [K, N]``, ``zeros uint8 [G, N]``, ``scales float32 [G, N]`` and an optional
``g_idx [K]`` and calls ``Int4LinearMethod.finalize``, so AWQ, GPTQ and compressed-tensors
end in one layout and one kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paged_backend.kernels.int4_gemm_ref import compact_scales, int4_gemm_ref, pack_int4_kernel
from paged_backend.quantization.base import LinearMethod, is_row_parallel, tp_world_size

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ packs 8 output columns a word: nibble i holds column 8c + AWQ_ORDER[i]
KERNELS = ("auto", "torch", "triton")
# RMS of (q - 8) for q uniform in 0..15: sqrt(mean of v^2 for v in -8..7) = sqrt(21.5)
_INT4_RMS = 21.5**0.5


def check_int4_config(method: str, bits: object, group_size: object) -> int:
    """Validates bits/group_size of an int4 config; returns the group size."""
    if bits != 4:
        raise ValueError(f"{method}: bits={bits} is not supported (only 4-bit weights)")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"{method}: group_size={group_size} is not supported (one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))})"
        )
    return int(group_size)


def unpack_int32_cols(packed: torch.Tensor, order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: nibble i of word c is column ``8c + order[i]`` (default i)."""
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8], nibble i
    if order is not None:
        cols = torch.empty_like(nibbles)
        cols[..., list(order)] = nibbles
        nibbles = cols
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def groups_of(in_features: int, group_size: int, prefix: str) -> int:
    """Number of quantization groups along K; ValueError naming the layer when they do not tile K."""
    if group_size == -1:
        return 1
    if in_features % group_size:
        raise ValueError(f"{prefix}: in_features={in_features} is not a multiple of group_size={group_size}")
    return in_features // group_size


def local_groups(layer: nn.Module, in_features: int, group_size: int, prefix: str) -> int:
    """``groups_of`` for this rank's ``in_features``; a row-parallel split that cuts a group names the layer."""
    world = tp_world_size(layer)
    if is_row_parallel(layer) and group_size != -1 and in_features % group_size:
        raise ValueError(f"{prefix}: the per-rank input size {in_features} ({in_features * world} split over "
                         f"tensor_parallel_size {world}) is not a multiple of group_size={group_size}")
    return groups_of(in_features, group_size, prefix)


def group_offset(layer: nn.Module, group_size: int) -> int:
    """Index of this rank's first quantization group in the checkpoint (0 unless row-parallel)."""
    if not is_row_parallel(layer) or group_size == -1:
        return 0
    return layer.tp_spec.in_range[0] // group_size


def act_order_perm(g_idx: torch.Tensor, group_size: int, prefix: str) -> torch.Tensor | None:
    """The load-time permutation that makes act-order groups contiguous (None when they already are).

    Sorting rows by group gives row k the group ``k // group_size``; the kernel then reads
    activation column ``perm[k]`` for weight row k.
    """
    k = g_idx.numel()
    gs = k if group_size == -1 else group_size
    contiguous = torch.arange(k, device=g_idx.device) // gs
    g_idx = g_idx.to(torch.long)
    if torch.equal(g_idx, contiguous):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], contiguous):
        raise ValueError(f"{prefix}: g_idx does not give every group exactly {gs} rows; cannot repack act-order")
    return perm.to(torch.int32)


class Int4LinearMethod(LinearMethod):
    """Shared repack + forward of the int4 formats (subclasses own the checkpoint layout)."""

    def __init__(self, group_size: int, prefix: str, kernel: str = "auto") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown int4 kernel {kernel!r} ({', '.join(KERNELS)})")
        self.group_size = group_size
        self.prefix = prefix
        self.kernel = kernel

    def finalize(
        self,
        layer: nn.Module,
        q: torch.Tensor,  # uint8 [K, N]
        zeros: torch.Tensor,  # uint8 [G, N]
        scales: torch.Tensor,  # [G, N]
        g_idx: torch.Tensor | None,  # [K] or None (contiguous groups)
    ) -> None:
        """Registers the kernel layout as buffers ``w4_qweight/w4_scales/w4_zeros/w4_perm``.

        Act-order (``g_idx`` not contiguous): the rows of q are sorted by group once here, so the
        kernel sees contiguous groups (one scale row per k-block) and only the activations are
        permuted per call (``x[:, perm]``: gathered in the GEMV kernel, one index_select before
        the tensor-core kernel)."""
        perm = act_order_perm(g_idx, self.group_size, self.prefix) if g_idx is not None else None
        if perm is not None:
            q = q.index_select(0, perm.to(torch.long))
        layer.register_buffer("w4_qweight", pack_int4_kernel(q))
        layer.register_buffer("w4_scales", compact_scales(scales))
        layer.register_buffer("w4_zeros", zeros.to(torch.uint8).contiguous())
        layer.register_buffer("w4_perm", perm)
        self._check_kernel_layout(layer)

    def _check_kernel_layout(self, layer: nn.Module) -> None:
        """On CUDA the forward launches without per-call checks: validate the buffers once here."""
        if layer.w4_qweight.is_cuda:
            from paged_backend.kernels.int4_gemm import check_int4_weights

            check_int4_weights(layer.w4_qweight, layer.w4_scales, layer.w4_zeros, self.group_size, layer.w4_perm)

    def finalize_sparse_groups(
        self,
        layer: nn.Module,
        q: torch.Tensor,  # uint8 [K, N]: this rank's rows
        zeros: torch.Tensor,  # uint8 [G, N]: every group of the checkpoint
        scales: torch.Tensor,  # [G, N]
        g_idx: torch.Tensor,  # [K] checkpoint group of each row
    ) -> None:
        """Act-order rows of a row-parallel rank use any groups, each fewer than group_size times:
        rows are sorted into one full-size slot per group they use, the slots' spare rows read an
        appended zero activation column (``w4_gather``), so the kernel sees contiguous groups."""
        k, gs = q.shape[0], self.group_size
        g_idx = g_idx.to(torch.long)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= zeros.shape[0]:
            raise ValueError(f"{self.prefix}: g_idx values outside 0..{zeros.shape[0] - 1}")
        order = torch.argsort(g_idx, stable=True)
        used, counts = torch.unique_consecutive(g_idx[order], return_counts=True)
        if int(counts.max()) > gs:
            raise ValueError(f"{self.prefix}: g_idx gives a group more than {gs} rows")
        slot = torch.repeat_interleave(torch.arange(used.numel(), device=q.device), counts)  # slot of each sorted row
        first = torch.cumsum(counts, 0) - counts
        dest = slot * gs + torch.arange(k, device=q.device) - first[slot]
        q_pad = torch.zeros(used.numel() * gs, q.shape[1], dtype=torch.uint8, device=q.device)
        q_pad[dest] = q[order]
        gather = torch.full((used.numel() * gs,), k, dtype=torch.long, device=q.device)  # k: the zero column
        gather[dest] = order
        layer.register_buffer("w4_qweight", pack_int4_kernel(q_pad))
        layer.register_buffer("w4_scales", compact_scales(scales[used]))
        layer.register_buffer("w4_zeros", zeros[used].to(torch.uint8).contiguous())
        layer.register_buffer("w4_perm", None)
        layer.register_buffer("w4_gather", gather)
        self._check_kernel_layout(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        gather = getattr(layer, "w4_gather", None)
        if gather is not None:
            x2 = torch.cat([x2, x2.new_zeros(x2.shape[0], 1)], dim=1).index_select(1, gather)
        args = (layer.w4_qweight, layer.w4_scales, layer.w4_zeros, self.group_size, layer.w4_perm, bias)
        if self.kernel == "triton" or (self.kernel == "auto" and x.is_cuda):
            from paged_backend.kernels.int4_gemm import int4_gemm

            y = int4_gemm(x2.contiguous(), *args, check=False)
        else:
            y = int4_gemm_ref(x2, *args)
        return y.reshape(*lead, y.shape[-1])



def random_int32(shape: Sequence[int], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniformly random int32 words (every nibble uniform in 0..15): random packed int4 weights."""
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * 4,), dtype=torch.uint8, generator=gen, device=device)
    return raw.view(torch.int32).reshape(*shape)


def int4_word(nibble: int, bits: int = 4) -> int:
    """The signed int32 whose ``bits``-wide fields all equal ``nibble`` (e.g. packed zero points)."""
    word = sum(nibble << (bits * i) for i in range(32 // bits))
    return word - (1 << 32) if word >= 1 << 31 else word


def dummy_scales(shape: Sequence[int], gen: torch.Generator, device: torch.device, std: float,
                 rms: float = _INT4_RMS) -> torch.Tensor:
    """Positive group scales around ``std / rms``, ``rms`` = that of (q - zero) for random codes
    and a centred zero point (int4: sqrt(21.5)), so the dequantized weights have about the dense
    dummy's standard deviation ``std``."""
    jitter = torch.rand(*shape, generator=gen, device=device) * 0.5 + 0.75
    return jitter * (std / rms)


def dummy_g_idx(k: int, first_row: int, group_size: int, act_order: bool, gen: torch.Generator,
                device: torch.device) -> torch.Tensor:
    """The checkpoint group of each of this rank's ``k`` input rows (global rows from ``first_row``):
    contiguous groups, shuffled when ``act_order`` (each group still used at most group_size times)."""
    rows = torch.arange(first_row, first_row + k, device=device)
    g = torch.zeros_like(rows) if group_size == -1 else rows // group_size
    if act_order:
        g = g[torch.randperm(k, generator=gen, device=device)]
    return g.to(torch.int32)


def first_input_row(layer: nn.Module) -> int:
    """Global index of this rank's first input feature (0 unless row-parallel)."""
    return layer.tp_spec.in_range[0] if is_row_parallel(layer) else 0


def shared_g_idx(g_idx: torch.Tensor, prefix: str, what: str) -> torch.Tensor:
    """One g_idx for a fused layer: q/k/v (gate/up) see the same input, so act-order must agree."""
    if any(not torch.equal(g_idx[0], g) for g in g_idx[1:]):
        raise ValueError(f"{prefix}: the fused shards' {what} differ; cannot share one act-order permutation")
    return g_idx[0]
