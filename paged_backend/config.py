"""One validated engine configuration, built once and passed down.

Field names follow vLLM's CLI flags (``--max-num-seqs`` -> ``max_num_seqs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paged_backend.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field("SmolLM2-135M-Instruct", description="HF model dir or the default model's name")
    tokenizer: str | None = None
    skip_tokenizer_init: bool = Field(False, description="load no tokenizer: token-id prompts only, outputs "
                                      "without text (vLLM's flag)")
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int | None = Field(None, ge=1, description="default: 1024 on GPUs of >= 70 GiB, else 256")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="default: 16384 on GPUs of >= 70 GiB, 8192 on smaller GPUs, 4096 on the CPU")
    enable_chunked_prefill: bool = True
    block_size: Literal[16, 32, 64] = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    calculate_kv_scales: bool = False
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="explicit KV budget (CPU default: 1/4 of free RAM, max 4 GiB)")
    num_gpu_blocks_override: int | None = Field(None, ge=2)
    swap_space: float = Field(0.0, ge=0.0, description="GiB of host memory (pinned on CUDA) per rank for KV blocks "
                              "of requests preempted by swap; 0 = no host tier (vLLM's flag)")
    preemption_mode: Literal["recompute", "swap"] | None = Field(
        None, description="how a preempted request gives up its KV blocks: recompute (freed, recomputed later) or "
        "swap (copied to the host tier and back); default: swap when there is host space and the request has "
        "computed at least 256 tokens, else recompute")
    tensor_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = Field(False, description="MoE models: each tensor-parallel rank holds whole "
                                         "experts (E / tensor_parallel_size of them) instead of a slice of every "
                                         "expert; a no-op at tensor_parallel_size 1 and on dense models (vLLM's flag)")
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages: contiguous decoder layers per stage, "
                                        "each a tensor_parallel_size group of its own (vLLM's flag)")
    pp_layer_partition: str | None = Field(None, description="decoder layers per pipeline stage, comma-separated "
                                           "('3,1'); default: as even as possible, the first stages one more")
    quantization: str | None = None
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    enforce_eager: bool = Field(False, description="never use CUDA graphs")
    async_scheduling: bool | None = Field(None, description="schedule step t+1 while step t runs on the device "
                                          "(default: on for one CUDA device without speculative "
                                          "decoding, off on the CPU)")
    max_cudagraph_capture_size: int = Field(1024, ge=1, description="largest decode batch captured as a CUDA graph "
                                            "(capped at max_num_seqs)")
    speculative_config: SpeculativeConfig | None = Field(
        None, description="speculative decoding, vLLM's keys: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}")
    seed: int = 0
    log_stats_interval: float = Field(10.0, ge=0.0, description="seconds between stats log lines; 0 = off")
    disable_log_stats: bool = False
    engine_core_process: bool = Field(False, description="step the engine in a process of its own, fed over a pipe, "
                                      "so the serving process's event loop and the engine loop do not share a GIL "
                                      "(default: a thread of the serving process)")
    engine_core_shared: bool = Field(False, description="one engine core process for every front-end process of "
                                     "this configuration and GPU set (BentoML workers > 1, Triton instance_group "
                                     "count > 1): the first starts it, the others attach; implies "
                                     "engine_core_process")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.preemption_mode == "swap" and self.swap_space <= 0:
            raise ValueError("preemption_mode 'swap' needs swap_space > 0 (GiB of host memory for the blocks)")
        if self.swap_space > 0 and self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise ValueError("swap_space is not supported with speculative_config method 'draft_model' (the draft "
                             "model's KV cache has no host tier)")
        if self.pipeline_parallel_size > 1:
            self._check_pipeline()
        elif self.pp_layer_partition is not None:
            raise ValueError("pp_layer_partition needs pipeline_parallel_size > 1")
        if self.max_num_batched_tokens is not None and not self.enable_chunked_prefill:
            if self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "max_num_batched_tokens must be >= max_model_len when chunked prefill is disabled"
                )
        return self

    def _check_pipeline(self) -> None:
        """What pipeline parallelism does not run (yet): refused by name."""
        for what, on in (("speculative_config", self.speculative_config is not None),
                         ("swap_space", self.swap_space > 0), ("async_scheduling", bool(self.async_scheduling))):
            if on:
                raise ValueError(f"{what} is not supported with pipeline_parallel_size > 1")
        if self.pp_layer_partition is not None:
            parts = self.pp_layer_partition.split(",")
            if len(parts) != self.pipeline_parallel_size or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"pp_layer_partition {self.pp_layer_partition!r}: needs "
                                 f"{self.pipeline_parallel_size} positive layer counts, one per pipeline stage")

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass(frozen=True)
class Limits:
    """The step limits a config resolves to on one device (the engine and every runner agree)."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


BIG_GPU_BYTES = 70 << 30  # vLLM's threshold for its larger defaults (H100/H200-class cards)


def resolve_limits(config: EngineConfig, max_position_embeddings: int, device: torch.device) -> Limits:
    """Defaults as vLLM's offline ``LLM`` picks them: more sequences and tokens per step on big GPUs."""
    if config.max_model_len and config.max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {max_position_embeddings}")
    max_model_len = min(config.max_model_len or max_position_embeddings, max_position_embeddings)
    if device.type == "cuda":
        import torch

        big = torch.cuda.get_device_properties(device).total_memory >= BIG_GPU_BYTES
        seqs, tokens = (1024, 16384) if big else (256, 8192)
    else:  # vLLM's CPU defaults for the offline LLM class (its API server takes 2048 tokens)
        seqs, tokens = 256, 4096
    max_num_seqs = config.max_num_seqs or seqs
    budget = config.max_num_batched_tokens or max(tokens, max_num_seqs)
    if not config.enable_chunked_prefill:
        budget = max(budget, max_model_len)
    return Limits(max_model_len, max_num_seqs, budget)
