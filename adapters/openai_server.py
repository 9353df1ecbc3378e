"""The OpenAI-compatible HTTP layer: a FastAPI router for ``/chat/completions``,
``/completions`` and ``/models``, and the handlers that turn every error into OpenAI's
``{"error": {"message", "type", "param", "code"}}`` JSON.

The router finds its ``EngineAdapter`` on ``app.state.engine_adapter`` (set with
``attach_adapter``), so an app can be created before the model loads (BentoML mounts it
at import time). Streaming follows OpenAI / vLLM: a role chunk per choice, content
chunks, a finish chunk, an optional usage chunk, then ``data: [DONE]``. A client that
disconnects cancels its stream; the adapter then aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import pydantic
import pydantic_core
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_backend.errors import InvalidRequestError
from paged_backend.outputs import LogprobsDict, RequestOutput
from paged_backend.sampling_params import SamplingParams

from .api import AdapterError, EngineAdapter, build_sampling_params, merge_delta, short_repr, to_adapter_error
from .openai_protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    _SamplingFields,
)
from .serving_options import ServingOptions, effective_cache_salt

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable_error",
                500: "internal_server_error"}
_DISCONNECT_POLL_S = 0.5


# -- errors ------------------------------------------------------------------------------

def error_body(message: str, status: int, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's ``{"error": {...}}`` for a status."""
    return ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "invalid_request_error"),
                                         param=param, code=code)).model_dump()


def error_response(err: AdapterError, headers: Mapping[str, str] | None = None, *,
                   status: int | None = None) -> JSONResponse:
    """OpenAI's error JSON with the status the error kind calls for (or ``status``)."""
    code = status or err.status
    return JSONResponse(error_body(err.message, code, param=err.param, code=err.code), status_code=code,
                        headers=dict(headers or {}))


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: Sequence[Any]) -> list[str]:
    """A validation error's location as the user's field path (pydantic's union branch names dropped)."""
    out = []
    for p in loc:
        p = str(p)
        if p == "body" and not out:
            continue
        if "[" in p or "(" in p or p in _TYPE_NAMES or p.startswith("function-"):
            continue
        out.append(p)
    return out


def _request_validation_error(exc: RequestValidationError) -> AdapterError:
    """FastAPI's 422 (bad JSON, missing or mistyped fields) as a 400 naming the field.

    Messages quote at most a few characters of what was sent, never the whole input."""
    errors = exc.errors()
    if not errors:
        return AdapterError("Invalid request body.")
    err = errors[0]
    loc = _field_path(err.get("loc", ()))
    param = loc[0] if loc else None
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = err.get("ctx", {}).get("error", err.get("msg", ""))
        return AdapterError(f"The request body is not valid JSON: {detail}", code="invalid_json")
    if kind == "invalid_unicode":
        path = str(err.get("ctx", {}).get("path", "")) or "body"
        return AdapterError(str(err.get("msg")), param=path.split(".")[0].split("[")[0], code="invalid_unicode")
    if kind == "missing":
        if param is None:
            return AdapterError("The request body is empty: send a JSON object.", code="missing_body")
        return AdapterError(f"Missing required parameter '{'.'.join(loc)}'.", param=param)
    where = ".".join(loc) or "body"
    if where == "body":
        return AdapterError(f"The request body must be a JSON object (got {short_repr(err.get('input'))}).")
    return AdapterError(f"Invalid value for '{where}': {err.get('msg', 'invalid')} "
                        f"(got {short_repr(err.get('input'))}).", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answers OpenAI's error JSON: 400 for bad input, 404, 503, 500 for bugs."""

    async def on_adapter_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_adapter_error(exc))

    async def on_request_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(_request_validation_error(exc))

    async def on_http_exception(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 503: "unavailable"}.get(exc.status_code, "invalid_request")
        err = AdapterError(str(exc.detail), kind=kind)
        resp = error_response(err)
        resp.status_code = exc.status_code
        return resp

    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(AdapterError, on_adapter_error)
    app.add_exception_handler(InvalidRequestError, on_adapter_error)
    app.add_exception_handler(pydantic.ValidationError, on_adapter_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_middleware(InternalErrorGuard)


class InternalErrorGuard:
    """ASGI middleware: an unexpected exception becomes OpenAI's 500 JSON, and goes no further.

    Starlette's own last-resort handler sends its 500 and then re-raises, which makes the
    server drop the keep-alive connection (without ``Connection: close``), so the client's
    next request on it fails. Here the error ends with the response.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            logger.exception("unhandled error in the OpenAI layer")
            if started:  # nothing can be said any more: the connection has to end
                raise
            err = AdapterError(f"Internal error: {type(exc).__name__}: {exc}", kind="internal")
            await error_response(err)(scope, receive, send)


# -- app wiring --------------------------------------------------------------------------

def attach_adapter(app: FastAPI, adapter: EngineAdapter) -> None:
    app.state.engine_adapter = adapter


def _adapter(request: Request) -> EngineAdapter:
    adapter = getattr(request.app.state, "engine_adapter", None)
    if adapter is None:
        raise AdapterError("No engine is attached to this server yet.", kind="unavailable")
    return adapter


def _options(request: Request) -> ServingOptions:
    return getattr(request.app.state, "serving_options", None) or _DEFAULT_OPTIONS


_DEFAULT_OPTIONS = ServingOptions()


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


class InflightRequestIds:
    """User-supplied ``request_id`` values in flight, each with the engine ids serving it.

    Engine ids are always made by the server; a user's id only names the response. A user
    id is taken from its claim to its release. An entry whose response never ran (its
    release never came) is stale once none of its engine requests is in flight and
    ``stale_after_s`` have passed since the claim (tokenizing comes before the engine
    knows a request, so a fresh claim counts as taken).
    """

    def __init__(self, stale_after_s: float = 30.0) -> None:
        self.ids: dict[str, tuple[list[str], float]] = {}
        self.stale_after_s = stale_after_s

    def _taken(self, entry: tuple[list[str], float], adapter: EngineAdapter, now: float) -> bool:
        engine_ids, since = entry
        return now - since < self.stale_after_s or adapter.has_requests(engine_ids)

    def claim(self, user_id: str | None, engine_ids: list[str], adapter: EngineAdapter) -> Callable[[], None]:
        """Take ``user_id`` for these engine requests; returns its release (idempotent)."""
        if user_id is None:
            return _nothing
        now = time.monotonic()
        held = self.ids.get(user_id)
        if held is not None and self._taken(held, adapter, now):
            raise AdapterError(f"Request id {user_id!r} is already in use by a request in flight.",
                               param="request_id", code="duplicate_request_id")
        if len(self.ids) > 4096:
            self.ids = {k: v for k, v in self.ids.items() if self._taken(v, adapter, now)}
        entry = self.ids[user_id] = (engine_ids, now)

        def release() -> None:
            if self.ids.get(user_id) is entry:
                del self.ids[user_id]

        return release


def _nothing() -> None:
    pass


def _request_ids(request: Request) -> InflightRequestIds:
    ids = getattr(request.app.state, "request_ids", None)
    if ids is None:
        ids = request.app.state.request_ids = InflightRequestIds()
    return ids


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


# -- endpoints ---------------------------------------------------------------------------

async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(model_list_json(_adapter(request), expose_path=_options(request).expose_model_path))


def _check_model(adapter: EngineAdapter, model: str | None) -> None:
    if model is not None and model != adapter.served_model_name:
        raise AdapterError(f"The model `{model}` does not exist.", param="model", code="model_not_found",
                           kind="not_found")


def _common_fields(body: _SamplingFields) -> dict[str, Any]:
    names = ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
             "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
             "include_stop_str_in_output")
    return {k: getattr(body, k) for k in names if getattr(body, k) is not None}


def chat_sampling_params(body: ChatCompletionRequest) -> tuple[SamplingParams, dict[str, str]]:
    """SamplingParams of a chat request, and the user's names for renamed fields."""
    fields = _common_fields(body)
    names: dict[str, str] = {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        fields["max_tokens"], names["max_tokens"] = body.max_completion_tokens, "max_completion_tokens"
    else:
        fields["max_tokens"] = body.max_tokens
    if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
        raise AdapterError("When using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    fields["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    return build_sampling_params(fields, field_names=names), names


def completion_sampling_params(body: CompletionRequest) -> tuple[SamplingParams, dict[str, str]]:
    fields = _common_fields(body)
    fields["max_tokens"] = body.max_tokens
    fields["logprobs"] = body.logprobs
    if body.echo and body.logprobs is not None:
        fields["prompt_logprobs"] = body.logprobs
    return build_sampling_params(fields, field_names={"prompt_logprobs": "logprobs"}), {"prompt_logprobs": "logprobs"}


def _message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise AdapterError("'messages' must contain at least one message.", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, dict):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise AdapterError(f"messages[{i}]: only text content parts are supported "
                                           f"(got type {part.get('type')!r}).", param="messages")
                    texts.append(part["text"])
                else:
                    texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


async def _first_delta(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Run a request up to its first delta, so a refusal is an HTTP error, not a broken stream."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
        if first.finished:
            return
    async for delta in rest:
        yield delta


async def _until_disconnect(request: Request, work: asyncio.Future) -> Any:
    """Await ``work``, cancelling it (and so aborting its request) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise AdapterError("The client disconnected.", kind="invalid_request")
    finally:
        if not task.done():  # cancelled (its requests aborted) and awaited: nothing runs on behind us
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _collect(stream: AsyncIterator[RequestOutput], first: RequestOutput | None) -> RequestOutput | None:
    acc = None
    async for delta in _chain(first, stream):
        acc = merge_delta(acc, delta)
    return acc


async def _gather_all(coros: Sequence[Any]) -> list[Any]:
    """``asyncio.gather`` that cancels and awaits the others when one fails or it is cancelled,
    so no request keeps running (or holds its stream) behind an error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _usage(outs: Sequence[RequestOutput | None], details: bool = True) -> UsageInfo:
    prompt = sum(o.usage.prompt_tokens for o in outs if o is not None)
    completion = sum(o.usage.completion_tokens for o in outs if o is not None)
    cached = sum(o.usage.cached_tokens for o in outs if o is not None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if details else None)


# chat_template_kwargs names that are apply_chat_template's own arguments, not template variables
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "tokenize", "add_generation_prompt", "continue_final_message", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def chat_template_kwargs(body: ChatCompletionRequest, options: ServingOptions) -> dict[str, Any]:
    """The template variables a chat request passes; a template of its own only when trusted.

    A request-supplied Jinja template can spend unbounded CPU and memory in the sandbox,
    so it is refused unless the operator set ``trust_request_chat_template``."""
    kwargs = dict(body.chat_template_kwargs or {})
    template = kwargs.pop("chat_template", None)
    if body.chat_template is not None:
        template = body.chat_template
    bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise AdapterError(f"chat_template_kwargs may not set '{bad[0]}'.", param="chat_template_kwargs")
    if template is not None:
        if not options.trust_request_chat_template:
            raise AdapterError("This server does not accept chat templates sent with a request (chat_template); "
                               "the model's own template is used.", param="chat_template",
                               code="chat_template_not_allowed")
        if not isinstance(template, str):
            raise AdapterError("chat_template must be a string.", param="chat_template")
        kwargs["chat_template"] = template
    return kwargs


def _sse(model: pydantic.BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_unset=True)}\n\n"


class _TextEvent:
    """The SSE event of one text chunk, serialized once: per chunk only the text is encoded.

    ``make(text)`` builds the chunk's model; the event is that model's JSON with the text
    put in by the same serializer (``pydantic_core.to_json``), so the bytes equal
    ``_sse(make(text))``. Falls back to that when the sentinel is not found exactly once.
    """

    def __init__(self, make: Callable[[str], pydantic.BaseModel]) -> None:
        self.make = make
        sentinel = f"@@text-{uuid.uuid4().hex}@@"
        parts = _sse(make(sentinel)).split(f'"{sentinel}"')
        self.parts = (parts[0], parts[1]) if len(parts) == 2 else None

    def __call__(self, text: str) -> str:
        if self.parts is None:
            return _sse(self.make(text))
        return self.parts[0] + pydantic_core.to_json(text).decode() + self.parts[1]


def _sse_error(err: AdapterError) -> str:
    body = error_body(err.message, err.status, param=err.param, code=err.code)
    return f"data: {pydantic_core.to_json(body).decode()}\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- logprobs ----------------------------------------------------------------------------

class _TokenText:
    """Decoded text of single tokens, cached (logprobs name tokens by their text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _top(d: LogprobsDict, k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:k]


def _chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[LogprobsDict], k: int,
                   text: _TokenText) -> ChatChoiceLogprobs:
    content = []
    for tid, d in zip(token_ids, logprobs, strict=False):
        s = text(tid)
        tops = [TopLogprob(token=text(t), logprob=max(lp, -9999.0), bytes=list(text(t).encode()))
                for t, lp in _top(d, k)]
        content.append(ChatTokenLogprob(token=s, logprob=max(d.get(tid, float("-inf")), -9999.0),
                                        bytes=list(s.encode()), top_logprobs=tops))
    return ChatChoiceLogprobs(content=content)


def _completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[LogprobsDict | None], k: int,
                         text: _TokenText, offset: int) -> tuple[CompletionLogprobs, int]:
    out = CompletionLogprobs()
    for tid, d in zip(token_ids, logprobs, strict=False):
        s = text(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if d is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(max(d.get(tid, float("-inf")), -9999.0))
        tops = dict(_top(d, k))
        tops[tid] = d.get(tid, float("-inf"))  # vLLM lists the chosen token too
        out.top_logprobs.append({text(t): max(lp, -9999.0) for t, lp in tops.items()})
    return out, offset


# -- chat --------------------------------------------------------------------------------

async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    adapter, options = _adapter(request), _options(request)
    _check_model(adapter, body.model)
    params, names = chat_sampling_params(body)
    template_kwargs = chat_template_kwargs(body, options)
    messages = _message_dicts(body.messages)
    salt = effective_cache_salt(body.cache_salt, body.user, from_user=options.cache_salt_from_user)
    rid = f"chatcmpl-{uuid.uuid4().hex}"  # the engine's id: made here, never from user input
    response_id = f"chatcmpl-{body.request_id}" if body.request_id is not None else rid
    release = _request_ids(request).claim(body.request_id, [rid], adapter)
    handed_off = False
    try:
        async def start() -> tuple[AsyncIterator[RequestOutput], RequestOutput | None]:
            prompt_ids = await adapter.encode_chat_async(messages, add_generation_prompt=body.add_generation_prompt,
                                                         chat_template_kwargs=template_kwargs)
            stream = adapter.generate(prompt_ids, params, request_id=rid, cache_salt=salt, field_names=names)
            try:
                return stream, await _first_delta(stream)
            except BaseException:
                await stream.aclose()
                raise

        # the client may leave while the prompt is tokenized or prefilled: its request is aborted then
        stream, first = await _until_disconnect(request, start())
        model = adapter.served_model_name
        text = _TokenText(adapter.tokenizer) if body.logprobs else None
        k = body.top_logprobs or 0
        details = options.enable_prompt_tokens_details
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            gen = _chat_stream(response_id, model, params.n, first, stream, text, k, include_usage, details,
                               on_close=release)
            handed_off = True
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS)
        final = await _until_disconnect(request, _collect(stream, first))
    finally:
        if not handed_off:
            release()
    choices = []
    for c in final.outputs if final is not None else []:
        lp = _chat_logprobs(c.token_ids, c.logprobs or [], k, text) if text is not None else None
        choices.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    resp = ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=_usage([final], details))
    return JSONResponse(resp.model_dump())


async def _chat_stream(rid: str, model: str, n: int, first: RequestOutput | None, stream: AsyncIterator[RequestOutput],
                       text: _TokenText | None, k: int, include_usage: bool, details: bool,
                       on_close: Callable[[], None]) -> AsyncIterator[str]:
    """SSE events of a chat stream; the events of one delta go out in one write."""
    created = int(time.time())
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    content_events: dict[int, _TextEvent] = {}

    def chunk(choice: ChatCompletionStreamChoice) -> str:
        return _sse(ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created, model=model,
                                        choices=[choice], **extra))

    def content(index: int, s: str) -> str:
        event = content_events.get(index)
        if event is None:
            event = content_events[index] = _TextEvent(lambda t: ChatCompletionChunk(
                id=rid, object="chat.completion.chunk", created=created, model=model,
                choices=[ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=t), logprobs=None,
                                                    finish_reason=None)], **extra))
        return event(s)

    def events(delta: RequestOutput) -> str:
        out = []
        for c in delta.outputs:
            if text is not None and (c.text or c.token_ids):
                lp = _chat_logprobs(c.token_ids, c.logprobs or [], k, text)
                out.append(chunk(ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                            logprobs=lp, finish_reason=None)))
            elif c.text:
                out.append(content(c.index, c.text))
            if c.finish_reason is not None:
                out.append(chunk(ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(),
                                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)))
        return "".join(out)

    last: RequestOutput | None = None
    try:
        # the role chunks go out with the first delta's events
        head = "".join(chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                                        logprobs=None, finish_reason=None)) for i in range(n))
        async for delta in _chain(first, stream):
            last = delta
            out, head = head + events(delta), ""
            if out:
                yield out
        if head:
            yield head
        if include_usage:
            yield _sse(ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created, model=model,
                                            choices=[], usage=_usage([last], details)))
    except AdapterError as err:
        yield _sse_error(err)
    except Exception as exc:  # after the headers went out an error can only be an SSE event
        logger.exception("error while streaming %s", rid)
        yield _sse_error(to_adapter_error(exc))
    finally:
        await stream.aclose()  # a client gone mid-stream lands here: abort, free the blocks
        on_close()
    yield "data: [DONE]\n\n"


# -- completions -------------------------------------------------------------------------

def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise AdapterError("'prompt' must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


async def _merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' deltas as they come, tagged with the prompt index."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for d in s:
                await queue.put((i, d))
        except BaseException as exc:  # forwarded to the consumer
            await queue.put((i, exc))
            return
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def create_completion(body: CompletionRequest, request: Request) -> Any:
    adapter, options = _adapter(request), _options(request)
    _check_model(adapter, body.model)
    if body.suffix is not None:
        raise AdapterError("'suffix' is not supported.", param="suffix")
    params, names = completion_sampling_params(body)
    prompts = _prompts(body.prompt)
    if len(prompts) * params.n > options.max_batch_prompts:
        raise AdapterError(f"This request asks for {len(prompts)} prompt(s) x n = {params.n} completions, more than "
                           f"this server takes in one request ({options.max_batch_prompts}).", param="prompt",
                           code="too_many_prompts")
    salt = effective_cache_salt(body.cache_salt, body.user, from_user=options.cache_salt_from_user)
    rid = f"cmpl-{uuid.uuid4().hex}"  # the engine's ids: made here, never from user input
    engine_ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    response_id = f"cmpl-{body.request_id}" if body.request_id is not None else rid
    release = _request_ids(request).claim(body.request_id, engine_ids, adapter)
    handed_off = False
    # every prompt is submitted at once (one batch in the engine); any refusal or a client
    # gone before the last token aborts them all
    streams = [adapter.generate(p, params, request_id=eid, cache_salt=salt, field_names=names)
               for p, eid in zip(prompts, engine_ids, strict=True)]
    try:
        firsts = await _until_disconnect(request, _gather_all([_first_delta(s) for s in streams]))
        tok = adapter.tokenizer
        text = _TokenText(tok)
        echoes = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in prompts]
        model = adapter.served_model_name
        details = options.enable_prompt_tokens_details
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            gen = _completion_stream(response_id, model, params.n, firsts, streams, echoes, body, text, include_usage,
                                     details, on_close=release)
            handed_off = True
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS)
        finals = await _until_disconnect(request, _gather_all([_collect(s, f) for f, s in zip(firsts, streams,
                                                                                             strict=True)]))
    finally:
        if not handed_off:  # the streaming response owns them otherwise
            for s in streams:
                await s.aclose()
            release()
    choices = []
    for pi, final in enumerate(finals):
        if final is None:
            continue
        for c in final.outputs:
            lp = None
            if body.logprobs is not None:
                lp, offset = CompletionLogprobs(), 0
                if body.echo and final.prompt_logprobs is not None:
                    lp, offset = _completion_logprobs(final.prompt_token_ids, final.prompt_logprobs, body.logprobs,
                                                      text, 0)
                gen_lp, _ = _completion_logprobs(c.token_ids, c.logprobs or [], body.logprobs, text, offset)
                _extend(lp, gen_lp)
            choices.append(CompletionChoice(index=pi * params.n + c.index, text=echoes[pi] + c.text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    resp = CompletionResponse(id=response_id, model=model, choices=choices, usage=_usage(finals, details))
    return JSONResponse(resp.model_dump())


def _extend(acc: CompletionLogprobs, more: CompletionLogprobs) -> None:
    acc.tokens += more.tokens
    acc.token_logprobs += more.token_logprobs
    acc.top_logprobs += more.top_logprobs
    acc.text_offset += more.text_offset


async def _completion_stream(rid: str, model: str, n: int, firsts: list[RequestOutput | None],
                             streams: list[AsyncIterator[RequestOutput]], echoes: list[str], body: CompletionRequest,
                             text: _TokenText, include_usage: bool, details: bool,
                             on_close: Callable[[], None]) -> AsyncIterator[str]:
    """SSE events of a completion stream; the events of one delta go out in one write."""
    created = int(time.time())
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    k = body.logprobs
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    last: dict[int, RequestOutput] = {}  # the latest delta of each prompt: its usage is the total so far
    prompt_logprobs: dict[int, list[LogprobsDict | None]] = {}
    text_events: dict[int, _TextEvent] = {}

    def chunk(choice: CompletionChoice) -> str:
        return _sse(CompletionResponse(id=rid, object="text_completion", created=created, model=model,
                                       choices=[choice], **extra))

    def text_chunk(index: int, s: str) -> str:
        event = text_events.get(index)
        if event is None:
            event = text_events[index] = _TextEvent(lambda t: CompletionResponse(
                id=rid, object="text_completion", created=created, model=model,
                choices=[CompletionChoice(index=index, text=t, logprobs=None, finish_reason=None)], **extra))
        return event(s)

    def events(pi: int, delta: RequestOutput) -> str:
        last[pi] = delta
        if delta.prompt_logprobs is not None:
            prompt_logprobs[pi] = delta.prompt_logprobs
        out = []
        for c in delta.outputs:
            index = pi * n + c.index
            prefix, lp = "", None
            if k is not None:
                lp = CompletionLogprobs()
            if index not in echoed:
                echoed.add(index)
                prefix = echoes[pi]
                if k is not None and body.echo and pi in prompt_logprobs:
                    lp, offsets[index] = _completion_logprobs(delta.prompt_token_ids, prompt_logprobs[pi], k,
                                                              text, 0)
            if prefix or c.text or (k is not None and c.token_ids):
                if lp is not None:
                    more, offsets[index] = _completion_logprobs(c.token_ids, c.logprobs or [], k, text,
                                                                offsets.get(index, 0))
                    _extend(lp, more)
                    out.append(chunk(CompletionChoice(index=index, text=prefix + c.text, logprobs=lp,
                                                      finish_reason=None)))
                else:
                    out.append(text_chunk(index, prefix + c.text))
            if c.finish_reason is not None:
                out.append(chunk(CompletionChoice(index=index, text="", finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason)))
        return "".join(out)

    try:
        async for pi, delta in _merge_streams([_chain(f, s) for f, s in zip(firsts, streams, strict=True)]):
            out = events(pi, delta)
            if out:
                yield out
        if include_usage:
            yield _sse(CompletionResponse(id=rid, object="text_completion", created=created, model=model,
                                          choices=[], usage=_usage(list(last.values()), details)))
    except AdapterError as err:
        yield _sse_error(err)
    except Exception as exc:
        logger.exception("error while streaming %s", rid)
        yield _sse_error(to_adapter_error(exc))
    finally:
        for s in streams:
            await s.aclose()
        on_close()
    yield "data: [DONE]\n\n"


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
}
