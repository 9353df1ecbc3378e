"""The ops a decoder layer calls (RMSNorm, SiLU-and-mul, rotary, routed experts), chosen once per model.

Triton kernels on CUDA, the pure-torch references elsewhere; both sets take the same
arguments and return the same dtypes, so a model is written once against ``ModelOps``.
"""

from __future__ import annotations

import functools

import torch

from paged_backend.models.layers import ModelOps, reference_ops


@functools.cache
def triton_ops() -> ModelOps:
    """The Triton kernels (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); one set per process."""
    from paged_backend.kernels.activation import silu_and_mul
    from paged_backend.kernels.fused_moe import fused_moe
    from paged_backend.kernels.rms_norm import rms_norm
    from paged_backend.kernels.rotary import rotary

    # the layer's routing makes the expert ids (always in range) and its loaders check the weights:
    # no per-call argument checks, whose id range check is a host sync in every MoE layer of every step
    return ModelOps(rms_norm=rms_norm, silu_and_mul=silu_and_mul, rotary=rotary,
                    fused_moe=functools.partial(fused_moe, check=False))


def get_kernel_ops(device: torch.device | str, name: str = "auto") -> ModelOps:
    """``auto``: Triton on CUDA (when it imports), the torch references elsewhere."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        return reference_ops()
    if name == "triton":
        return triton_ops()
    raise ValueError(f"unknown kernel ops {name!r} (auto, torch, triton)")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
