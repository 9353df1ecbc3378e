"""``AdapterError``: how every adapter reports a refused or failed request.

An error carries its message, the offending field (``param``), an optional machine code and
a kind, which maps to an HTTP status (and, in the Triton adapter, a Triton error code).
``to_adapter_error`` maps any exception from validation or the engine onto it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import pydantic

from paged_backend.errors import EngineDeadError, InvalidRequestError

ErrorKind = Literal["invalid_request", "not_found", "unavailable", "internal"]
_STATUS: dict[str, int] = {"invalid_request": 400, "not_found": 404, "unavailable": 503, "internal": 500}


class AdapterError(Exception):
    """A refused or failed request, as every adapter reports it (param = the offending field)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 kind: ErrorKind = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    @property
    def status(self) -> int:
        return _STATUS[self.kind]

    def __repr__(self) -> str:
        return f"AdapterError({self.message!r}, param={self.param!r}, kind={self.kind!r})"


def to_adapter_error(exc: BaseException, field_names: Mapping[str, str] | None = None) -> AdapterError:
    """Map any exception from validation or the engine onto ``AdapterError``.

    ``field_names`` renames SamplingParams fields back to what the user sent
    (``max_tokens`` -> ``max_completion_tokens``).
    """
    names = field_names or {}
    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, pydantic.ValidationError):
        return _from_validation_error(exc, names)
    if isinstance(exc, InvalidRequestError):
        param = names.get(exc.param, exc.param) if exc.param else None
        return AdapterError(exc.message, param=param, code=exc.code)
    if isinstance(exc, EngineDeadError):
        return AdapterError(str(exc), kind="unavailable")
    if isinstance(exc, ValueError | TypeError):
        return AdapterError(str(exc))
    return AdapterError(f"Internal error: {type(exc).__name__}: {exc}", kind="internal")


def _from_validation_error(exc: pydantic.ValidationError, names: Mapping[str, str]) -> AdapterError:
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    if loc:
        loc[0] = names.get(loc[0], loc[0])
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        return AdapterError(f"Unknown parameter '{param}'.", param=param)
    if err.get("type") == "missing":
        return AdapterError(f"Missing required parameter '{param}'.", param=param)
    if param is None:
        return AdapterError(msg)
    return AdapterError(f"Invalid value for '{param}': {msg} (got {short_repr(err.get('input'))}).", param=param)


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr`` of a user's value, cut: an error never echoes a large input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
