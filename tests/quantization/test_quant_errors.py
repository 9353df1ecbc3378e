"""Bad quantized checkpoints fail at load with errors naming the tensor / key; the unquantized
path is untouched; --quantization checks the checkpoint's method."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_backend.attention import get_attention_backend
from paged_backend.models.model_info import ModelInfo
from paged_backend.quantization import get_quantization_config
from paged_backend.worker.model_loader import load_model

GPTQ = Path(__file__).resolve().parents[1] / "quant_checkpoints" / "gptq-g32"
pytestmark = pytest.mark.skipif(not GPTQ.is_dir(), reason="tests/quant_checkpoints not generated")


def _load(path: Path, quantization: str | None = None):
    backend = get_attention_backend("torch", torch.device("cpu"))
    return load_model(path, ModelInfo.from_dir(path), torch.float32, "cpu", backend, quantization=quantization)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(GPTQ, dst, ignore=shutil.ignore_patterns("reference.pt", "logs"))
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"bits": 3}, "bits=3 is not supported"),
        ({"bits": 8}, r"qweight'.*checkpoint has \(\d+, \d+\).*expects"),  # 4-bit tensors, 8-bit config
        ({"group_size": 16}, "group_size=16 is not supported"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"lm_head": True}, "lm_head"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
    ],
)
def test_unsupported_config_is_named(ckpt, changes, match):
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=match):
        _load(ckpt)


def test_missing_scales_names_the_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.scales"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model\.layers\.1\.self_attn\.k_proj\.scales'\]"):
        _load(ckpt)


def test_wrong_shape_names_the_tensor(ckpt):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.qzeros"] = t["model.layers.0.mlp.up_proj.qzeros"][:, :-1].contiguous()

    _edit_tensors(ckpt, shrink)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.qzeros'.*shape mismatch"):
        _load(ckpt)


def test_group_size_that_does_not_match_the_tensors(ckpt):
    _edit_config(ckpt, group_size=64)  # tensors were written for 32: scales have twice the rows
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.[a-z_.]+\.(qzeros|scales)'.*shape mismatch"):
        _load(ckpt)


def test_fused_shards_with_different_act_order_are_rejected(ckpt):
    def scramble(t):
        name = "model.layers.0.self_attn.v_proj.g_idx"
        t[name] = t[name].flip(0).contiguous()

    _edit_tensors(ckpt, scramble)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj: the fused shards' g_idx differ"):
        _load(ckpt)


def test_quantization_flag_checks_the_checkpoint(ckpt, tmp_path):
    assert _load(ckpt, quantization="gptq") is not None
    with pytest.raises(ValueError, match="--quantization 'awq' does not match .* which is gptq"):
        _load(ckpt, quantization="awq")
    with pytest.raises(ValueError, match="--quantization 'int3' is not supported"):
        _load(ckpt, quantization="int3")
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "quantize_config.json").unlink()
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.down_proj.g_idx'"):
        _load(ckpt)  # quantized tensors without a quantization config
    with pytest.raises(ValueError, match="which is not quantized"):
        _load(ckpt, quantization="fp8")


def test_quantize_config_json_alone_selects_gptq(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    qcfg = get_quantization_config(ckpt, None)
    assert qcfg is not None and qcfg.name == "gptq" and qcfg.group_size == 32
    assert _load(ckpt).model.layers[0].mlp.gate_up_proj.w4_qweight.dtype == torch.int32
