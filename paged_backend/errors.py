"""Errors the engine raises for bad input; adapters map them to 400 / InvalidArgument."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad prompt, too long, ...); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine loop died; every pending and new request fails with this."""
