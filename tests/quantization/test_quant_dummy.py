"""``load_format="dummy"`` with a quantization method: random tensors in each checkpoint format,
processed like loaded ones, so a quantized model can be benchmarked from config.json alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import PagedCache, make_meta
from quant_fixtures import SHAPES

from paged_backend.attention import get_attention_backend
from paged_backend.kernels.int4_gemm_ref import dequantize_int4_ref
from paged_backend.models.layers import FusedLinear
from paged_backend.models.model_info import ModelInfo
from paged_backend.quantization import DUMMY_CONFIGS
from paged_backend.quantization.fp8 import Fp8LinearMethod
from paged_backend.quantization.int4 import Int4LinearMethod, dummy_g_idx, int4_word, random_int32
from paged_backend.worker.model_loader import load_model

# every in_features a multiple of 128 (the default group size)
METHODS = ["gptq", "awq", "compressed-tensors", "fp8"]


def _config_dir(path: Path, quantization_config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    cfg = dict(SHAPES, quantization_config=quantization_config) if quantization_config else SHAPES
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _load(path: Path, quantization: str | None):
    backend = get_attention_backend("torch", torch.device("cpu"))
    return load_model(path, ModelInfo.from_dir(path), torch.float32, "cpu", backend, load_format="dummy",
                      quantization=quantization)


def _logits(model) -> torch.Tensor:
    info = model.info
    cache = PagedCache(info.num_layers, info.num_kv_heads, info.head_dim, torch.float32)
    meta, pos = make_meta([(0, 6, cache.blocks_for([], 6))], cache.block_size)
    with torch.no_grad():
        return model.compute_logits(model(torch.arange(6), pos, cache.kv_caches, meta))


def _dense_weight(layer: FusedLinear) -> torch.Tensor:
    """The layer's effective [K, N] weight after processing (int4 kernel layout or fp8 * scale)."""
    if isinstance(layer.linear_method, Fp8LinearMethod):
        return (layer.weight.float() * layer.weight_scale[:, None]).t()
    gs = layer.linear_method.group_size
    return dequantize_int4_ref(layer.w4_qweight, layer.w4_scales, layer.w4_zeros, gs, torch.float32)


@pytest.mark.parametrize("method", METHODS)
def test_dummy_quantized_model_runs_from_config_only(tmp_path, method):
    path = _config_dir(tmp_path / "m")
    a, b = _load(path, method), _load(path, method)
    linears = [m for m in a.modules() if isinstance(m, FusedLinear) and m.linear_method is not None]
    assert len(linears) == 4 * SHAPES["num_hidden_layers"]  # qkv, o, gate_up, down; lm_head stays dense
    want = Fp8LinearMethod if method == "fp8" else Int4LinearMethod
    assert all(isinstance(m.linear_method, want) for m in linears)
    assert a.lm_head.linear_method is None
    for layer in linears:
        w = _dense_weight(layer)
        assert w.shape == (layer.in_features, sum(layer.out_sizes))
        assert 0.014 < w.std().item() < 0.026, (method, w.std().item())  # about the dense dummy's 0.02
        assert abs(w.mean().item()) < 0.003  # int4: (q - 8) averages -0.5 steps
    first = _dense_weight(linears[0])
    assert not torch.equal(first[:, : first.shape[1] // 2], first[:, first.shape[1] // 2 :])
    assert not torch.equal(_dense_weight(linears[0]), _dense_weight(linears[4]))  # layer 0 vs layer 1 qkv
    la, lb = _logits(a), _logits(b)
    assert la.shape == (6, 256) and torch.isfinite(la).all() and la.std() > 0
    assert torch.equal(la, lb)  # seeded


def test_dummy_uses_the_checkpoints_config_when_present(tmp_path):
    """An act-order GPTQ config in config.json: the dummy rows get shuffled groups -> a permutation."""
    cfg = dict(DUMMY_CONFIGS["gptq"], desc_act=True, group_size=64)
    model = _load(_config_dir(tmp_path / "m", cfg), None)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.linear_method.group_size == 64
    assert layer.w4_perm is not None and layer.w4_scales.shape == (256 // 64, 128)
    assert torch.isfinite(_logits(model)).all()
    # the explicit method must still agree with the checkpoint's
    with pytest.raises(ValueError, match="does not match"):
        _load(tmp_path / "m", "awq")


def test_dummy_compressed_tensors_asymmetric_act_order(tmp_path):
    cfg = json.loads(json.dumps(DUMMY_CONFIGS["compressed-tensors"]))
    cfg["config_groups"]["group_0"]["weights"].update(symmetric=False, actorder="group")
    model = _load(_config_dir(tmp_path / "m", cfg), None)
    layer = model.model.layers[1].mlp.down_proj  # K = 256: two groups to shuffle
    assert layer.w4_perm is not None and torch.equal(layer.w4_zeros, torch.full_like(layer.w4_zeros, 8))
    assert torch.isfinite(_logits(model)).all()


def test_dummy_fp8_static_scheme_and_bad_method(tmp_path):
    model = _load(_config_dir(tmp_path / "s", {"quant_method": "fp8", "activation_scheme": "static"}), None)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.input_scale.shape == (1,) and float(layer.input_scale) == pytest.approx(8 / 448)
    assert layer.weight.dtype == torch.float8_e4m3fn
    # per-channel scales: the largest |weight| of every row maps to 448
    assert torch.equal(layer.weight.float().abs().amax(1), torch.full((layer.weight.shape[0],), 448.0))
    assert torch.isfinite(_logits(model)).all()
    with pytest.raises(ValueError, match="'int3' is not supported"):
        _load(_config_dir(tmp_path / "p"), "int3")


def test_dummy_helpers():
    gen = torch.Generator().manual_seed(0)
    words = random_int32((64, 32), gen, torch.device("cpu"))
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)])
    counts = torch.bincount(nibbles.flatten(), minlength=16).float()
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()  # every nibble uniform
    assert int4_word(8) == -0x77777778 and int4_word(7) == 0x77777777  # 0x88888888 as a signed int32
    g = dummy_g_idx(256, 0, 64, True, gen, torch.device("cpu"))
    assert torch.equal(torch.bincount(g.long()), torch.full((4,), 64)) and not torch.equal(g, g.sort().values)
    g = dummy_g_idx(64, 128, 64, False, gen, torch.device("cpu"))  # a row-parallel rank's global groups
    assert torch.equal(g, torch.full((64,), 2, dtype=torch.int32))
    assert torch.equal(dummy_g_idx(16, 0, -1, True, gen, torch.device("cpu")), torch.zeros(16, dtype=torch.int32))


def test_dummy_block_fp8(tmp_path):
    cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}
    model = _load(_config_dir(tmp_path / "m", cfg), None)
    layer = model.model.layers[0].self_attn.qkv_proj  # q|k|v = 128|64|64 rows, K = 128
    assert layer.weight_scale_inv.shape == (4, 2)
    w = layer.linear_method.dequantized_weight(layer, torch.float32)
    assert 0.015 < w.std().item() < 0.025
    blocks = layer.weight.float().abs().reshape(4, 64, 2, 64).amax(dim=(1, 3))
    assert torch.equal(blocks, torch.full((4, 2), 448.0))  # each block's largest |w| -> 448
    assert torch.isfinite(_logits(model)).all()
