"""Which model class runs a checkpoint's ``architectures[0]``: one entry per architecture.

A new family adds its module under ``models/`` and its architectures here (and to
``model_info.SUPPORTED_ARCHITECTURES``, which the config parser accepts; a test keeps the two equal).
"""

from __future__ import annotations

from torch import nn

from paged_backend.models.llama import LlamaForCausalLM

# Llama, Mistral, Qwen2, Qwen3, GLM-4 (and SmolLM, a Llama) and their MoE kin share one implementation
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,  # a Qwen3 whose MLPs are routed experts
    "MixtralForCausalLM": LlamaForCausalLM,  # a Mistral whose MLPs are routed experts
    "GlmForCausalLM": LlamaForCausalLM,  # partial interleaved rotary, q/k/v bias, gate|up fused in the checkpoint
    "Glm4ForCausalLM": LlamaForCausalLM,  # a GLM with norms on the attention and MLP outputs
    "Glm4MoeForCausalLM": LlamaForCausalLM,  # routed + shared experts after dense layers, partial rotary
    "DeepseekV2ForCausalLM": LlamaForCausalLM,  # latent attention (models/mla.py), routed + shared experts
    "DeepseekV3ForCausalLM": LlamaForCausalLM,  # V2 + a low-rank q, sigmoid noaux_tc routing
    "Glm4MoeLiteForCausalLM": LlamaForCausalLM,  # GLM-4.7-Flash: DeepSeek-V3's latent attention and experts
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
