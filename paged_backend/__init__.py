"""paged-backend: a small paged-KV LLM inference engine (PagedAttention, continuous
batching, prefix caching) with adapters for BentoML and Triton Inference Server."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "LLMEngine", "InvalidRequestError"]

if TYPE_CHECKING:
    from paged_backend.config import EngineConfig
    from paged_backend.engine.async_engine import AsyncEngine
    from paged_backend.engine.llm import LLM
    from paged_backend.engine.llm_engine import LLMEngine
    from paged_backend.errors import InvalidRequestError
    from paged_backend.outputs import CompletionOutput, RequestOutput
    from paged_backend.sampling_params import SamplingParams

_LAZY = {
    "LLM": "paged_backend.engine.llm",
    "AsyncEngine": "paged_backend.engine.async_engine",
    "EngineConfig": "paged_backend.config",
    "LLMEngine": "paged_backend.engine.llm_engine",
    "SamplingParams": "paged_backend.sampling_params",
    "RequestOutput": "paged_backend.outputs",
    "CompletionOutput": "paged_backend.outputs",
    "InvalidRequestError": "paged_backend.errors",
}


def __getattr__(name: str):
    """Lazy exports, so ``import paged_backend`` stays cheap (no torch until needed)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paged_backend' has no attribute {name!r}")
