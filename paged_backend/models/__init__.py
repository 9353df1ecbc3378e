"""Model definitions; ``get_model_class`` (models/registry.py) maps a checkpoint's architecture to ours."""

from __future__ import annotations

from paged_backend.models.layers import ModelOps, reference_ops
from paged_backend.models.llama import LlamaForCausalLM
from paged_backend.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "ModelOps", "get_model_class", "reference_ops"]
