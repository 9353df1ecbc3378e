"""Which attention backend a model runner gets."""

from __future__ import annotations

import torch

from paged_backend.attention.backend import AttentionBackend


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: the Triton backend on CUDA, the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from paged_backend.attention.torch_attn import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from paged_backend.attention.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}")
