"""Builds a model on the meta device and streams its weights in from safetensors (mmap).

    meta-device build -> materialize(device) -> init_buffers() (rope table, KV scales = 1)
      -> load_weights(tensor by tensor from each *.safetensors file) -> every parameter loaded?

``load_format="dummy"`` skips the files: seeded random weights of the right shapes, for
benchmarks and tests that need only config.json. With a quantization method (the checkpoint's,
or ``--quantization`` over a plain config.json) each quantized linear fills its own
checkpoint-format tensors (``LinearMethod.init_dummy_weights``), then they are processed
exactly like loaded ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from paged_backend.attention.backend import AttentionBackend
from paged_backend.models import ModelOps, get_model_class
from paged_backend.models.layers import FusedLinear
from paged_backend.models.llama import LlamaForCausalLM
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.moe import FusedMoE
from paged_backend.models.mtp import UNQUANTIZED_MTP_LINEARS, MultiTokenPredictor
from paged_backend.models.parallel import LazyTensor
from paged_backend.models.weight_loading import expert_checkpoint_modules
from paged_backend.quantization import QuantizationConfig, get_quantization_config

if TYPE_CHECKING:
    from paged_backend.distributed import PPStage, TPGroup

INDEX_FILE = "model.safetensors.index.json"
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config_dtype: str, info: ModelInfo, device: torch.device) -> torch.dtype:
    """The compute dtype: ``auto`` = the checkpoint's dtype (float32 if config.json has none).

    fp16/bf16 checkpoints stay fp16/bf16 under ``auto`` on the CPU too (slower, but what the
    checkpoint is); ask for ``float32`` explicitly for exact CPU numerics.
    """
    if config_dtype == "auto":
        dtype = info.dtype or torch.float32
    elif config_dtype in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[config_dtype]
    else:
        raise ValueError(f"unsupported dtype {config_dtype!r}; use auto, {', '.join(_DTYPE_NAMES)}")
    device = torch.device(device)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{device} does not support bfloat16; pass dtype='float16' or 'float32'")
    return dtype


def find_safetensors(model_dir: Path) -> list[Path]:
    """The weight files: those named by ``model.safetensors.index.json``, else ``*.safetensors``."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: malformed safetensors index ({e!r})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names {f.name}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) > 1:  # Mistral repos ship consolidated.safetensors beside the HF shards
        files = [f for f in files if not f.name.startswith("consolidated")]
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (only safetensors checkpoints are supported)"
        )
    return files


class _Cursor:
    """Which file the weight stream is reading, so errors can name it."""

    def __init__(self) -> None:
        self.file: Path | None = None
        self.names: set[str] = set()


def iter_safetensors(files: list[Path], cursor: _Cursor, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) one at a time from mmap'ed files, as stored (the loader casts)."""
    for f in files:
        cursor.file = f
        try:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    cursor.names.add(name)
                    # lazy (tensor parallel): each weight loader reads only its rank's slice
                    yield name, LazyTensor(fh.get_slice(name)) if lazy else fh.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{f}: cannot read safetensors file ({e})") from None


def load_safetensors_weights(model: LlamaForCausalLM, model_dir: Path, files: list[Path]) -> None:
    """Streams every tensor into the model and checks that each parameter got loaded."""
    cursor = _Cursor()
    try:
        loaded = model.load_weights(iter_safetensors(files, cursor, lazy=getattr(model, "tp", None) is not None
                                                        or getattr(model, "pp", None) is not None))
    except ValueError as e:
        raise ValueError(f"{e} (in {cursor.file})") from None
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        absent = [hf for n in missing for hf in model.checkpoint_names(n) if hf not in cursor.names]
        raise ValueError(
            f"checkpoint {model_dir} is missing tensor(s) {absent or missing} "
            f"(parameters {missing}; read {', '.join(f.name for f in files)})"
        )


def materialize(model: nn.Module, device: torch.device) -> None:
    """``to_empty(device)`` that keeps tied parameters tied and their ``weight_loader`` attributes.

    (``nn.Module.to_empty`` makes a fresh Parameter per module, which unties lm_head from
    embed_tokens and drops the attributes set on the meta parameters.)
    """
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta param) -> (meta, real)
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in done:
                real = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                real.__dict__.update(p.__dict__)
                done[id(p)] = (p, real)
            module._parameters[key] = done[id(p)][1]
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = torch.empty_like(b, device=device)


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Seeded N(0, std) weights, zero biases, unit norm weights (``load_format="dummy"``);
    quantized linears get random tensors in their checkpoint format from their method."""
    quantized: set[int] = set()
    for i, module in enumerate(model.modules()):
        method = getattr(module, "linear_method", None) if isinstance(module, FusedLinear) else None
        if isinstance(module, FusedMoE):
            method = module.quant_method
        if method is not None:
            owned = [p for n, p in module.named_parameters(recurse=False)  # the experts': not the routing bias
                     if n != "bias" and (not isinstance(module, FusedMoE) or hasattr(p, "moe_kind"))]
            quantized.update(id(p) for p in owned)
            gen = torch.Generator(device=owned[0].device).manual_seed(seed + 1_000_003 * (i + 1))
            method.init_dummy_weights(module, gen, std)
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(seed)
        seed += 1
        if id(p) in quantized:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias") or not p.is_floating_point():
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


@torch.no_grad()
def load_model(
    model_dir: Path | str,
    info: ModelInfo,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: AttentionBackend,
    load_format: str = "auto",
    ops: ModelOps | None = None,
    mtp: bool = False,
    quantization: str | None = None,
    tp: TPGroup | None = None,
    pp: PPStage | None = None,
) -> LlamaForCausalLM:
    """Builds the model for ``info.architecture`` on ``device`` with weights from ``model_dir``.

    Quantized checkpoints: the method comes from the checkpoint's config; ``quantization``
    (``--quantization``) must agree with it. ``mtp``: also the checkpoint's multi-token-prediction
    layers (``model.mtp``, models/mtp.py), for speculative decoding.
    """
    model_dir, device = Path(model_dir), torch.device(device)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unsupported load_format {load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
    quant_config = get_quantization_config(model_dir, info.quantization_config, quantization,
                                           dummy=load_format == "dummy")
    files = [] if load_format == "dummy" else find_safetensors(model_dir)
    cls = get_model_class(info.architecture)
    with torch.device("meta"):
        model = cls(info, attn_backend, dtype, ops, tp=tp, **({"pp": pp} if pp is not None else {}))
        if mtp:
            model.mtp = MultiTokenPredictor(info, attn_backend, dtype, model.ops, model.model.rotary_emb,
                                            model.model.embed_tokens, tp)
        if quant_config is not None:
            set_linear_methods(model, quant_config)
    materialize(model, device)
    model.init_buffers()
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_safetensors_weights(model, model_dir, files)
    if quant_config is not None:
        for module in model.modules():
            if isinstance(module, FusedLinear) and module.linear_method is not None:
                module.linear_method.process_weights_after_loading(module)
            if isinstance(module, FusedMoE) and module.quant_method is not None:
                module.quant_method.process_weights_after_loading(module)
    return model.eval()


def set_linear_methods(model: LlamaForCausalLM, quant_config: QuantizationConfig) -> None:
    """Gives each linear the method the config picks for it (a tied lm_head stays dense), and each
    layer's routed experts theirs (ValueError naming the experts when the config has none for them)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            layer = name.removesuffix(".mlp.experts")
            moe_method = quant_config.get_moe_method(name, expert_checkpoint_modules(model.info, layer))
            if moe_method is not None:
                module.set_quant_method(moe_method)
            continue
        if not isinstance(module, FusedLinear) or (name == "lm_head" and model.info.tie_word_embeddings):
            continue
        if name.startswith("mtp.") and name.endswith(UNQUANTIZED_MTP_LINEARS):
            continue  # stored unquantized beside quantized decoder blocks (vLLM loads them so)
        shard_names = [n.removesuffix(".weight") for n in model.checkpoint_names(f"{name}.weight")]
        method = quant_config.get_linear_method(name, shard_names)
        if method is not None:
            module.set_linear_method(method)
