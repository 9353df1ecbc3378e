"""What the engine needs to know about a checkpoint, read once from its config.json.

``ModelInfo.from_dir`` normalises the HF config variants (transformers 4 vs 5 key names,
``rope_scaling`` vs ``rope_parameters``, int vs list eos ids) so that nothing downstream
parses config.json again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_backend.kernels.rotary_ref import yarn_mscale
from paged_backend.models.moe_routing import RoutingConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
                           "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                           "Glm4MoeLiteForCausalLM")
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                       "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                       "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                       "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}
_MISTRAL_ATTENTION = ("MistralForCausalLM", "MixtralForCausalLM")  # no attention bias, a window on every layer
_QWEN3_ATTENTION = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # q/k norm
_GLM4_MOE = "Glm4MoeForCausalLM"  # q/k/v bias (o_proj none), q/k norm if use_qk_norm, partial rotary
# GLM-4 dense (glm-4-9b-chat-hf; GLM-4-0414 adds norms on the sublayer outputs): q/k/v bias (o_proj none),
# partial interleaved rotary, gate|up stored as one tensor
_GLM_DENSE = ("GlmForCausalLM", "Glm4ForCausalLM")
_GLM = (*_GLM_DENSE, _GLM4_MOE)
# multi-head latent attention (models/mla.py), interleaved rotary on the rope dims, routed + shared experts
# after the first first_k_dense_replace dense layers
# (GLM-4.7-Flash, Glm4MoeLiteForCausalLM: DeepSeek-V3's layout, its dense / sparse layers listed in mlp_layer_types)
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
_SHARED_EXPERT_MOE = (_GLM4_MOE, *_DEEPSEEK)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MLAInfo:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3): per token one latent of ``kv_lora_rank``
    (normed) plus one shared rotary key of ``qk_rope_head_dim`` is cached; per head, q and k have
    ``qk_nope_head_dim`` + ``qk_rope_head_dim`` dims and v ``v_head_dim``."""

    q_lora_rank: int | None  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What one token caches per layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelInfo:
    """Architecture facts of one Llama-family checkpoint (shapes, rope, norms, special tokens)."""

    architecture: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None = plain RoPE; else has "rope_type" (linear, llama3)
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always; the GLM families' ``attention_bias``)
    o_proj_bias: bool  # bias on o_proj (Llama/Qwen3 ``attention_bias``; never Qwen2/Mistral/GLM)
    mlp_bias: bool  # Llama ``mlp_bias``
    qk_norm: bool  # Qwen3 (GLM-4.5 with use_qk_norm): per-head RMSNorm on q and k before RoPE
    sliding_window: int | None  # None unless some layer uses it
    layer_sliding_windows: tuple[int | None, ...]  # per layer: its window, or None (full attention)
    dtype: torch.dtype | None  # the checkpoint's dtype, None if config.json does not say
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quantization_config: dict[str, Any] | None
    # mixture of experts (all zero / empty for a dense model)
    num_experts: int = 0  # routed experts of each MoE layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size
    moe_layers: tuple[bool, ...] = ()  # per layer: its MLP is routed experts
    routing: RoutingConfig | None = None
    shared_expert_intermediate_size: int = 0  # GLM-4.5: a dense MLP beside the routed experts (0: none)
    rotary_dim: int | None = None  # the first dims of each q/k head that RoPE rotates (None: all head_dim)
    rope_interleaved: bool = False  # GLM, GLM-4: RoPE turns adjacent dims (2i, 2i+1), not neox halves
    sublayer_output_norms: bool = False  # GLM-4-0414: RMSNorm on the attention and MLP outputs before each residual add
    fused_gate_up_checkpoint: bool = False  # GLM, GLM-4: the checkpoint stores mlp.gate_up_proj (gate rows, then up)
    num_mtp_layers: int = 0  # multi-token-prediction layers stored after the decoder's (not run)
    mla: MLAInfo | None = None  # DeepSeek: multi-head latent attention (head_dim is then its q/k head dim)

    @property
    def rope_dim(self) -> int:
        """The dims of each q/k head RoPE rotates (the GLM families: half of head_dim; the rest passes through)."""
        return self.rotary_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dir(cls, path: Path | str) -> ModelInfo:
        """Reads ``path/config.json`` (+ ``generation_config.json`` for eos ids)."""
        path = Path(path)
        cfg = _read_json(path / "config.json", required=True)
        gen = _read_json(path / "generation_config.json", required=False) or {}
        return cls.from_config(cfg, gen, source=str(path / "config.json"))

    @classmethod
    def from_config(cls, cfg: dict[str, Any], gen: dict[str, Any] | None = None, source: str = "config") -> ModelInfo:
        gen = gen or {}
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(model_type, "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architecture {arch or model_type or '<none>'!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            intermediate = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"{source}: missing required key {e.args[0]!r}") from None
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        theta, scaling = _rope(cfg, source)
        mla = _mla(cfg, scaling, source) if arch in _DEEPSEEK else None
        qwen2 = model_type == "qwen2" or arch == "Qwen2ForCausalLM"
        mistral = arch in _MISTRAL_ATTENTION
        glm = arch in _GLM
        attn_bias = bool(cfg.get("attention_bias", arch in _GLM_DENSE)) and not mistral  # transformers' defaults
        head_dim = mla.qk_head_dim if mla else int(cfg.get("head_dim") or hidden // heads)
        windows = _layer_windows(cfg, arch, num_layers)
        used = [w for w in windows if w is not None]
        return cls(
            architecture=arch,
            model_type=model_type,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=intermediate,
            vocab_size=vocab,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qwen2 or attn_bias,
            o_proj_bias=attn_bias and not qwen2 and not glm,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch in _QWEN3_ATTENTION or (arch == _GLM4_MOE and bool(cfg.get("use_qk_norm"))),
            sliding_window=max(used) if used else None,
            layer_sliding_windows=tuple(windows),
            dtype=_dtype(cfg.get("dtype") or cfg.get("torch_dtype"), source),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), gen.get("eos_token_id")),
            bos_token_id=next((b for b in (cfg.get("bos_token_id"), gen.get("bos_token_id")) if b is not None), None),
            quantization_config=cfg.get("quantization_config") or None,
            rotary_dim=mla.qk_rope_head_dim if mla else _rotary_dim(cfg, arch, head_dim, source),
            rope_interleaved=arch in _GLM_DENSE or mla is not None,
            sublayer_output_norms=arch == "Glm4ForCausalLM",
            fused_gate_up_checkpoint=arch in _GLM_DENSE,
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0) if arch in _SHARED_EXPERT_MOE else 0,
            mla=mla,
            **_moe_fields(cfg, arch, num_layers, intermediate, source),
        )


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"no config.json in model directory {str(path.parent)!r}")
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _mla(cfg: dict[str, Any], scaling: dict[str, Any] | None, source: str) -> MLAInfo:
    """DeepSeek's attention shapes, and its softmax scale with YaRN's mscale_all_dim correction."""
    try:
        nope, rope, v, kv_lora = (int(cfg[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                        "kv_lora_rank"))
    except KeyError as e:
        raise ValueError(f"{source}: missing required key {e.args[0]!r}") from None
    if rope % 2 or min(nope, rope, v, kv_lora) <= 0:
        raise ValueError(f"{source}: MLA dims must be positive and qk_rope_head_dim even, got qk_nope_head_dim "
                         f"{nope}, qk_rope_head_dim {rope}, v_head_dim {v}, kv_lora_rank {kv_lora}")
    scale = (nope + rope) ** -0.5
    if scaling and scaling["rope_type"] == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    q_lora = cfg.get("q_lora_rank")
    return MLAInfo(None if q_lora is None else int(q_lora), kv_lora, nope, rope, v, scale)


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``;
    YaRN without ``factor`` takes max_position_embeddings / original_max_position_embeddings."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", legacy.pop("rope_theta", 10000.0))))
    scaling = params or legacy
    scaling.pop("partial_rotary_factor", None)  # not a scaling: _rotary_dim reads it
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k != "type"}
    scaling["rope_type"] = rope_type
    if rope_type == "yarn":
        if "original_max_position_embeddings" not in scaling:
            raise ValueError(f"{source}: yarn rope scaling needs original_max_position_embeddings")
        if scaling.get("factor") is None:
            scaling["factor"] = float(cfg.get("max_position_embeddings", 2048)) / float(
                scaling["original_max_position_embeddings"])
    return theta, scaling


def _rotary_dim(cfg: dict[str, Any], arch: str, head_dim: int, source: str) -> int | None:
    """The GLM families' ``partial_rotary_factor`` (``rope_parameters`` or top level; transformers' default
    0.5) as a dim count; None (all of head_dim) for the other families."""
    if arch not in _GLM:
        return None
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    dim = int(head_dim * float(0.5 if factor is None else factor))
    if dim <= 0 or dim > head_dim or dim % 2:
        raise ValueError(f"{source}: partial_rotary_factor {factor} gives rotary dim {dim}, which must be even "
                         f"and in (0, head_dim={head_dim}]")
    return None if dim == head_dim else dim


def _layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> list[int | None]:
    """Per-layer sliding window: Mistral uses it on every layer; Qwen only with use_sliding_window."""
    window = cfg.get("sliding_window")
    if arch in _MISTRAL_ATTENTION or (arch == "Qwen3MoeForCausalLM" and cfg.get("use_sliding_window")):
        return [int(window) if window else None] * num_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", num_layers)) else "full_attention"
            for i in range(num_layers)
        ]
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [None] * num_layers


def _moe_fields(cfg: dict[str, Any], arch: str, num_layers: int, intermediate: int, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields: which layers route, to how many experts of what size."""
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", *_SHARED_EXPERT_MOE):
        return {}
    try:
        routing = RoutingConfig.from_hf_config(cfg)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if arch == "MixtralForCausalLM":
        return dict(num_experts=routing.num_experts, num_experts_per_tok=routing.num_experts_per_tok,
                    moe_intermediate_size=intermediate, moe_layers=(True,) * num_layers, routing=routing)
    try:
        size = int(cfg["moe_intermediate_size"])
    except KeyError:
        raise ValueError(f"{source}: missing required key 'moe_intermediate_size'") from None
    fields = dict(num_experts=routing.num_experts, num_experts_per_tok=routing.num_experts_per_tok,
                  moe_intermediate_size=size, routing=routing)
    if arch in _SHARED_EXPERT_MOE:  # the first first_k_dense_replace layers dense; shared experts beside the routed
        if int(cfg.get("moe_layer_freq") or 1) != 1:
            raise ValueError(f"{source}: moe_layer_freq {cfg['moe_layer_freq']} is not supported (every layer from "
                             "first_k_dense_replace on routes, as transformers runs it)")
        first, shared = (int(1 if cfg.get(k) is None else cfg[k]) for k in ("first_k_dense_replace", "n_shared_experts"))
        layers = tuple(i >= first for i in range(num_layers))
        types = cfg.get("mlp_layer_types")
        if types is not None:  # GLM-4.7-Flash: "dense" / "sparse" per layer
            if len(types) != num_layers or set(types) - {"dense", "sparse"}:
                raise ValueError(f"{source}: mlp_layer_types must give 'dense' or 'sparse' for each of the "
                                 f"{num_layers} layers, got {types}")
            layers = tuple(t == "sparse" for t in types)
        return dict(fields, moe_layers=layers, shared_expert_intermediate_size=size * shared)
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    layers = tuple(i not in dense and routing.num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return dict(fields, moe_layers=layers)


def _dtype(name: str | None, source: str) -> torch.dtype | None:
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"{source}: unsupported checkpoint dtype {name!r}")
    return _DTYPES[name]


def _eos_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        for i in [v] if isinstance(v, int) else (v or []):
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
