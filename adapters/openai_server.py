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

from .api import AdapterError, EngineAdapter, build_sampling_params, merge_delta, to_adapter_error
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

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable_error",
                500: "internal_server_error"}
_DISCONNECT_POLL_S = 0.5


# -- errors ------------------------------------------------------------------------------

def error_response(err: AdapterError) -> JSONResponse:
    """OpenAI's error JSON with the status the error kind calls for."""
    body = ErrorResponse(error=ErrorInfo(message=err.message, type=_ERROR_TYPES.get(err.status, "error"),
                                         param=err.param, code=err.code))
    return JSONResponse(body.model_dump(), status_code=err.status)


def _request_validation_error(exc: RequestValidationError) -> AdapterError:
    """FastAPI's 422 (bad JSON, missing or mistyped fields) as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return AdapterError("Invalid request body.")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = err.get("ctx", {}).get("error", err.get("msg", ""))
        return AdapterError(f"The request body is not valid JSON: {detail}", code="invalid_json")
    if kind == "missing":
        return AdapterError(f"Missing required parameter '{param}'.", param=param)
    where = ".".join(loc) or "body"
    return AdapterError(f"Invalid value for '{where}': {err.get('msg', 'invalid')} (got {err.get('input')!r}).",
                        param=param)


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

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the OpenAI layer")
        return error_response(AdapterError(f"Internal error: {type(exc).__name__}: {exc}", kind="internal"))

    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(AdapterError, on_adapter_error)
    app.add_exception_handler(InvalidRequestError, on_adapter_error)
    app.add_exception_handler(pydantic.ValidationError, on_adapter_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)


# -- app wiring --------------------------------------------------------------------------

def attach_adapter(app: FastAPI, adapter: EngineAdapter) -> None:
    app.state.engine_adapter = adapter


def _adapter(request: Request) -> EngineAdapter:
    adapter = getattr(request.app.state, "engine_adapter", None)
    if adapter is None:
        raise AdapterError("No engine is attached to this server yet.", kind="unavailable")
    return adapter


def create_openai_app(adapter: EngineAdapter | None = None, *, prefix: str = "") -> FastAPI:
    """A FastAPI app serving the OpenAI routes under ``prefix`` ("" when mounted at /v1)."""
    app = FastAPI(title="paged-backend OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.include_router(build_router(), prefix=prefix)
    install_error_handlers(app)
    if adapter is not None:
        attach_adapter(app, adapter)
    return app


def build_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/models", list_models, methods=["GET"])
    router.add_api_route("/chat/completions", create_chat_completion, methods=["POST"])
    router.add_api_route("/completions", create_completion, methods=["POST"])
    return router


# -- endpoints ---------------------------------------------------------------------------

async def list_models(request: Request) -> JSONResponse:
    adapter = _adapter(request)
    info = adapter.model_info()
    card = ModelCard(id=adapter.served_model_name, root=info.get("model_dir") or adapter.config.model,
                     max_model_len=info.get("max_model_len"))
    return JSONResponse(ModelList(data=[card]).model_dump())


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
                task.cancel()
                raise AdapterError("The client disconnected.", kind="invalid_request")
    finally:
        if not task.done():
            task.cancel()


async def _collect(stream: AsyncIterator[RequestOutput], first: RequestOutput | None) -> RequestOutput | None:
    acc = None
    async for delta in _chain(first, stream):
        acc = merge_delta(acc, delta)
    return acc


def _usage(outs: Sequence[RequestOutput | None]) -> UsageInfo:
    prompt = sum(o.usage.prompt_tokens for o in outs if o is not None)
    completion = sum(o.usage.completion_tokens for o in outs if o is not None)
    cached = sum(o.usage.cached_tokens for o in outs if o is not None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


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
    body = ErrorResponse(error=ErrorInfo(message=err.message, type=_ERROR_TYPES.get(err.status, "error"),
                                         param=err.param, code=err.code))
    return f"data: {body.model_dump_json()}\n\n"


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
    adapter = _adapter(request)
    _check_model(adapter, body.model)
    params, names = chat_sampling_params(body)
    prompt_ids = adapter.encode_chat(_message_dicts(body.messages), add_generation_prompt=body.add_generation_prompt,
                                     chat_template_kwargs=body.chat_template_kwargs)
    rid = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
    stream = adapter.generate(prompt_ids, params, request_id=rid, field_names=names)
    first = await _first_delta(stream)
    model = adapter.served_model_name
    text = _TokenText(adapter.tokenizer) if body.logprobs else None
    k = body.top_logprobs or 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _chat_stream(rid, model, params.n, first, stream, text, k, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS)
    final = await _until_disconnect(request, _collect(stream, first))
    choices = []
    for c in final.outputs if final is not None else []:
        lp = _chat_logprobs(c.token_ids, c.logprobs or [], k, text) if text is not None else None
        choices.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    resp = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=_usage([final]))
    return JSONResponse(resp.model_dump())


async def _chat_stream(rid: str, model: str, n: int, first: RequestOutput | None, stream: AsyncIterator[RequestOutput],
                       text: _TokenText | None, k: int, include_usage: bool) -> AsyncIterator[str]:
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
                                            choices=[], usage=_usage([last])))
    except AdapterError as err:
        yield _sse_error(err)
    except Exception as exc:  # after the headers went out an error can only be an SSE event
        logger.exception("error while streaming %s", rid)
        yield _sse_error(to_adapter_error(exc))
    finally:
        await stream.aclose()  # a client gone mid-stream lands here: abort, free the blocks
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
    adapter = _adapter(request)
    _check_model(adapter, body.model)
    if body.suffix is not None:
        raise AdapterError("'suffix' is not supported.", param="suffix")
    params, names = completion_sampling_params(body)
    prompts = _prompts(body.prompt)
    rid = f"cmpl-{body.request_id or uuid.uuid4().hex}"
    streams, firsts = [], []
    try:
        for i, p in enumerate(prompts):
            s = adapter.generate(p, params, request_id=f"{rid}-{i}" if len(prompts) > 1 else rid, field_names=names)
            streams.append(s)
            firsts.append(await _first_delta(s))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    tok = adapter.tokenizer
    text = _TokenText(tok)
    echoes = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in prompts]
    model = adapter.served_model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _completion_stream(rid, model, params.n, firsts, streams, echoes, body, text, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS)
    finals = await _until_disconnect(request, asyncio.gather(*(_collect(s, f) for f, s in zip(firsts, streams,
                                                                                              strict=True))))
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
    resp = CompletionResponse(id=rid, model=model, choices=choices, usage=_usage(finals))
    return JSONResponse(resp.model_dump())


def _extend(acc: CompletionLogprobs, more: CompletionLogprobs) -> None:
    acc.tokens += more.tokens
    acc.token_logprobs += more.token_logprobs
    acc.top_logprobs += more.top_logprobs
    acc.text_offset += more.text_offset


async def _completion_stream(rid: str, model: str, n: int, firsts: list[RequestOutput | None],
                             streams: list[AsyncIterator[RequestOutput]], echoes: list[str], body: CompletionRequest,
                             text: _TokenText, include_usage: bool) -> AsyncIterator[str]:
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
                                          choices=[], usage=_usage(list(last.values()))))
    except AdapterError as err:
        yield _sse_error(err)
    except Exception as exc:
        logger.exception("error while streaming %s", rid)
        yield _sse_error(to_adapter_error(exc))
    finally:
        for s in streams:
            await s.aclose()
    yield "data: [DONE]\n\n"


def model_list_json(adapter: EngineAdapter) -> Mapping[str, Any]:
    """The ``/v1/models`` body (for adapters that serve it outside FastAPI)."""
    info = adapter.model_info()
    return json.loads(ModelList(data=[ModelCard(id=adapter.served_model_name, max_model_len=info.get("max_model_len"),
                                                root=info.get("model_dir"))]).model_dump_json())
