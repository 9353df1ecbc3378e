"""Engine flags with vLLM's names (``--max-num-seqs``, ``--kv-cache-dtype fp8`` ...), each mapping
one to one onto an :class:`EngineConfig` field; shared by the CLI's subcommands and benchmarks."""

from __future__ import annotations

import argparse
import json
from typing import Any

from paged_backend.config import EngineConfig


def json_object(text: str) -> dict[str, Any]:
    """A JSON object flag value (argparse reports the ValueError as an invalid value)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


json_object.__name__ = "JSON object"  # argparse names the type in its error

# flag -> (type, help); the destination is the EngineConfig field of the same name
_ENGINE_FLAGS: dict[str, tuple[Any, str]] = {
    "--dtype": (str, "auto | float32 | bfloat16 | float16 (default: auto, the checkpoint's dtype; float32 on "
                     "the CPU)"),
    "--device": (str, "auto | cpu | cuda (default: auto, CUDA when available)"),
    "--max-model-len": (int, "context length, prompt + output (default: the model's max_position_embeddings)"),
    "--max-num-seqs": (int, "max requests per step (default: 1024 on GPUs of 70 GiB or more, else 256)"),
    "--max-num-batched-tokens": (int, "token budget per step (default: 16384 on GPUs of 70 GiB or more, 8192 on "
                                      "smaller GPUs, 4096 on the CPU)"),
    "--block-size": (int, "KV block size: 16, 32 or 64 (default: 16)"),
    "--kv-cache-dtype": (str, "auto | fp8 (default: auto, the model's dtype)"),
    "--gpu-memory-utilization": (float, "fraction of GPU memory to use (default: 0.9)"),
    "--kv-cache-memory-bytes": (int, "explicit KV-cache budget in bytes (default: GPU: what "
                                     "--gpu-memory-utilization leaves; CPU: 1/4 of free RAM, at most 4 GiB and at "
                                     "most --max-num-seqs requests of --max-model-len tokens)"),
    "--num-gpu-blocks-override": (int, "exact number of KV blocks (default: sized from the memory budget)"),
    "--swap-space": (float, "GiB of host memory per GPU for the KV blocks of requests preempted by swap "
                            "(default: 0, no host tier)"),
    "--preemption-mode": (str, "recompute | swap: how a preempted request gives up its KV blocks (default: swap "
                               "when --swap-space is set and the request has computed >= 256 tokens, else "
                               "recompute)"),
    "--tensor-parallel-size": (int, "GPUs to split the model over (default: 1)"),
    "--pipeline-parallel-size": (int, "pipeline stages, each of --tensor-parallel-size GPUs, layers split "
                                      "contiguously between them (default: 1)"),
    "--pp-layer-partition": (str, "decoder layers per pipeline stage, comma-separated, e.g. 3,1 (default: as even "
                                  "as possible)"),
    "--quantization": (str, "awq | gptq | fp8 | compressed-tensors, checked against the checkpoint (default: "
                            "from the checkpoint)"),
    "--load-format": (str, "auto | safetensors | dummy, random weights (default: auto)"),
    "--attention-backend": (str, "auto | torch | triton (default: auto, triton on CUDA, torch elsewhere)"),
    "--max-cudagraph-capture-size": (int, "largest decode batch run as a CUDA graph (default: 1024, capped at "
                                          "--max-num-seqs)"),
    "--seed": (int, "engine seed (default: 0)"),
    "--served-model-name": (str, "name reported by the API (default: the model argument)"),
    "--log-stats-interval": (float, "seconds between stats lines, 0 is off (default: 10)"),
    "--speculative-config": (json_object, "speculative decoding as JSON, vLLM's keys: '{\"method\": \"ngram\", "
                                          "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
                                          "\"prompt_lookup_max\": 5}' (default: off)"),
}
# flag -> (destination, value, help)
_ENGINE_BOOLS: dict[str, tuple[str, bool, str]] = {
    "--enable-prefix-caching": ("enable_prefix_caching", True, "reuse the KV blocks of shared prompt prefixes "
                                "(default: on)"),
    "--no-enable-prefix-caching": ("enable_prefix_caching", False, "turn prefix caching off"),
    "--enable-chunked-prefill": ("enable_chunked_prefill", True, "split long prompts over steps (default: on)"),
    "--no-enable-chunked-prefill": ("enable_chunked_prefill", False, "turn chunked prefill off"),
    "--calculate-kv-scales": ("calculate_kv_scales", True, "fp8 KV cache: compute k/v scales from the first "
                              "prompt instead of the checkpoint's (default: off)"),
    "--disable-log-stats": ("disable_log_stats", True, "no periodic stats line (default: logged)"),
    "--enforce-eager": ("enforce_eager", True, "never use CUDA graphs (default: decode steps replay them on CUDA)"),
    "--skip-tokenizer-init": ("skip_tokenizer_init", True, "load no tokenizer: token-id prompts only, no text "
                              "(default: off)"),
    "--enable-expert-parallel": ("enable_expert_parallel", True, "MoE under tensor parallelism: whole experts "
                                 "per rank (default: off)"),
    "--async-scheduling": ("async_scheduling", True, "schedule step t+1 while step t runs (default: on for one "
                           "CUDA device without --speculative-config, off on the CPU; with it, requests take "
                           "turns in half-size steps)"),
    "--no-async-scheduling": ("async_scheduling", False, "turn async scheduling off"),
    "--engine-core-process": ("engine_core_process", True, "step the engine in a process of its own (serving: "
                              "the HTTP front end and the engine loop then do not share a GIL; default: a "
                              "thread of the serving process)"),
    "--engine-core-shared": ("engine_core_shared", True, "one engine core process shared by every front-end "
                             "process of this configuration (the first starts it, the others attach; default: "
                             "one core per front end)"),
}


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("--model", default="SmolLM2-135M-Instruct",
                       help="HF model dir or the default model (default: SmolLM2-135M-Instruct)")
    for flag, (typ, hlp) in _ENGINE_FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=hlp)
    for flag, (dest, value, hlp) in _ENGINE_BOOLS.items():
        p.add_argument(flag, dest=dest, action="store_const", const=value, default=None, help=hlp)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    fields = {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields and v is not None}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig(**fields)
