"""What the OpenAI handlers find on ``app.state``: the ``EngineAdapter`` (set with
``attach_adapter``, possibly after the app was made), the ``ServingOptions``, and the
user-supplied request ids in flight (``InflightRequestIds``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import FastAPI, Request

from .api import AdapterError, EngineAdapter
from .serving_options import ServingOptions


def attach_adapter(app: FastAPI, adapter: EngineAdapter) -> None:
    app.state.engine_adapter = adapter


def app_adapter(request: Request) -> EngineAdapter:
    """The adapter attached to the request's app; 503 while there is none."""
    adapter = getattr(request.app.state, "engine_adapter", None)
    if adapter is None:
        raise AdapterError("No engine is attached to this server yet.", kind="unavailable")
    return adapter


def app_options(request: Request) -> ServingOptions:
    return getattr(request.app.state, "serving_options", None) or _DEFAULT_OPTIONS


_DEFAULT_OPTIONS = ServingOptions()


def check_model(adapter: EngineAdapter, model: str | None) -> None:
    """404 unless a request names the served model (or none)."""
    if model is not None and model != adapter.served_model_name:
        raise AdapterError(f"The model `{model}` does not exist.", param="model", code="model_not_found",
                           kind="not_found")


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


def app_request_ids(request: Request) -> InflightRequestIds:
    ids = getattr(request.app.state, "request_ids", None)
    if ids is None:
        ids = request.app.state.request_ids = InflightRequestIds()
    return ids
