"""vLLM's server routes beside the OpenAI ones: ``/health``, ``/version``, ``/tokenize`` and ``/detokenize``.

``POST /tokenize`` takes a ``prompt`` (text; ``add_special_tokens``, default true) or chat ``messages``
(through the model's chat template; ``add_generation_prompt``, default true) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs``);
``POST /detokenize`` takes ``tokens`` and answers ``{"prompt": text}``. Out-of-vocabulary ids are a 400
naming ``tokens``. ``GET /health`` is 200 while the engine serves and 503 once it has died (or before it
is attached); ``GET /version`` gives the engine's version.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from .adapter_errors import AdapterError
from .openai_chat import _message_dicts
from .openai_protocol import ChatMessage, OpenAIRequest
from .openai_state import app_adapter, check_model

MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    adapter = app_adapter(request)
    check_model(adapter, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise AdapterError("Send either 'prompt' or 'messages'.", param="prompt" if body.messages is None else
                           "messages")
    if body.messages is not None:
        ids = await adapter.encode_chat_async(_message_dicts(body.messages),
                                              add_generation_prompt=body.add_generation_prompt)
    else:
        adapter.check_text_size(len(body.prompt.encode("utf-8")), "prompt")
        ids = adapter.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": adapter.model_info().get("max_model_len"),
                           "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = adapter.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(out)


async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    adapter = app_adapter(request)
    check_model(adapter, body.model)
    vocab = adapter.model_info().get("vocab_size") or len(adapter.tokenizer)
    bad = next((t for t in body.tokens if t < 0 or t >= vocab), None)
    if bad is not None:
        raise AdapterError(f"Token id {bad} is out of vocabulary (vocab size {vocab}).", param="tokens")
    return JSONResponse({"prompt": adapter.tokenizer.decode(body.tokens)})


async def health(request: Request) -> Response:
    adapter = app_adapter(request)
    return Response(status_code=200 if adapter.is_alive and adapter.is_ready else 503)


async def version(_: Request) -> JSONResponse:
    from paged_backend import __version__

    return JSONResponse({"version": __version__})
