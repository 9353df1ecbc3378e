"""Random-weights model directories of real models' shapes (``--load-format dummy`` runs):
``config.json`` by shape name, and optionally an HF tokenizer padded to the shape's vocabulary.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

# model shapes by name (the shapes of docs/BENCHMARKS.md's W1 / W2 / W4 workloads); an entry may name
# its own architecture and model_type (the default: a Llama) and a quantization_config
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=8192),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000.0,
                          max_position_embeddings=40960, rms_norm_eps=1e-6),
}
# W3: DeepSeek-V2-Lite (15.7B total, 2.7B active): latent attention (512 + 64 cached a token), 64 routed experts
# top-6 + 2 shared after one dense layer, YaRN
MODEL_SHAPES["deepseek-v2-lite"] = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, vocab_size=102400,
    max_position_embeddings=163840, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
    first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
    norm_topk_prob=False, routed_scaling_factor=1.0, rope_theta=10000.0, rms_norm_eps=1e-6,
    rope_scaling=dict(type="yarn", factor=40.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
                      original_max_position_embeddings=4096),
    bos_token_id=100000, eos_token_id=100001, tie_word_embeddings=False)
# Qwen3-30B-A3B-FP8's release: the same shapes, every decoder linear and expert block-wise e4m3 (run with
# --quantization fp8; the dummy weights then fill that format)
MODEL_SHAPES["qwen3-30b-a3b-fp8"] = dict(
    MODEL_SHAPES["qwen3-30b-a3b"],
    quantization_config=dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128]))


def write_shape_config(name: str, tokenizer_from: str | os.PathLike[str] | None = None) -> str:
    """A model dir for ``--load-format dummy`` runs: config.json, and a tokenizer if asked for.

    ``tokenizer_from`` is an HF tokenizer dir (byte-level BPE) copied in with its vocabulary
    padded to the shapes' vocab size (:func:`pad_tokenizer`), so that text prompts work and
    every sampled id detokenizes; without it the engine takes token-id prompts only.
    """
    d = tempfile.mkdtemp(prefix=f"pb_{name}_")
    cfg = {**dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                  attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
           **MODEL_SHAPES[name]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    if tokenizer_from is not None:
        pad_tokenizer(tokenizer_from, d, MODEL_SHAPES[name]["vocab_size"])
    return d


TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
_PAD_PREFIX = "\u0120"  # byte-level BPE's character for the space byte


def _pad_codes(taken: set[str], n: int) -> list[str]:
    """``n`` strings 'Ġ' + lower-case letters (3 of them, then 4, ...) that are not in ``taken``."""
    import itertools
    import string

    out: list[str] = []
    if n <= 0:
        return out
    for length in itertools.count(3):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            piece = _PAD_PREFIX + "".join(letters)
            if piece not in taken:
                out.append(piece)
                if len(out) == n:
                    return out
    raise AssertionError("unreachable")


def pad_tokenizer(src: str | os.PathLike[str], dst: str | os.PathLike[str], vocab_size: int) -> int:
    """Copy the HF tokenizer in ``src`` to ``dst`` with ids up to ``vocab_size`` - 1 in its vocabulary.

    A random-weights model of a real model's shapes samples any id below its vocab size;
    a smaller tokenizer (SmolLM2's 49152 for Llama-3's 128256) pads its byte-level BPE
    vocabulary with entries 'Ġ' + a letter code (ids the tokenizer has neither in its
    vocabulary nor as added tokens). BPE merges only build strings that are already in the
    vocabulary, so encoding any text gives the same ids as before, and each new id decodes
    to a space and its letters. Copies tokenizer.json and the files in ``TOKENIZER_FILES``
    that exist; returns the number of entries added.
    """
    import shutil
    from pathlib import Path

    src, dst = Path(src), Path(dst)
    with open(src / "tokenizer.json", encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model") or {}
    decoder = (spec.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        raise ValueError(f"{src}: only byte-level BPE tokenizers can be padded "
                         f"(model {model.get('type')!r}, decoder {decoder!r})")
    vocab: dict[str, int] = model["vocab"]
    used = set(vocab.values()) | {int(t["id"]) for t in spec.get("added_tokens") or []}
    if max(used) >= vocab_size:
        raise ValueError(f"{src}: the tokenizer has id {max(used)}, not below vocab_size {vocab_size}")
    free = [i for i in range(vocab_size) if i not in used]
    vocab.update(zip(_pad_codes(set(vocab), len(free)), free, strict=True))
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    with open(dst / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    return len(free)


def add_model_shapes_args(p, tokenizer: bool = True) -> None:
    """``--model-shapes`` (and with ``tokenizer``, ``--tokenizer-from``) on a bench subcommand's parser."""
    p.add_argument("--model-shapes", choices=sorted(MODEL_SHAPES), default=None,
                   help="random weights of these shapes (implies --load-format dummy)")
    if tokenizer:
        p.add_argument("--tokenizer-from", default=None, metavar="DIR",
                       help="with --model-shapes: an HF tokenizer dir copied in, padded to the shapes' vocabulary "
                            "(structured outputs need one)")


def model_shapes_overrides(args) -> dict[str, Any]:
    """The engine fields ``--model-shapes`` sets: its written config dir and dummy weights ({} without it)."""
    if not args.model_shapes:
        return {}
    return {"model": write_shape_config(args.model_shapes, getattr(args, "tokenizer_from", None)),
            "load_format": "dummy"}
