"""Model definitions; ``get_model_class`` maps a checkpoint's architecture to ours."""

from __future__ import annotations

from paged_backend.models.layers import ModelOps, reference_ops
from paged_backend.models.llama import LlamaForCausalLM
from paged_backend.models.model_info import SUPPORTED_ARCHITECTURES

__all__ = ["LlamaForCausalLM", "ModelOps", "get_model_class", "reference_ops"]


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Llama, Mistral, Qwen2 and Qwen3 (and SmolLM, a Llama) share one implementation."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return LlamaForCausalLM
