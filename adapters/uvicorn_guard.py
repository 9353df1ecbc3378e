"""Two gaps of uvicorn's HTTP/1.1 protocol (the httptools one), closed in a serving worker.

- **Header read timeout.** uvicorn waits for a request's headers for as long as the client
  takes; a client that connects and sends nothing, or trickles its headers a byte at a
  time, holds a connection for ever. Here the headers of each request must be complete
  within ``header_timeout`` seconds of the connection (or of the request's first byte);
  otherwise the server answers 408 and closes the connection.
- **Half-closed clients.** A client may shut down its sending side once its request is
  sent (``shutdown(SHUT_WR)``) and wait for the answer; uvicorn took that end-of-file for
  a disconnect, so the request was cancelled and never answered. Here the connection stays
  open for writing until the response is complete, then closes. A client that closed the
  whole connection sends the same end-of-file; to tell the two apart the server sends an
  interim ``100 Continue`` (which HTTP/1.1 clients must accept before any response): a
  closed socket answers it with a reset, and the request is then cancelled as a
  disconnect, as before.

``install(header_timeout)`` changes uvicorn's protocol class in this process only; it
returns False (and changes nothing) where uvicorn's httptools protocol is missing or
differs from the one this was written against.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_PROBE_S = 0.25
_HOOKS = ("connection_made", "connection_lost", "eof_received", "on_message_begin", "on_headers_complete",
          "on_response_complete")


def _protocol_class() -> Any:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn runs h11, which this does not change
        return None
    return HttpToolsProtocol if all(hasattr(HttpToolsProtocol, h) for h in _HOOKS) else None


_TCP_CLOSE = 7  # tcp_info's state after a reset (a half-closed peer leaves the socket in CLOSE_WAIT, 8)


def _was_reset(sock: Any) -> bool:
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return True
        if hasattr(socket, "TCP_INFO"):
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == _TCP_CLOSE
    return False


def install(header_timeout: float) -> bool:
    cls = _protocol_class()
    if cls is None:
        logger.warning("uvicorn's httptools protocol not found: no header timeout, half-close not kept open")
        return False
    already = getattr(cls, "_paged_backend_header_timeout", None) is not None
    cls._paged_backend_header_timeout = header_timeout
    if already:
        return True
    _ORIGINAL.update({h: getattr(cls, h) for h in _HOOKS})
    for name, hook in _replacements().items():
        setattr(cls, name, hook)
    return True


# uvicorn's own hooks, each called first (or last) by the one replacing it below
_ORIGINAL: dict[str, Any] = {}


def _arm(self: Any) -> None:
    _disarm(self)
    self._pb_header_timer = self.loop.call_later(type(self)._paged_backend_header_timeout, _expire, self)


def _disarm(self: Any) -> None:
    timer = getattr(self, "_pb_header_timer", None)
    if timer is not None:
        timer.cancel()
        self._pb_header_timer = None


def _expire(self: Any) -> None:
    self._pb_header_timer = None
    if not self.transport.is_closing():
        self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def _connection_made(self: Any, transport: Any) -> None:
    _ORIGINAL["connection_made"](self, transport)
    _arm(self)


def _connection_lost(self: Any, exc: Exception | None) -> None:
    _disarm(self)
    _drop_probe(self)
    _ORIGINAL["connection_lost"](self, exc)


def _on_message_begin(self: Any) -> None:
    _ORIGINAL["on_message_begin"](self)
    _arm(self)


def _on_headers_complete(self: Any) -> None:
    _disarm(self)
    _ORIGINAL["on_headers_complete"](self)


def _eof_received(self: Any) -> bool | None:
    cycle = self.cycle
    if cycle is None or cycle.response_complete:
        return _ORIGINAL["eof_received"](self)
    self._pb_half_closed = True  # answer first: the write side stays open
    if not cycle.response_started:  # a closed peer resets on this; a half-closed one reads it
        self._pb_probe_sock = self.transport.get_extra_info("socket")
        if self._pb_probe_sock is not None:
            self.transport.write(_CONTINUE)
            self.loop.call_later(_PROBE_S, _probe, self)
    return True


def _probe(self: Any) -> None:
    """Half-closed, not answered yet: a reset means the client closed the whole connection."""
    sock = getattr(self, "_pb_probe_sock", None)
    if sock is None:
        return
    cycle = self.cycle
    if _was_reset(sock):  # nobody reads: cancel the request like any disconnect
        _drop_probe(self)
        self.transport.abort()
        return
    if cycle is None or cycle.response_started or self.transport.is_closing():
        _drop_probe(self)  # from here on a write to a closed peer fails by itself
        return
    self.loop.call_later(_PROBE_S, _probe, self)


def _drop_probe(self: Any) -> None:
    self._pb_probe_sock = None


def _on_response_complete(self: Any) -> None:
    _ORIGINAL["on_response_complete"](self)
    _drop_probe(self)
    if getattr(self, "_pb_half_closed", False) and not self.transport.is_closing():
        self.transport.close()


def _replacements() -> dict[str, Any]:
    return {"connection_made": _connection_made, "connection_lost": _connection_lost,
            "on_message_begin": _on_message_begin, "on_headers_complete": _on_headers_complete,
            "eof_received": _eof_received, "on_response_complete": _on_response_complete}
