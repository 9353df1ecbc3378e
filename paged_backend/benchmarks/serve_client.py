"""``bench serve``'s HTTP client: one streamed completion or chat completion timed on the
client (server-sent events split as the SSE spec says), a whole fixed-size run at its arrival
times, and the server under test (where it is, which model, the prompts' tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_backend.benchmarks.serve_requests import RequestResult, SampleRequest, arrival_times

logger = logging.getLogger(__name__)

_LINE_END = re.compile(rb"\r\n|\r|\n")
TIMEOUT_S = 3600.0  # longest silence on one stream before the request counts as failed


class StreamError(Exception):
    """The server answered with an error (an HTTP status or an error event in the stream)."""


def _error_text(body: str) -> str:
    """The message of an OpenAI error body, or the body itself."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.strip()[:500]
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    return body.strip()[:500]


class StreamTracker:
    """Times the server-sent events of one streamed completion or chat completion.

    Only chunks that carry text count: TTFT is the first one, every later one adds an
    ITL gap (a role-only chunk, a finish chunk or the usage chunk adds none). Output
    tokens come from the final usage chunk when the server sends one, else they are the
    number of text chunks.
    """

    def __init__(self, start: float, chat: bool) -> None:
        self.start = start
        self.chat = chat
        self.first: float | None = None
        self.last = start
        self.itl: list[float] = []
        self.chunks = 0
        self.text: list[str] = []
        self.usage_tokens: int | None = None

    def feed(self, data: str, now: float) -> None:
        """One ``data:`` payload received at ``now``."""
        if data == "[DONE]":
            return
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise StreamError(f"unexpected stream event: {data[:200]}")
        if obj.get("error"):
            raise StreamError(f"error event in the stream: {_error_text(data)}")
        choices = obj.get("choices") or []
        if choices:
            choice = choices[0]
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if text:
                if self.first is None:
                    self.first = now
                else:
                    self.itl.append(now - self.last)
                self.last = now
                self.chunks += 1
                self.text.append(text)
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])

    def result(self, prompt_len: int, end: float) -> RequestResult:
        r = RequestResult(prompt_len=prompt_len, start=self.start, end=end, latency=end - self.start,
                          itl=self.itl, text_chunks=self.chunks, generated_text="".join(self.text))
        if self.first is None:
            r.error = "the stream ended without any text chunk"
            return r
        r.success = True
        r.ttft = self.first - self.start
        r.output_tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        return r


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a server-sent event stream, ended by CRLF, LF or CR only (the SSE spec).

    Not ``str.splitlines`` (which httpx's ``aiter_lines`` follows): that also splits at U+0085,
    U+2028 and U+2029, which JSON leaves unescaped, so a generated text holding one of them
    would cut its event in two (a "malformed stream event" failure).
    """
    buf = b""
    async for chunk in chunks:
        buf += chunk
        # a CR at the very end may be the first half of a CRLF: keep it for the next chunk
        end = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
        start = 0
        while True:
            nl = _LINE_END.search(buf, start, end)
            if nl is None:
                break
            yield buf[start:nl.start()].decode("utf-8", errors="replace")
            start = nl.end()
        buf = buf[start:]
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", errors="replace")


async def send_request(session: Any, api_url: str, payload: dict[str, Any], *, prompt_len: int,
                       chat: bool, headers: dict[str, str] | None = None) -> RequestResult:
    """POST one streaming request on an ``aiohttp.ClientSession`` and time it; any failure is a
    result with ``error`` set.

    A connection that fails before any response arrives (a pooled keep-alive connection reset
    under load: the server never saw the request) is retried once on a new connection, as the
    OpenAI client does with connection errors; the request's times count from the first
    attempt and the result says ``retried`` (the report counts them). A failure after the
    response began, or a timeout, is never retried.
    """
    import aiohttp

    start = time.perf_counter()
    tracker = StreamTracker(start, chat)
    retried = False
    try:
        while True:
            answered = False
            try:
                async with session.post(api_url, json=payload, headers=headers) as resp:
                    answered = True
                    if resp.status != 200:
                        body = (await resp.read()).decode(errors="replace")
                        raise StreamError(f"HTTP {resp.status} from {api_url}: {_error_text(body)}")
                    async for line in sse_lines(resp.content.iter_any()):
                        now = time.perf_counter()
                        line = line.strip()
                        if line.startswith("data:"):
                            tracker.feed(line[5:].strip(), now)
                break
            except aiohttp.ClientConnectionError as exc:
                if answered or retried or isinstance(exc, asyncio.TimeoutError):
                    raise
                retried = True
        r = tracker.result(prompt_len, time.perf_counter())
        r.retried = retried
        return r
    except StreamError as exc:
        msg = str(exc)
    except asyncio.TimeoutError as exc:  # aiohttp's read timeout is one too
        msg = f"{type(exc).__name__}: no answer from {api_url} within the timeout ({exc})"
    except aiohttp.ClientError as exc:
        msg = f"{type(exc).__name__}: cannot reach {api_url}: {exc}"
    except json.JSONDecodeError as exc:
        msg = f"malformed stream event from {api_url}: {exc}"
    end = time.perf_counter()
    return RequestResult(prompt_len=prompt_len, error=msg, start=start, end=end, latency=end - start,
                         retried=retried)


def build_payload(req: SampleRequest, *, model: str, chat: bool, temperature: float,
                  ignore_eos: bool) -> dict[str, Any]:
    """The JSON body of one streamed request (vLLM's ``ignore_eos`` only when asked for)."""
    body: dict[str, Any] = {"model": model, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def run_benchmark(requests: Sequence[SampleRequest], *, api_url: str,
                        make_payload: Callable[[SampleRequest], dict[str, Any]], chat: bool,
                        request_rate: float = math.inf, burstiness: float = 1.0,
                        max_concurrency: int | None = None, seed: int = 0,
                        headers: dict[str, str] | None = None, timeout_s: float = TIMEOUT_S,
                        progress: bool = False) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (at most ``max_concurrency`` in flight).

    Returns the results in request order and the wall time from the first send to the
    last answer.
    """
    import aiohttp
    from tqdm import tqdm

    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # aiohttp, as vLLM's bench client: on the dev CPU an httpx client streamed ~3x fewer chunks
    # per second than aiohttp against the same server (the client, not the server, was the limit)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=timeout_s)
    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(req: SampleRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            call = send_request(client, api_url, make_payload(req), prompt_len=req.prompt_len, chat=chat,
                                headers=headers)
            if sem is None:
                res = await call
            else:
                async with sem:
                    res = await call
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


# -- the server under test ---------------------------------------------------------------


class TargetError(Exception):
    """``bench serve`` cannot start: the message (printed after ``error:``) and the exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ServeTarget:
    """Where the requests go and what they are made with."""

    base_url: str
    endpoint: str
    headers: dict[str, str]
    model: str
    tok_dir: str
    tokenizer: Any

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("chat/completions")

    @property
    def api_url(self) -> str:
        return self.base_url + self.endpoint

    @property
    def backend(self) -> str:
        """vLLM's name for the API in its JSON lines."""
        return "openai-chat" if self.chat else "openai"

    def payload_maker(self, temperature: float, ignore_eos: bool) -> Callable[[SampleRequest], dict[str, Any]]:
        """``build_payload`` with this target's fields (a partial: it pickles into client processes)."""
        return functools.partial(build_payload, model=self.model, chat=self.chat, temperature=temperature,
                                 ignore_eos=ignore_eos)


def _served_models(base_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    import httpx

    resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    resp.raise_for_status()
    return list(resp.json().get("data") or [])


def resolve_tokenizer(tokenizer: str | None, model: str, served_root: str | None) -> str:
    """A local tokenizer dir: ``--tokenizer``, the served model's dir, or the default model's."""
    from paged_backend.models.default_model import ensure_default_model, is_default_model

    if tokenizer is not None:
        if is_default_model(tokenizer):
            return str(ensure_default_model())
        if not Path(tokenizer).expanduser().is_dir():
            raise FileNotFoundError(f"--tokenizer {tokenizer!r} is not a local directory (nothing is downloaded)")
        return str(Path(tokenizer).expanduser())
    for candidate in (served_root, model):
        if candidate and Path(candidate).expanduser().is_dir():
            return str(Path(candidate).expanduser())
    if not is_default_model(model):
        logger.warning("no local tokenizer for %r: the prompts use the default model's tokenizer; pass "
                       "--tokenizer for exact input lengths", model)
    return str(ensure_default_model())


def resolve_target(args: argparse.Namespace, endpoint: str) -> ServeTarget:
    """The server (``--base-url`` or ``--host``/``--port``), its model (``--model``, else the first
    of ``GET /v1/models``) and the prompts' tokenizer; raises ``TargetError``."""
    import os

    from transformers import AutoTokenizer

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model, served_root = args.model, None
    if model is None:
        try:
            models = _served_models(base_url, headers)
        except Exception as exc:
            raise TargetError(f"cannot list the models at {base_url}/v1/models ({type(exc).__name__}: {exc}); "
                              f"is the server up? (or pass --model)", 1) from None
        if not models:
            raise TargetError(f"{base_url}/v1/models lists no model; pass --model", 1)
        model, served_root = models[0]["id"], models[0].get("root")
    try:
        tok_dir = resolve_tokenizer(args.tokenizer, model, served_root)
    except FileNotFoundError as exc:
        raise TargetError(str(exc), 2) from None
    return ServeTarget(base_url=base_url, endpoint=endpoint, headers=headers, model=model, tok_dir=tok_dir,
                       tokenizer=AutoTokenizer.from_pretrained(tok_dir))
