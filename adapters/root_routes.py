"""``RootRoutes``: vLLM's root paths (``/health``, ``/version``, ``/tokenize``, ``/detokenize``) answered by
the OpenAI app mounted under a prefix (``/v1`` in the bentos), as ``vllm serve`` answers them.

An ASGI middleware that rewrites those exact paths to ``prefix + path`` before routing; add it after
``ServingGuard`` (inner), which then sees the root path: ``/tokenize`` and ``/detokenize`` are among its
protected paths, ``/health`` and ``/version`` stay open like ``/livez``.
"""

from __future__ import annotations

from typing import Any

ROOT_ROUTES = ("/health", "/version", "/tokenize", "/detokenize")


class RootRoutes:
    def __init__(self, app: Any, prefix: str = "/v1") -> None:
        self.app = app
        self.prefix = prefix.rstrip("/")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope.get("path") in ROOT_ROUTES:
            path = self.prefix + scope["path"]
            scope = {**scope, "path": path, "raw_path": path.encode()}
        await self.app(scope, receive, send)
