"""``ServingGuard``: the ASGI middleware in front of every route a client calls.

On the protected paths (``/v1``, ``/generate``, ``/stats`` by default) it checks the
API key (``Authorization: Bearer``, compared in constant time), then reads the body
itself, at most ``max_request_bytes`` of it and within ``request_read_timeout`` seconds,
before the app sees the request. Refusals are OpenAI's error JSON: 401, 413, 408. Health
and metrics routes pass untouched.

    app.add_middleware(ServingGuard, options=ServingOptions(api_key=["k1"]))
    # BentoML: MyService.add_asgi_middleware(ServingGuard, options=...)
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

from .openai_errors import error_body
from .serving_options import ServingOptions

PROTECTED_PATHS = ("/v1", "/generate", "/stats", "/tokenize", "/detokenize")


def _is_under(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


class ServingGuard:
    """API keys, request body size and body read time for the protected paths."""

    def __init__(self, app: Any, options: ServingOptions | None = None,
                 protected_paths: Sequence[str] = PROTECTED_PATHS) -> None:
        self.app = app
        self.options = options or ServingOptions()
        self.keys = [k.encode() for k in self.options.api_keys()]
        self.protected = tuple(protected_paths)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not _is_under(scope["path"], self.protected):
            await self.app(scope, receive, send)
            return
        if self.keys and not self._authorized(scope):
            await self._refuse(scope, receive, send, 401, "Incorrect or missing API key: send it as "
                               "'Authorization: Bearer <key>'.", "invalid_api_key",
                               headers={"www-authenticate": "Bearer"})
            return
        limit = self.options.max_request_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._too_large(scope, receive, send, declared)
            return
        body, status = await self._read_body(receive, limit)
        if status == 413:
            await self._too_large(scope, receive, send, None)
            return
        if status == 408:
            await self._refuse(scope, receive, send, 408, f"The request body did not arrive within "
                               f"{self.options.request_read_timeout:g} s.", "request_timeout")
            return
        if status == 499:  # the client left while sending: nobody to answer
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Any) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
                break
        ok = False
        for key in self.keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(given, key)
        return ok

    async def _read_body(self, receive: Any, limit: int) -> tuple[bytes, int]:
        """The whole body (status 0), or 413 past ``limit``, 408 past the read timeout, 499 on a disconnect."""
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.request_read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return b"", 408
            if message["type"] == "http.disconnect":
                return b"", 499
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", 413
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), 0

    async def _too_large(self, scope: Any, receive: Any, send: Any, size: int | None) -> None:
        got = f" ({size} bytes)" if size is not None else ""
        await self._refuse(scope, receive, send, 413, f"The request body{got} is larger than this server accepts "
                           f"({self.options.max_request_bytes} bytes, max_request_bytes).", "request_too_large")

    @staticmethod
    async def _refuse(scope: Any, receive: Any, send: Any, status: int, message: str, code: str,
                      headers: dict[str, str] | None = None) -> None:
        # the body may be left unread: the connection is closed after the answer
        resp = JSONResponse(error_body(message, status, code=code), status_code=status,
                            headers={"connection": "close", **(headers or {})})
        await resp(scope, receive, send)


def _content_length(scope: Any) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the app the body read already, then the client's own messages."""
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
