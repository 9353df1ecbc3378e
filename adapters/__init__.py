"""Serving adapters: the framework-neutral adapter API, the OpenAI protocol layer, and
the BentoML and Triton Inference Server adapters built on them.

Installed as ``paged_backend.adapters``. Submodules import their framework lazily, so
``import paged_backend.adapters`` costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["AdapterError", "EngineAdapter", "build_sampling_params", "create_openai_app", "to_adapter_error"]

if TYPE_CHECKING:
    from .api import AdapterError, EngineAdapter, build_sampling_params, to_adapter_error
    from .openai_server import create_openai_app

_LAZY = {
    "AdapterError": "api",
    "EngineAdapter": "api",
    "build_sampling_params": "api",
    "to_adapter_error": "api",
    "create_openai_app": "openai_server",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
