"""Shared by the quantization tests: a tiny Llama config and an fp8 checkpoint writer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX
from safetensors.torch import load_file, save_file

# a tiny Llama, for checkpoints whose weights a test makes itself
SHAPES = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", hidden_size=128,
              intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(src: Path, dst: Path, per_channel: bool, scheme: str) -> dict[str, torch.Tensor]:
    """Quantizes every decoder linear of ``src`` to e4m3 (lm_head stays dense); returns the tensors."""
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEARS):
            amax = t.abs().amax(dim=1, keepdim=True) if per_channel else t.abs().amax()
            scale = (amax.float() / FP8_MAX).clamp_min(1e-12)
            out[name] = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[name.replace(".weight", ".weight_scale")] = scale if per_channel else scale.reshape(())
            if scheme == "static":
                out[name.replace(".weight", ".input_scale")] = torch.tensor(0.01 + 0.001 * len(out))
        else:
            out[name] = t
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme}
    (dst / "config.json").write_text(json.dumps(cfg))
    return out
