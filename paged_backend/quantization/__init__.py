"""Quantized checkpoints: AWQ and GPTQ int4, compressed-tensors (W4A16 / FP8), FP8.

``get_quantization_config`` reads the checkpoint's method (``config.json``'s
``quantization_config``, else ``quantize_config.json``), checks it against an explicit
``--quantization`` and returns the parsed ``QuantizationConfig`` (None = unquantized).

``load_format="dummy"`` with ``--quantization`` and a config.json without
``quantization_config`` uses ``DUMMY_CONFIGS``: what the tools write by default (4-bit, group
128, no act-order; fp8 per-channel weights with dynamic activations), so a model can be
benchmarked quantized from its shapes alone.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from paged_backend.quantization.awq import AWQConfig
from paged_backend.quantization.base import LinearMethod, QuantizationConfig
from paged_backend.quantization.compressed_tensors import CompressedTensorsConfig
from paged_backend.quantization.fp8 import Fp8Config
from paged_backend.quantization.gptq import GPTQConfig

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    c.name: c for c in (AWQConfig, GPTQConfig, CompressedTensorsConfig, Fp8Config)
}
_ALIASES = {"compressed_tensors": "compressed-tensors", "none": None}

DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
        }},
        "ignore": ["lm_head"],
    },
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}

__all__ = ["DUMMY_CONFIGS", "QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "get_quantization_config",
           "read_quantization_config"]


def read_quantization_config(model_dir: Path | str, from_config_json: dict[str, Any] | None) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config``, else AutoGPTQ's ``quantize_config.json`` (as gptq)."""
    if from_config_json:
        return dict(from_config_json)
    path = Path(model_dir) / "quantize_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON ({e})") from None
    return {"quant_method": "gptq", **cfg}


def get_quantization_config(
    model_dir: Path | str, from_config_json: dict[str, Any] | None, override: str | None = None,
    dummy: bool = False,
) -> QuantizationConfig | None:
    """The checkpoint's quantization; ``override`` (``--quantization``) must agree with it.

    ``dummy`` (random weights): a config.json without a quantization config takes the
    override's ``DUMMY_CONFIGS`` entry instead of failing the check."""
    cfg = read_quantization_config(model_dir, from_config_json)
    if cfg is None and dummy and override is not None:
        want = _ALIASES.get(override.lower(), override.lower())
        if want is not None and want in DUMMY_CONFIGS:
            cfg = copy.deepcopy(DUMMY_CONFIGS[want])
    found = None
    if cfg is not None:
        found = str(cfg.get("quant_method", "")).lower().replace("_", "-")
        if found not in QUANTIZATION_METHODS:
            raise ValueError(
                f"{model_dir}: quantization method {cfg.get('quant_method')!r} is not supported "
                f"({', '.join(QUANTIZATION_METHODS)})"
            )
    if override is not None:
        want = _ALIASES.get(override.lower(), override.lower())
        if want is not None and want not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization {override!r} is not supported ({', '.join(QUANTIZATION_METHODS)})")
        if want != found:
            raise ValueError(
                f"--quantization {override!r} does not match the checkpoint in {model_dir}, "
                f"which is {found or 'not quantized'}"
            )
    if found is None:
        return None
    return QUANTIZATION_METHODS[found].from_config(cfg)
