"""Dense linears on the CPU: ``linear`` runs a plain ``FusedLinear`` through oneDNN on a packed weight where
that is faster (``cpu_linear``), else the layer's own forward (quantized methods, tensor-parallel collectives,
other devices).
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.models.layers import FusedLinear

# -- dense linears on the CPU ------------------------------------------------------------------
# torch's F.linear runs MKL's sgemm; oneDNN on a weight reordered once into its blocked layout is
# faster at the engine's batch shapes on the development CPU (AMD EPYC, AVX2, 2 threads: 32 rows
# 1.3-1.5x, the LM head at 32 rows 1.7-2.5x, 2048 rows 1.2-1.4x) and ~10% slower for one row. The
# same math with another summation order (fp32 results differ in the last bits, as between two
# BLAS libraries). The packed copy is extra memory the size of the fp32 weights, made on first
# use; ``load_weights`` drops it. Packed copies take at most a quarter of the RAM that was free
# when the first one was made (``_PACK_BUDGET``): a large model keeps F.linear, not 2x its weights.
# A packed copy's bytes go back to the budget when it is freed (its layer or engine is), so a
# process that builds engine after engine keeps packing.
_ONEDNN_MIN_ROWS = 2
_PACK_BUDGET: list[int] = []  # bytes packed copies may still take in this process (set on first use)
PACKED = "_onednn_packed"  # module attribute: {(start, stop): (weight data_ptr, packed) | None}


def _onednn_usable() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_usable()


def _packed_weight(layer: nn.Module, rows: tuple[int, int], w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of ``w`` (rows ``rows`` of the layer's weight), made once; None: unsupported."""
    cache = layer.__dict__.setdefault(PACKED, {})
    entry = cache.get(rows)
    if entry is not None and entry[0] == w.data_ptr():
        return entry[1]
    if rows in cache and entry is None:
        return None
    if not _PACK_BUDGET:
        _PACK_BUDGET.append(_free_ram() // 4)
    nbytes = w.numel() * w.element_size()
    if nbytes > _PACK_BUDGET[0]:
        cache[rows] = None
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
    except RuntimeError:  # a CPU or dtype oneDNN cannot pack for: F.linear from now on
        cache[rows] = None
        return None
    cache[rows] = (w.data_ptr(), packed)
    _PACK_BUDGET[0] -= nbytes
    weakref.finalize(packed, _credit, _PACK_BUDGET, nbytes)
    return packed


def _credit(budget: list[int], nbytes: int) -> None:
    """A packed copy was freed: its bytes go back to the budget it was taken from."""
    budget[0] += nbytes


def _free_ram() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0  # unknown: no packed copies


def cpu_linear(layer: FusedLinear, x: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """``x @ W[rows].T + b[rows]`` for a dense layer without collectives (``layer.forward`` on other devices)."""
    w, b = layer.weight, layer.bias
    if rows is not None:
        w = w[rows[0] : rows[1]]
        b = None if b is None else b[rows[0] : rows[1]]
    if (_ONEDNN and x.dim() == 2 and x.shape[0] >= _ONEDNN_MIN_ROWS and x.dtype == torch.float32
            and w.dtype == torch.float32):
        packed = _packed_weight(layer, rows or (0, w.shape[0]), w)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")
    return F.linear(x, w, b)


def dense_on_cpu(layer: nn.Module, x: torch.Tensor) -> bool:
    """A plain dense linear (no quantized method, no tensor-parallel collective in its forward) on the CPU."""
    return (x.device.type == "cpu" and getattr(layer, "linear_method", True) is None
            and type(layer).forward is FusedLinear.forward)


def linear(layer: FusedLinear, x: torch.Tensor) -> torch.Tensor:
    return cpu_linear(layer, x) if dense_on_cpu(layer, x) else layer(x)
