"""Quantized checkpoints: AWQ and GPTQ int4, compressed-tensors (W4A16 / FP8), FP8.

``get_quantization_config`` reads the checkpoint's method (``config.json``'s
``quantization_config``, else ``quantize_config.json``), checks it against an explicit
``--quantization`` and returns the parsed ``QuantizationConfig`` (None = unquantized).
"""

from __future__ import annotations

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

__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "get_quantization_config",
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
    model_dir: Path | str, from_config_json: dict[str, Any] | None, override: str | None = None
) -> QuantizationConfig | None:
    """The checkpoint's quantization; ``override`` (``--quantization``) must agree with it."""
    cfg = read_quantization_config(model_dir, from_config_json)
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
