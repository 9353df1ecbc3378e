"""Building blocks of the BentoML services in ``bentos/`` (BentoVLLM style).

A bento's ``service.py`` reads its engine options with ``bentoml.use_arguments(ServeArgs)``
(``bentoml serve --arg max_model_len=4096``, or ``[tool.bentoml.build.args]``), mounts the
OpenAI app at ``/v1`` and decorates its class with ``service_config(args)``. Nothing here
loads a model: BentoML's parent process imports the service module too, and only the
worker's ``__init__`` starts the engine (in the background, so the port answers and
``/readyz`` says 503 until the model is loaded).

With ``workers`` > 1 (``--arg workers=2``) every worker is a thin front end (HTTP, OpenAI layer,
tokenizer) and the model loads once: the engine steps in one shared engine core process
(``engine_core_shared``), started by the first worker and attached to by the others; it exits when
the last worker has stopped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ConfigDict, Field

from paged_backend.config import EngineConfig

from .api import AdapterError, EngineAdapter, build_sampling_params
from .serving_options import ServingOptions

SERVICE_DEFAULT_NAME = "paged-llm"


class ServeArgs(EngineConfig, ServingOptions):
    """Engine options (EngineConfig's fields, vLLM's names), the front end's (ServingOptions:
    API keys, limits, privacy) and how BentoML runs the service."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    service_name: str = Field(SERVICE_DEFAULT_NAME, description="the BentoML service name")
    gpu_type: str | None = Field(None, description="BentoCloud GPU type, e.g. nvidia-h100-80gb")
    workers: int = Field(1, ge=1, description="BentoML worker processes; more than 1: front ends of one shared "
                         "engine core process (the model loads once)")
    timeout: int = Field(900, ge=1, description="seconds to the first byte of a response")
    max_concurrency: int | None = Field(None, ge=1, description="requests admitted at once (None: no cap)")
    drain_timeout: float = Field(30.0, ge=0.0, description="seconds on shutdown for in-flight requests")
    trace_streams: bool = Field(False, description="let BentoML's OpenTelemetry middleware trace the streaming "
                                "endpoints (a span per streamed chunk; off: those URLs are excluded)")

    def engine_config(self) -> EngineConfig:
        """The engine's options; several workers share one engine core process."""
        config = EngineConfig(**self.model_dump(include=set(EngineConfig.model_fields)))
        if self.workers > 1 and not config.engine_core_shared:
            config = config.model_copy(update={"engine_core_shared": True})
        return config

    def wants_gpu(self) -> bool:
        """GPU resources are requested where the engine will use CUDA."""
        if self.device == "cpu":
            return False
        if self.device == "cuda":
            return True
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
            return False
        import torch

        return torch.cuda.is_available()


# The streaming endpoints (regexes searched in the full URL, as OpenTelemetry's ExcludeList does).
# BentoML's OpenTelemetry ASGI middleware opens and ends an "http send" span for every chunk a
# response sends, sampled or not; on a stream that is one span per token and per stream, and it
# took about 40% of the event loop's time per streamed token (the loop that serves every stream).
STREAMING_URLS = (r"/v1/completions$", r"/v1/chat/completions$", r"/generate$")


def service_config(args: ServeArgs) -> dict[str, Any]:
    """Keyword arguments for ``@bentoml.service``: ``workers`` front ends (one engine), long timeouts.

    Unless ``trace_streams`` (``--arg trace_streams=true``), the streaming endpoints are left
    out of BentoML's tracing (``tracing.excluded_urls``; BentoML still traces every other URL).
    """
    traffic: dict[str, Any] = {"timeout": args.timeout}
    if args.max_concurrency is not None:
        traffic["max_concurrency"] = args.max_concurrency
    resources: dict[str, Any] = {}
    if args.wants_gpu():
        resources["gpu"] = args.tensor_parallel_size * args.pipeline_parallel_size
        if args.gpu_type:
            resources["gpu_type"] = args.gpu_type
    config: dict[str, Any] = {
        "name": args.service_name,
        "workers": args.workers,
        "traffic": traffic,
        "resources": resources,
        "labels": {"openai_endpoint": "/v1", "engine": "paged-backend", "model": args.name},
        "envs": [{"name": "BENTOML_DO_NOT_TRACK", "value": "true"}],
    }
    if not args.trace_streams:
        config["tracing"] = {"excluded_urls": list(STREAMING_URLS)}
    return config


def show_engine_logs() -> None:
    """The engine's INFO lines (its start-up lines, the periodic "Avg prompt throughput ..." line)
    in ``bentoml serve``'s log, as ``vllm serve`` prints them.

    BentoML's server logging keeps the root logger at WARNING; the ``paged_backend`` loggers go to
    INFO then, through BentoML's own handler and format. Quiet (``--quiet``) and debug modes, and a
    level set by the operator, are left as they are."""
    engine_logger = logging.getLogger("paged_backend")
    if engine_logger.level == logging.NOTSET and logging.getLogger().getEffectiveLevel() == logging.WARNING:
        engine_logger.setLevel(logging.INFO)


def merge_metrics(bentoml_metrics: str, engine_metrics: str) -> str:
    """BentoML's own Prometheus text followed by the engine's (vLLM names)."""
    if not engine_metrics:
        return bentoml_metrics
    sep = "" if not bentoml_metrics or bentoml_metrics.endswith("\n") else "\n"
    return bentoml_metrics + sep + engine_metrics


async def native_generate(adapter: EngineAdapter, prompt: str, *, chat: bool = True,
                          **sampling: Any) -> AsyncIterator[str]:
    """Text deltas of one request (the bento's own streaming endpoint, no OpenAI layer).

    ``chat`` wraps the prompt as one user message through the model's chat template.
    Refusals raise ``bentoml.exceptions.InvalidArgument`` (HTTP 400) before any text.
    """
    from bentoml.exceptions import BentoMLException, InvalidArgument, ServiceUnavailable

    try:
        params = build_sampling_params({k: v for k, v in sampling.items() if v is not None})
        source: str | list[int] = (await adapter.encode_chat_async([{"role": "user", "content": prompt}])
                                   if chat else prompt)
        stream = adapter.generate(source, params)
        first = await stream.__anext__()
    except StopAsyncIteration:
        return
    except AdapterError as err:
        exc: BentoMLException = (ServiceUnavailable(err.message) if err.kind == "unavailable"
                                 else InvalidArgument(err.message))
        raise exc from None
    try:
        for c in first.outputs:
            if c.index == 0 and c.text:
                yield c.text
        if first.finished:
            return
        async for delta in stream:
            for c in delta.outputs:
                if c.index == 0 and c.text:
                    yield c.text
    finally:
        await stream.aclose()
