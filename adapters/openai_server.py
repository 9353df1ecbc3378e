"""The OpenAI-compatible HTTP layer: a FastAPI router for ``/chat/completions``,
``/completions`` and ``/models`` (and vLLM's ``/tokenize``, ``/detokenize``, ``/health``,
``/version``: ``openai_tokens``), and the handlers that turn every error into OpenAI's
``{"error": {"message", "type", "param", "code"}}`` JSON.

The router finds its ``EngineAdapter`` on ``app.state.engine_adapter`` (set with
``attach_adapter``), so an app can be created before the model loads (BentoML mounts it
at import time). Streaming follows OpenAI / vLLM: a role chunk per choice, content
chunks, a finish chunk, an optional usage chunk, then ``data: [DONE]``. A client that
disconnects cancels its stream; the adapter then aborts the request and frees its blocks.

This module holds the route table and the app factory; the rest lives in
``openai_errors`` (error JSON, handlers, ``InternalErrorGuard``), ``openai_state``
(adapter, options and request ids on ``app.state``), ``openai_sampling``,
``openai_streaming``, ``openai_outputs`` (usage, logprobs), ``openai_chat`` and
``openai_completions``; the names code imports from this module are re-exported here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from .api import AdapterError, EngineAdapter
from .openai_chat import _message_dicts, chat_template_kwargs, create_chat_completion
from .openai_completions import create_completion
from .openai_errors import InternalErrorGuard, error_body, error_response, install_error_handlers
from .openai_outputs import TokenText as _TokenText
from .openai_outputs import completion_logprobs as _completion_logprobs
from .openai_protocol import ModelCard, ModelList
from .openai_sampling import chat_sampling_params, completion_sampling_params
from .openai_state import InflightRequestIds, app_adapter, app_options, attach_adapter
from .openai_tokens import detokenize, health, tokenize, version
from .serving_options import ServingOptions

__all__ = [
    "InflightRequestIds",
    "InternalErrorGuard",
    "_TokenText",
    "_completion_logprobs",
    "_message_dicts",
    "attach_adapter",
    "build_router",
    "chat_sampling_params",
    "chat_template_kwargs",
    "completion_sampling_params",
    "create_chat_completion",
    "create_completion",
    "create_openai_app",
    "error_body",
    "error_response",
    "install_error_handlers",
    "list_models",
    "model_list_json",
    "no_such_route",
]


def create_openai_app(adapter: EngineAdapter | None = None, *, prefix: str = "",
                      options: ServingOptions | None = None) -> FastAPI:
    """A FastAPI app serving the OpenAI routes under ``prefix`` ("" when mounted at /v1).

    ``options`` are the front end's limits and privacy settings (defaults: ``ServingOptions()``);
    API keys and body limits are enforced around the app by ``ServingGuard``.
    """
    app = FastAPI(title="paged-backend OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.include_router(build_router(), prefix=prefix)
    install_error_handlers(app)
    app.state.serving_options = options or ServingOptions()
    app.state.request_ids = InflightRequestIds()
    if adapter is not None:
        attach_adapter(app, adapter)
    return app


def build_router() -> APIRouter:
    router = APIRouter()
    for path, (endpoint, method) in _ROUTES.items():
        router.add_api_route(path, endpoint, methods=[method])
    # last: any other path under the app answers OpenAI's JSON (a host that mounts the app only
    # where one of its routes matches, as BentoML does, sends those paths here too)
    router.add_api_route("/{path:path}", no_such_route, methods=_ALL_METHODS, include_in_schema=False)
    return router


_ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


async def no_such_route(request: Request) -> JSONResponse:
    """404 for an unknown path, 405 for a known path asked with another method."""
    if "/" + request.path_params.get("path", "") in _ROUTES:
        return error_response(AdapterError(f"Method {request.method} is not allowed on {request.url.path}.",
                                           code="method_not_allowed"), status=405)
    return error_response(AdapterError(f"No route {request.method} {request.url.path}.", kind="not_found",
                                       code="not_found"))


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(model_list_json(app_adapter(request), expose_path=app_options(request).expose_model_path))


def model_list_json(adapter: EngineAdapter, *, expose_path: bool = False) -> dict[str, Any]:
    """The ``/v1/models`` body; ``root`` is the model's directory only when ``expose_path``."""
    info = adapter.model_info()
    root = (info.get("model_dir") or adapter.config.model) if expose_path else adapter.served_model_name
    card = ModelCard(id=adapter.served_model_name, root=root, max_model_len=info.get("max_model_len"))
    return json.loads(ModelList(data=[card]).model_dump_json())


_ROUTES: dict[str, tuple[Callable[..., Any], str]] = {
    "/models": (list_models, "GET"),
    "/chat/completions": (create_chat_completion, "POST"),
    "/completions": (create_completion, "POST"),
    "/tokenize": (tokenize, "POST"),  # vLLM's extra routes (openai_tokens.py); at the root too via RootRoutes
    "/detokenize": (detokenize, "POST"),
    "/health": (health, "GET"),
    "/version": (version, "GET"),
}
