"""Shared launcher helpers: argument checks with clear errors, and the Triton dtype map.

Kernels run compiled on CUDA tensors, or under ``TRITON_INTERPRET=1`` on CPU tensors (the
interpreter is how CI tests them). The interpreter carries bf16 as raw bits and computes
``tl.dot`` with numpy, so kernels upcast every load to float32 there (``dot_dtype``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tl_dtype(dtype: torch.dtype):  # -> triton.language.dtype
    """The Triton element type of a torch dtype."""
    import triton.language as tl

    table = {
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float32: tl.float32,
        torch.float8_e4m3fn: tl.float8e4nv,
    }
    if dtype not in table:
        raise TypeError(f"no Triton element type for {dtype}")
    return table[dtype]


def dot_dtype(dtype: torch.dtype):  # -> triton.language.dtype
    """Operand type of ``tl.dot`` for activations of ``dtype``: float32 in the interpreter."""
    import triton.language as tl

    return tl.float32 if interpreting() else tl_dtype(dtype)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_contiguous: bool = True,
    contiguous: bool = False,
) -> torch.Tensor:
    """Raise ValueError/TypeError naming ``name`` unless ``t`` has this rank/shape/dtype/device/layout.

    ``shape`` entries of None match any size.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape, strict=True)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all tensors on one device)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def check_device(t: torch.Tensor, name: str) -> torch.device:
    """Compiled kernels need CUDA tensors; the interpreter takes CPU tensors."""
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{name} is on {t.device}: Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 for the CPU interpreter); use the *_ref functions on the CPU"
        )
    return t.device


def scale_tensor(scale: torch.Tensor | float | None, device: torch.device, name: str) -> torch.Tensor:
    """A float32 one-element tensor for a k/v scale (1.0 when None)."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if not isinstance(scale, torch.Tensor):
        return torch.full((1,), float(scale), dtype=torch.float32, device=device)
    if scale.numel() != 1:
        raise ValueError(f"{name} must have exactly one element, got shape {tuple(scale.shape)}")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device}, expected {device}")
    return scale.reshape(1).to(torch.float32)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def compiled_variants() -> dict[str, int]:
    """How many compiled variants each loaded Triton kernel of this package holds (all devices).

    A count that grows during a timed run means kernels compiled mid-run (``bench throughput``
    prints it). Kernels never launched are left out; {} under the interpreter.
    """
    import sys

    counts: dict[str, int] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith(__package__ + ".") or mod is None:
            continue
        for name, obj in vars(mod).items():
            caches = getattr(obj, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            n = sum(len(e[0]) for e in caches.values() if isinstance(e, tuple) and e and isinstance(e[0], dict))
            if n:
                counts[f"{mod_name.rsplit('.', 1)[-1]}.{name}"] = n
    return counts


@contextlib.contextmanager
def async_compiles(ignore_errors: bool = False) -> Iterator[None]:
    """Triton's AsyncCompileMode over a thread pool, where the installed Triton has it: kernel
    ``warmup`` calls (``compile_only`` launchers) inside the block compile in parallel (ptxas
    runs outside the GIL) and are done when it exits. ``ignore_errors``: a failing compile is
    left for the real call to report. A no-op on Triton versions without it."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        yield
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(2, min(16, os.cpu_count() or 2))) as pool, AsyncCompileMode(
        pool, ignore_errors=ignore_errors
    ):
        yield
