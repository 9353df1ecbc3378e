"""One validated engine configuration, built once and passed down.

Field names follow vLLM's CLI flags (``--max-num-seqs`` -> ``max_num_seqs``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field("SmolLM2-135M-Instruct", description="HF model dir or the default model's name")
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    enable_chunked_prefill: bool = True
    block_size: Literal[16, 32, 64] = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    calculate_kv_scales: bool = False
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="explicit KV budget (CPU default: 1/4 of free RAM, max 4 GiB)")
    num_gpu_blocks_override: int | None = Field(None, ge=2)
    tensor_parallel_size: int = Field(1, ge=1)
    quantization: str | None = None
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    seed: int = 0
    log_stats_interval: float = Field(10.0, ge=0.0, description="seconds between stats log lines; 0 = off")
    disable_log_stats: bool = False

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.max_num_batched_tokens is not None and not self.enable_chunked_prefill:
            if self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "max_num_batched_tokens must be >= max_model_len when chunked prefill is disabled"
                )
        return self

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
