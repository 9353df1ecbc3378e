"""Engine flags with vLLM's names (``--max-num-seqs``, ``--kv-cache-dtype fp8`` ...), each mapping
one to one onto an :class:`EngineConfig` field; shared by the CLI's subcommands and benchmarks."""

from __future__ import annotations

import argparse
from typing import Any

from paged_backend.config import EngineConfig

# flag -> (type, help); the destination is the EngineConfig field of the same name
_ENGINE_FLAGS: dict[str, tuple[Any, str]] = {
    "--dtype": (str, "auto | float32 | bfloat16 | float16"),
    "--device": (str, "auto | cpu | cuda"),
    "--max-model-len": (int, "context length (prompt + output)"),
    "--max-num-seqs": (int, "max requests per step"),
    "--max-num-batched-tokens": (int, "token budget per step"),
    "--block-size": (int, "KV block size (16, 32, 64)"),
    "--kv-cache-dtype": (str, "auto | fp8"),
    "--gpu-memory-utilization": (float, "fraction of GPU memory to use"),
    "--kv-cache-memory-bytes": (int, "explicit KV-cache budget in bytes"),
    "--num-gpu-blocks-override": (int, "exact number of KV blocks"),
    "--tensor-parallel-size": (int, "GPUs to split the model over"),
    "--quantization": (str, "awq | gptq | fp8 | compressed-tensors (checked against the checkpoint)"),
    "--load-format": (str, "auto | safetensors | dummy (random weights)"),
    "--attention-backend": (str, "auto | torch | triton"),
    "--max-cudagraph-capture-size": (int, "largest decode batch run as a CUDA graph (default 1024, capped at --max-num-seqs)"),
    "--seed": (int, "engine seed"),
    "--served-model-name": (str, "name reported by the API"),
    "--log-stats-interval": (float, "seconds between stats lines (0: off)"),
}
_ENGINE_BOOLS = {
    "--enable-prefix-caching": ("enable_prefix_caching", True),
    "--no-enable-prefix-caching": ("enable_prefix_caching", False),
    "--enable-chunked-prefill": ("enable_chunked_prefill", True),
    "--no-enable-chunked-prefill": ("enable_chunked_prefill", False),
    "--calculate-kv-scales": ("calculate_kv_scales", True),
    "--disable-log-stats": ("disable_log_stats", True),
    "--enforce-eager": ("enforce_eager", True),
    "--skip-tokenizer-init": ("skip_tokenizer_init", True),
    "--enable-expert-parallel": ("enable_expert_parallel", True),
    "--async-scheduling": ("async_scheduling", True),
    "--no-async-scheduling": ("async_scheduling", False),
}


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("--model", default="SmolLM2-135M-Instruct", help="HF model dir or the default model")
    for flag, (typ, hlp) in _ENGINE_FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=hlp)
    for flag, (dest, value) in _ENGINE_BOOLS.items():
        p.add_argument(flag, dest=dest, action="store_const", const=value, default=None)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    fields = {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields and v is not None}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig(**fields)
