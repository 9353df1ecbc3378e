"""8-bit GPTQ in the AutoGPTQ v1 layout, written here from a tiny HF model (round-to-nearest per
group, asymmetric, act-order on/off): each layer equals an independent dequantization, the model
stays close to the dense one, and the dummy format makes 8-bit tensors too.

The packing is written out by hand (4 bytes per int32, lowest first; zero points stored minus
one), not by GPTQModel: the 4-bit tool checkpoints cover the tools' own output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import PagedCache, make_tiny_checkpoint, paged_logits
from quant_fixtures import LINEARS, SHAPES
from safetensors.torch import load_file, save_file

from paged_backend.attention import get_attention_backend
from paged_backend.models.model_info import ModelInfo
from paged_backend.worker.model_loader import load_model

GROUP = 32


def _pack_words(values: torch.Tensor) -> torch.Tensor:
    """int [R, 4C] bytes -> int32 [R, C]: byte j of word c = values[:, 4c + j]."""
    r, c4 = values.shape
    out = torch.zeros(r, c4 // 4, dtype=torch.int64)
    for j in range(4):
        out |= values[:, j::4].to(torch.int64) << (8 * j)
    return (out - (out >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int):
    """w [N, K] -> (q [K, N] 0..255, zero [G, N], scale [G, N]), asymmetric per group of g_idx."""
    wt = w.t()  # [K, N]
    scale, zero = torch.empty(groups, w.shape[0]), torch.empty(groups, w.shape[0], dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scale[g] = (hi - lo).clamp_min(1e-8) / 255
        zero[g] = torch.round(-lo / scale[g]).clamp(0, 255).to(torch.int64)
    q = torch.round(wt / scale[g_idx] + zero[g_idx]).clamp(0, 255).to(torch.int64)
    return q, zero, scale


def _write_gptq8(src: Path, dst: Path, act_order: bool) -> dict[str, tuple]:
    tensors = load_file(src / "model.safetensors")
    out, parts = {}, {}
    for name, t in tensors.items():
        if not (name.endswith(".weight") and any(f".{m}." in name for m in LINEARS)):
            out[name] = t
            continue
        k = t.shape[1]
        g_idx = torch.arange(k) // GROUP
        if act_order:  # every input of a layer shares one act-order (q/k/v and gate/up are fused)
            g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))]
        q, zero, scale = _quantize(t, g_idx, k // GROUP)
        base = name.removesuffix(".weight")
        out[f"{base}.qweight"] = _pack_words(q.t().contiguous()).t().contiguous()  # [K/4, N]: 4 rows per word
        out[f"{base}.qzeros"] = _pack_words(zero - 1)  # v1: zero - 1, 4 columns per word
        out[f"{base}.scales"] = scale.half()
        out[f"{base}.g_idx"] = g_idx.to(torch.int32)
        parts[base] = (q, zero, scale.half().float(), g_idx)
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": act_order,
                                  "sym": False, "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return parts


def _load(path: Path, load_format: str = "auto"):
    backend = get_attention_backend("torch", torch.device("cpu"))
    return load_model(path, ModelInfo.from_dir(path), torch.float32, "cpu", backend, load_format=load_format)


def _logits(model, ids: list[int]) -> torch.Tensor:
    info = model.info
    return paged_logits(model, ids, len(ids), PagedCache(info.num_layers, info.num_kv_heads, info.head_dim,
                                                         torch.float32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gptq8") / "dense", "LlamaForCausalLM")


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq8_layers_match_independent_dequantization(tiny, tmp_path, act_order):
    parts = _write_gptq8(tiny, tmp_path / "q", act_order)
    model = _load(tmp_path / "q")
    want = []
    for p in ("gate_proj", "up_proj"):
        q, zero, scale, g_idx = parts[f"model.layers.1.mlp.{p}"]
        want.append(((q - zero[g_idx]).float() * scale[g_idx]).t())  # [N, K]
    layer = model.model.layers[1].mlp.gate_up_proj
    torch.testing.assert_close(layer.w8_dense, torch.cat(want), rtol=1e-6, atol=1e-7)
    assert layer.linear_method.bits == 8 and not hasattr(layer, "w4_qweight")
    ids = [5, 77, 31, 200, 9, 14]
    dense = _logits(_load(tiny), ids)
    err = ((_logits(model, ids) - dense).norm() / dense.norm()).item()
    assert err < 0.03, err  # 8-bit codes; this tiny model amplifies (per-channel fp8 weights: ~13%)


def test_gptq8_dummy(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    qcfg = {"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": True, "sym": True}
    (path / "config.json").write_text(json.dumps(dict(SHAPES, quantization_config=qcfg)))
    model = _load(path, "dummy")
    w = model.model.layers[0].self_attn.o_proj.w8_dense
    assert w.shape == (128, 128) and 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.002
    assert torch.isfinite(_logits(model, [1, 2, 3])).all()
