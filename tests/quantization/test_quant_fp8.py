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
from quant_fixtures import LINEARS, write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from paged_backend.attention import get_attention_backend
from paged_backend.models.model_info import ModelInfo
from paged_backend.quantization.fp8 import FP8_DTYPE, FP8_MAX, fake_quant_fp8
from paged_backend.worker.model_loader import load_model


def _load(path: Path):
    backend = get_attention_backend("torch", torch.device("cpu"))
    return load_model(path, ModelInfo.from_dir(path), torch.float32, "cpu", backend)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "dense", "LlamaForCausalLM")


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_fp8_layers_match_independent_dequantization(tiny, tmp_path, per_channel, scheme):
    raw = write_fp8_checkpoint(tiny, tmp_path / "fp8", per_channel, scheme)
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


def _write_fp8_block(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """DeepSeek-style block-wise fp8: e4m3 ``weight`` + float32 ``weight_scale_inv`` per block."""
    bn, bk = block
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEARS):
            n, k = t.shape
            rows, cols = -(-n // bn), -(-k // bk)
            scale = torch.empty(rows, cols)
            q = torch.empty(n, k, dtype=FP8_DTYPE)
            for r in range(rows):
                for c in range(cols):
                    blk = t[r * bn : (r + 1) * bn, c * bk : (c + 1) * bk]
                    scale[r, c] = blk.abs().max() / FP8_MAX
                    q[r * bn : (r + 1) * bn, c * bk : (c + 1) * bk] = (blk / scale[r, c]).to(FP8_DTYPE)
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = q, scale
        else:
            out[name] = t
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return out


def _group_fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per token, per ``group`` inputs (the last group shorter), written out group by group."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], group):
        part = x[:, start : start + group]
        out[:, start : start + group] = fake_quant_fp8(part, part.abs().amax(1, keepdim=True) / FP8_MAX)
    return out


def test_fp8_block_wise_checkpoint(tiny, tmp_path):
    """[32, 48] blocks: q|k|v shards of 64/32/32 rows start on block rows; K = 64 and 128 end in a
    partial 48-column block. Each layer equals an independent block dequantization, activations
    are quantized per token and per 48 inputs, and the model stays close to the dense one."""
    raw = _write_fp8_block(tiny, tmp_path / "fp8", (32, 48))
    model = _load(tmp_path / "fp8")
    prefix = "model.layers.0.self_attn"
    parts = []
    for p in ("q_proj", "k_proj", "v_proj"):
        q, s = raw[f"{prefix}.{p}.weight"].float(), raw[f"{prefix}.{p}.weight_scale_inv"]
        w = torch.empty_like(q)
        for r in range(q.shape[0]):
            for c in range(q.shape[1]):
                w[r, c] = q[r, c] * s[r // 32, c // 48]
        parts.append(w)
    want_w = torch.cat(parts)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight_scale_inv.shape == (4, 2)
    torch.testing.assert_close(layer.linear_method.dequantized_weight(layer, torch.float32), want_w, rtol=0, atol=0)
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(x), F.linear(_group_fake_quant(x, 48), want_w), rtol=1e-5, atol=1e-5)
    assert model.lm_head.linear_method is None
    # the whole model against the dense checkpoint it came from, next to per-channel fp8 of the same
    # weights (this tiny random model is sensitive: ~13% logit error for both); inverted or misplaced
    # block scales would be far off
    write_fp8_checkpoint(tiny, tmp_path / "per_channel", per_channel=True, scheme="dynamic")
    ids = torch.tensor([3, 17, 42, 9, 100])
    ref = _model_logits(_load(tiny), ids)
    err = {name: ((_model_logits(m, ids) - ref).norm() / ref.norm()).item()
           for name, m in (("block", model), ("channel", _load(tmp_path / "per_channel")))}
    assert err["block"] < 1.25 * err["channel"], err


def _model_logits(model, ids: torch.Tensor) -> torch.Tensor:
    from model_fixtures import PagedCache, paged_logits

    info = model.info
    cache = PagedCache(info.num_layers, info.num_kv_heads, info.head_dim, torch.float32)
    return paged_logits(model, ids.tolist(), len(ids), cache)


@pytest.mark.parametrize(
    "block,scheme,match",
    [
        ((48, 32), "dynamic", r"qkv_proj: fused shards of \(64, 32, 32\) outputs do not start on 48-row blocks"),
        ((32, 32), "static", "need activation_scheme 'dynamic'"),
        ((32, 0), "dynamic", "two positive ints"),
    ],
)
def test_fp8_block_config_errors(tiny, tmp_path, block, scheme, match):
    _write_fp8_block(tiny, tmp_path / "fp8", (32, 32))
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"].update(weight_block_size=list(block), activation_scheme=scheme)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        _load(tmp_path / "fp8")


def test_fp8_block_scale_shape_mismatch_is_named(tiny, tmp_path):
    raw = _write_fp8_block(tiny, tmp_path / "fp8", (32, 32))
    raw["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 3)
    save_file(raw, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv.*checkpoint has \(2, 3\).*expects \(2, 4\)"):
        _load(tmp_path / "fp8")


def test_fp8_missing_weight_scale_is_named(tiny, tmp_path):
    raw = write_fp8_checkpoint(tiny, tmp_path / "fp8", per_channel=True, scheme="dynamic")
    raw.pop("model.layers.0.mlp.up_proj.weight_scale")
    save_file(raw, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model\.layers\.0\.mlp\.up_proj\.weight_scale'\]"):
        _load(tmp_path / "fp8")
