"""OpenAI's error JSON, ``{"error": {"message", "type", "param", "code"}}``, for every failure
of the OpenAI routes: the exception handlers an app installs, FastAPI's validation errors
as a 400 naming the field, and ``InternalErrorGuard`` for anything unexpected.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_backend.errors import InvalidRequestError

from .adapter_errors import AdapterError, short_repr, to_adapter_error
from .openai_protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable_error",
                500: "internal_server_error"}


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
