"""A tiny random Llama for the benchmark tests: 2 layers, hidden 64, SmolLM2's tokenizer (its
49,152 ids, so every sampled id detokenizes); loaded with ``load_format="dummy"``."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 1,
          "eos_token_id": 2, "tie_word_embeddings": True}


def write_tiny_llama(d: Path) -> Path:
    """config.json and the tokenizer in ``d``; returns ``d``."""
    from smollm2 import model_dir

    from paged_backend.benchmarks.model_shapes import pad_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    pad_tokenizer(model_dir(), d, CONFIG["vocab_size"])
    return d
