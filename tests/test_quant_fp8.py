"""FP8 weights in vLLM's serialized ``quant_method: fp8`` format, written here from a tiny HF model
(per-tensor scales that differ between fused q/k/v shards, and per-channel scales): each loaded
layer equals an independent dequantization, and the activation schemes fake-quantize as stated.

The checkpoint is written by this test (the format is a plain float8_e4m3fn ``weight`` plus a
float32 ``weight_scale`` / ``input_scale``), not by a tool; llm-compressor's FP8 output is covered
by test_quant_checkpoints.py when tests/quant_checkpoints/ct-fp8-dynamic exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from paged_backend.attention import get_attention_backend
from paged_backend.model_info import ModelInfo
from paged_backend.model_loader import load_model
from paged_backend.quantization.fp8 import FP8_DTYPE, FP8_MAX, fake_quant_fp8

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_fp8(src: Path, dst: Path, per_channel: bool, scheme: str) -> dict[str, torch.Tensor]:
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


def _load(path: Path):
    backend = get_attention_backend("torch", torch.device("cpu"))
    return load_model(path, ModelInfo.from_dir(path), torch.float32, "cpu", backend)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "dense", "LlamaForCausalLM")


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_fp8_layers_match_independent_dequantization(tiny, tmp_path, per_channel, scheme):
    raw = _write_fp8(tiny, tmp_path / "fp8", per_channel, scheme)
    model = _load(tmp_path / "fp8")
    attn = model.model.layers[1].self_attn
    prefix = "model.layers.1.self_attn"
    parts = [(raw[f"{prefix}.{p}.weight"].float(), raw[f"{prefix}.{p}.weight_scale"]) for p in ("q_proj", "k_proj", "v_proj")]
    want_w = torch.cat([w * (s.reshape(-1, 1) if s.dim() else s) for w, s in parts])
    if not per_channel:  # three different per-tensor scales, kept per shard
        assert len({float(s) for _, s in parts}) == 3
    layer = attn.qkv_proj
    torch.testing.assert_close(layer.weight.float() * layer.weight_scale[:, None], want_w, rtol=0, atol=0)
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    if scheme == "static":
        s_in = max(float(raw[f"{prefix}.{p}.input_scale"]) for p in ("q_proj", "k_proj", "v_proj"))
        xq = fake_quant_fp8(x, torch.tensor(s_in))
    else:
        xq = fake_quant_fp8(x, x.abs().amax() / FP8_MAX)
    torch.testing.assert_close(layer(x), F.linear(xq, want_w), rtol=1e-5, atol=1e-5)
    assert model.lm_head.linear_method is None


def test_fp8_block_scales_are_rejected(tiny, tmp_path):
    _write_fp8(tiny, tmp_path / "fp8", per_channel=False, scheme="dynamic")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128, 128]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weight_block_size"):
        _load(tmp_path / "fp8")


def test_fp8_missing_weight_scale_is_named(tiny, tmp_path):
    raw = _write_fp8(tiny, tmp_path / "fp8", per_channel=True, scheme="dynamic")
    raw.pop("model.layers.0.mlp.up_proj.weight_scale")
    save_file(raw, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model\.layers\.0\.mlp\.up_proj\.weight_scale'\]"):
        _load(tmp_path / "fp8")
