"""``paged-backend bench serve``: a load generator for any OpenAI-compatible server.

Works like vLLM's ``vllm bench serve``, so numbers from our ``bentoml serve`` and from a
vLLM server can be compared directly. It uses only HTTP and server-sent events:

* prompts (``--dataset random``): random token ids decoded with a local tokenizer, then
  re-encoded and cut so that each prompt is ``--random-input-len`` tokens long (HTTP text
  APIs take text, not ids). Each request asks for ``--random-output-len`` tokens with
  ``ignore_eos``, so every request produces the same amount of work on any server;
* arrivals: gamma-distributed gaps with mean ``1 / --request-rate`` (``--burstiness 1``
  gives a Poisson process; ``inf`` sends everything at once), and at most
  ``--max-concurrency`` requests are in flight at a time;
* every request streams (``stream_options.include_usage``), timed on the client: TTFT,
  TPOT = (e2e - ttft) / (output tokens - 1) per request, ITL = every gap between text
  chunks, E2E latency; goodput counts the requests that meet every ``--goodput`` SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")  # the per-request metrics goodput can be judged on
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
_LINE_END = re.compile(rb"\r\n|\r|\n")
_TIMEOUT_S = 3600.0  # longest silence on one stream before the request counts as failed


@dataclass
class SampleRequest:
    """One prompt of the data set and the number of tokens to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """What the client saw of one request; times are ``time.perf_counter()`` seconds."""

    prompt_len: int = 0
    success: bool = False
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    ttft: float = 0.0  # seconds from sending to the first text chunk
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text_chunks: int = 0
    generated_text: str = ""
    retried: bool = False  # the first attempt's connection failed before any response (see send_request)


# -- data set ----------------------------------------------------------------------------

def _len_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    lo = max(1, int(length * (1 - range_ratio)))
    return lo, max(lo, int(length * (1 + range_ratio)))


def sample_random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """Random text prompts of about ``input_len`` tokens (vLLM's random data set).

    Lengths are uniform in ``[len * (1 - r), len * (1 + r)]``. Random ids do not always
    decode to text that encodes back to as many tokens, so the text is re-encoded, topped
    up with more random ids while short, and cut to the target; ``prompt_len`` is the
    final text's token count (special tokens the tokenizer adds included).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    n_special = tokenizer.num_special_tokens_to_add()
    in_lo, in_hi = _len_bounds(max(1, input_len - n_special), range_ratio)
    out_lo, out_hi = _len_bounds(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    out: list[SampleRequest] = []
    for target, n_out in zip(in_lens.tolist(), out_lens.tolist(), strict=True):
        ids = rng.choice(allowed, size=target).tolist()
        text = tokenizer.decode(ids)
        for _ in range(8):
            enc = tokenizer.encode(text, add_special_tokens=False)
            if len(enc) >= target:
                text = tokenizer.decode(enc[:target])
                break
            text = tokenizer.decode(enc + rng.choice(allowed, size=target - len(enc)).tolist())
        out.append(SampleRequest(prompt=text, prompt_len=len(tokenizer.encode(text)), output_len=n_out))
    return out


# -- arrivals ----------------------------------------------------------------------------

def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the start, the first at 0 (vLLM's arrival process).

    Gaps are gamma(shape=burstiness, scale=1 / (rate * burstiness)): mean ``1 / rate``
    for any burstiness, exponential (a Poisson process) at 1, burstier below 1, more
    regular above. An infinite rate sends all requests at once.
    """
    import numpy as np

    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])  # its own stream: the prompts do not shift the arrivals
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# -- SLOs --------------------------------------------------------------------------------

def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds, vLLM's syntax)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep:
            raise ValueError(f"invalid SLO {item!r}: expected NAME:MILLISECONDS, e.g. ttft:500")
        if name not in SLO_METRICS:
            raise ValueError(f"invalid SLO metric {name!r} in {item!r}: must be one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"invalid SLO value in {item!r}: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"invalid SLO value in {item!r}: must be a finite number >= 0")
        slos[name] = ms
    return slos


def _slo_arg(item: str) -> str:
    try:
        parse_goodput([item])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return item


# -- metrics -----------------------------------------------------------------------------

def request_tpot(r: RequestResult) -> float:
    """Seconds per output token after the first; 0 for a request of at most one token."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": request_tpot(r), "e2el": r.latency}
    return all(values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at one instant (a request ending as another starts does not overlap)."""
    events = sorted([(r.start, 1) for r in results if r.end > 0] + [(r.end, -1) for r in results if r.end > 0])
    level = peak = 0
    for _, step in events:  # at a tie -1 sorts before +1
        level += step
        peak = max(peak, level)
    return peak


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(results: Sequence[RequestResult], duration: float, *, percentiles: Sequence[float] = (99,),
                    goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """Totals, throughputs and per-metric mean / median / std / percentiles in ms (vLLM's keys)."""
    import numpy as np

    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [request_tpot(r) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "retried": sum(r.retried for r in results),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_concurrent_requests": peak_concurrency(results),
        "num_itls": len(series["itl"]),
    }
    if goodput:
        m["request_goodput"] = per_s(sum(meets_slos(r, goodput) for r in ok))
    for name, values in series.items():
        ms = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
        m[f"mean_{name}_ms"] = float(ms.mean())
        m[f"median_{name}_ms"] = float(np.median(ms))
        m[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            m[f"p{_pct_name(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return m


def format_report(m: dict[str, Any], *, percentiles: Sequence[float], metrics: Sequence[str],
                  max_concurrency: int | None) -> str:
    """The result table, laid out like vLLM's."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {value:<10}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m.get("retried"):
        row("Retried (connection lost, no response):", m["retried"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", f"{m['duration']:.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", f"{m['request_throughput']:.2f}")
    if "request_goodput" in m:
        row("Request goodput (req/s):", f"{m['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}")
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")
    for name in metrics:
        up = name.upper()
        lines.append("{s:{c}^{n}}".format(s=_TITLES[name], n=50, c="-"))
        row(f"Mean {up} (ms):", f"{m[f'mean_{name}_ms']:.2f}")
        row(f"Median {up} (ms):", f"{m[f'median_{name}_ms']:.2f}")
        for p in percentiles:
            row(f"P{_pct_name(p)} {up} (ms):", f"{m[f'p{_pct_name(p)}_{name}_ms']:.2f}")
    if m["first_error"]:
        lines.append("{s:{c}^{n}}".format(s="First error", n=50, c="-"))
        lines.append(m["first_error"])
    lines.append("=" * 50)
    return "\n".join(lines)


# -- one streamed request ----------------------------------------------------------------

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
                        headers: dict[str, str] | None = None, timeout_s: float = _TIMEOUT_S,
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


# -- soak (--duration) -------------------------------------------------------------------

_SOAK_WINDOW_S = 1200.0  # the RSS verdict looks at the last 20 minutes of a soak ...
_SOAK_TOLERANCE = 0.05  # ... and calls it flat when max / min - 1 stays within 5%
_MIB = 1024.0 * 1024.0


def aggregate_interval(index: int, elapsed: float, seconds: float, results: Sequence[RequestResult],
                       rss: int | None = None, worker_rss: int | None = None) -> dict[str, Any]:
    """One soak table row from the requests that completed in one interval.

    ``elapsed`` is the interval's end in seconds after the start and ``seconds`` its length
    (the last one may be longer or shorter than ``--interval``); output tok/s is the
    successful requests' output tokens over ``seconds``. Latencies are client-side, in ms,
    ``None`` when no successful request of the interval has one; RSS is in bytes.
    """
    import numpy as np

    ok = [r for r in results if r.success]
    tpots = [request_tpot(r) * 1000.0 for r in ok if r.output_tokens > 1]
    ttfts = [r.ttft * 1000.0 for r in ok]

    def pct(values: list[float], p: float) -> float | None:
        return float(np.percentile(values, p)) if values else None

    return {"interval": index, "elapsed_s": elapsed, "seconds": seconds, "completed": len(ok),
            "errors": len(results) - len(ok),
            "first_error": next((r.error for r in results if not r.success), None),
            "output_tokens": sum(r.output_tokens for r in ok),
            "output_throughput": sum(r.output_tokens for r in ok) / seconds if seconds > 0 else 0.0,
            "p50_tpot_ms": pct(tpots, 50), "p99_tpot_ms": pct(tpots, 99), "p50_ttft_ms": pct(ttfts, 50),
            "rss_bytes": rss, "worker_rss_bytes": worker_rss}


_ROW_HEADER = (f"{'int':>4} {'elapsed s':>9} {'reqs':>6} {'errs':>5} {'out tok/s':>9} {'TPOT p50':>9} "
               f"{'TPOT p99':>9} {'TTFT p50':>9} {'RSS MiB':>9} {'worker MiB':>10}")


def format_interval_row(row: dict[str, Any]) -> str:
    """One line of the soak table under ``_ROW_HEADER`` (``-`` for a missing value)."""

    def num(value: float | None, width: int, digits: int = 1) -> str:
        return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"

    def mib(value: int | None, width: int) -> str:
        return num(None if value is None else value / _MIB, width)

    return (f"{row['interval']:>4} {row['elapsed_s']:>9.1f} {row['completed']:>6} {row['errors']:>5} "
            f"{row['output_throughput']:>9.1f} {num(row['p50_tpot_ms'], 9, 2)} {num(row['p99_tpot_ms'], 9, 2)} "
            f"{num(row['p50_ttft_ms'], 9)} {mib(row['rss_bytes'], 9)} {mib(row['worker_rss_bytes'], 10)}")


def rss_flatness(rows: Sequence[dict[str, Any]], *, key: str = "rss_bytes", window_s: float = _SOAK_WINDOW_S,
                 tolerance: float = _SOAK_TOLERANCE) -> dict[str, Any]:
    """Whether the RSS samples (one per row, taken at the row's ``elapsed_s``) stay flat.

    The window is the last ``window_s`` seconds of the run, or its last two thirds when
    that is shorter (the first third is warm-up): every row whose sample was taken at or
    after ``end - window`` counts. Flat when ``max / min - 1 <= tolerance``; ``flat`` is
    ``None`` when fewer than two samples in the window have an RSS.
    """
    if not rows:
        return {"window_s": 0.0, "intervals": 0, "first": None, "last": None, "min": None, "max": None,
                "growth": None, "flat": None, "tolerance": tolerance}
    end = max(r["elapsed_s"] for r in rows)
    window = min(window_s, end * 2.0 / 3.0)
    values = [r[key] for r in rows if r["elapsed_s"] >= end - window - 1e-9 and r.get(key) is not None]
    out: dict[str, Any] = {"window_s": window, "intervals": len(values), "tolerance": tolerance,
                           "first": values[0] if values else None, "last": values[-1] if values else None,
                           "min": min(values) if values else None, "max": max(values) if values else None,
                           "growth": None, "flat": None}
    if len(values) >= 2 and out["min"] > 0:
        out["growth"] = out["max"] / out["min"] - 1.0
        out["flat"] = out["growth"] <= tolerance
    return out


def format_rss_summary(v: dict[str, Any], label: str = "server RSS") -> str:
    """The soak's closing lines about one RSS series (``rss_flatness``'s answer)."""
    if v["intervals"] == 0:
        return f"{label}: not measured (no --server-pid and no process_resident_memory_bytes at /metrics)"
    head = (f"{label} over the last {v['intervals']} intervals ({v['window_s']:.0f} s): first "
            f"{v['first'] / _MIB:.1f}, last {v['last'] / _MIB:.1f}, min {v['min'] / _MIB:.1f}, "
            f"max {v['max'] / _MIB:.1f} MiB")
    if v["flat"] is None:
        return head + "; too few samples for a verdict"
    verdict = "flat" if v["flat"] else "NOT flat"
    return (f"{head}; max/min - 1 = {v['growth'] * 100:.2f}%: {verdict} "
            f"(within {v['tolerance'] * 100:g}%: {'yes' if v['flat'] else 'no'})")


def _vm_rss(pid: int) -> int | None:
    """``VmRSS`` of ``/proc/PID/status`` in bytes (psutil's RSS where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return None
    except FileNotFoundError:
        if Path("/proc/self/status").exists():
            return None  # the process is gone
    except (OSError, ValueError):
        return None
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def process_tree_rss(pid: int) -> tuple[int | None, int | None]:
    """(RSS of the process plus all its descendants, RSS of its largest descendant) in bytes.

    Pointed at the ``bentoml serve`` parent, the largest descendant is the worker that holds
    the engine; a process without children reports ``None`` for it. Shared pages count
    once per process (VmRSS), as ``ps`` shows them. ``(None, None)`` once the process is gone.
    """
    import psutil

    own = _vm_rss(pid)
    if own is None:
        return None, None
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        children = []
    kids = [r for r in (_vm_rss(c.pid) for c in children) if r is not None]
    return own + sum(kids), (max(kids) if kids else None)


_RSS_METRIC = re.compile(r"^process_resident_memory_bytes(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def metrics_rss(text: str) -> int | None:
    """``process_resident_memory_bytes`` from a Prometheus text page (summed over its series)."""
    values = []
    for m in _RSS_METRIC.finditer(text):
        try:
            values.append(float(m.group(1)))
        except ValueError:
            continue
    return int(sum(values)) if values else None


class PromptStream:
    """Fresh random prompts without end: batches of ``batch`` prompts with seeds seed, seed+1, ...

    The next batch is made in a thread while the current one is half used, so the event
    loop (which times the streams) does not stall on the tokenizer.
    """

    def __init__(self, make_batch: Callable[[int], list[SampleRequest]], seed: int) -> None:
        self._make = make_batch
        self._seed = seed
        self._batch = make_batch(seed)
        self._pos = 0
        self._next: asyncio.Future[list[SampleRequest]] | None = None

    async def next(self) -> SampleRequest:
        if self._next is None and self._pos >= len(self._batch) // 2:
            self._seed += 1
            self._next = asyncio.ensure_future(asyncio.to_thread(self._make, self._seed))
        if self._pos >= len(self._batch):
            assert self._next is not None
            self._batch, self._next, self._pos = await self._next, None, 0
        self._pos += 1
        return self._batch[self._pos - 1]


async def run_soak(prompts: PromptStream, *, api_url: str, make_payload: Callable[[SampleRequest], dict[str, Any]],
                   chat: bool, duration_s: float, interval_s: float, max_concurrency: int,
                   request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
                   headers: dict[str, str] | None = None, timeout_s: float = _TIMEOUT_S,
                   server_pid: int | None = None, metrics_url: str | None = None,
                   on_row: Callable[[dict[str, Any]], None] | None = None,
                   ) -> tuple[list[RequestResult], float, list[dict[str, Any]]]:
    """Keep ``max_concurrency`` streams busy (or send at ``request_rate``, never more in flight)
    until ``duration_s`` is over, one table row per ``interval_s``.

    A request that completes counts in the interval in which it completed; the requests
    still in flight at the end finish and count in the last interval. RSS is sampled at each
    row: the server process tree's (``server_pid``), else ``process_resident_memory_bytes``
    from ``metrics_url``. Returns every result, the wall time and the rows.
    """
    import aiohttp
    import numpy as np

    rng = np.random.default_rng([seed, 1])
    sem = asyncio.Semaphore(max_concurrency)
    connector = aiohttp.TCPConnector(limit=max_concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=timeout_s)
    everything: list[RequestResult] = []
    current: list[RequestResult] = []
    rows: list[dict[str, Any]] = []
    tasks: set[asyncio.Task[None]] = set()
    metrics_seen = [True]

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as side:

        async def sample_rss() -> tuple[int | None, int | None]:
            if server_pid is not None:
                return process_tree_rss(server_pid)
            if metrics_url is None or not metrics_seen[0]:
                return None, None
            try:
                async with side.get(metrics_url) as resp:
                    value = metrics_rss(await resp.text()) if resp.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return None, None
            if value is None and not rows:
                metrics_seen[0] = False  # the server does not export it: stop asking
            return value, None

        async def one(req: SampleRequest) -> None:
            try:
                res = await send_request(client, api_url, make_payload(req), prompt_len=req.prompt_len, chat=chat,
                                         headers=headers)
                everything.append(res)
                current.append(res)
            finally:
                sem.release()

        t0 = time.perf_counter()
        deadline = t0 + duration_s

        async def dispatch() -> None:
            next_at = t0
            while True:
                if not math.isinf(request_rate):
                    delay = min(next_at, deadline) - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if time.perf_counter() >= deadline:
                        return
                    next_at += float(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness)))
                req = await prompts.next()
                await sem.acquire()
                if time.perf_counter() >= deadline:
                    sem.release()
                    return
                task = asyncio.ensure_future(one(req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        dispatcher = asyncio.ensure_future(dispatch())
        start_of = 0.0
        index = 1
        try:
            while True:
                tick = t0 + index * interval_s
                last = tick >= deadline - 1e-6
                if last:
                    await dispatcher
                    while tasks:
                        await asyncio.gather(*list(tasks), return_exceptions=True)
                else:
                    await asyncio.sleep(max(0.0, tick - time.perf_counter()))
                now = time.perf_counter() - t0
                done, current[:] = list(current), []
                rss, worker = await sample_rss()
                row = aggregate_interval(index, now, now - start_of, done, rss, worker)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                start_of = now
                index += 1
                if last:
                    break
        finally:
            dispatcher.cancel()
            for task in list(tasks):
                task.cancel()
        wall = time.perf_counter() - t0
    return everything, wall, rows


# -- command line ------------------------------------------------------------------------

def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _range_ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def _metric_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown metric(s) {bad}: choose from {', '.join(METRICS)}")
    return names


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (like `vllm bench serve`)")
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:3000 (default: from "
                   "--host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="served model name (default: the first id of GET /v1/models)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer dir for the prompts (default: the served "
                   "model's dir when it is local, else the default model's)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset", "--dataset-name", dest="dataset", choices=["random"], default="random")
    p.add_argument("--num-prompts", type=_positive(int), default=1000)
    p.add_argument("--random-input-len", type=_positive(int), default=1024)
    p.add_argument("--random-output-len", type=_positive(int), default=128)
    p.add_argument("--random-range-ratio", type=_range_ratio, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly the output length (vLLM's ignore_eos extra field)")
    p.add_argument("--request-rate", type=_positive(float), default=math.inf,
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--burstiness", type=_positive(float), default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=_positive(int), default=None, help="most requests in flight")
    p.add_argument("--goodput", nargs="+", type=_slo_arg, default=None, metavar="NAME:MS",
                   help="SLOs in ms for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    p.add_argument("--percentile-metrics", type=_metric_list, default=list(METRICS),
                   help="metrics to print: comma-separated of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", "--percentiles", dest="percentiles", type=_float_list, default=[99.0],
                   help="comma-separated percentiles to report, e.g. 50,90,99")
    p.add_argument("--timeout", type=_positive(float), default=_TIMEOUT_S,
                   help="seconds without data before a request fails")
    p.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    p.add_argument("--save-detailed", action="store_true",
                   help="also put per-request lengths, TTFTs, ITLs and errors into the JSON line")
    p.add_argument("--disable-tqdm", action="store_true")
    soak = p.add_argument_group("soak", "run for a time instead of a number of prompts, one table row per interval")
    soak.add_argument("--duration", type=_positive(float), default=None, metavar="SECONDS",
                      help="keep --max-concurrency streams busy for this long (fresh prompts in batches of "
                      "--num-prompts, seeds --seed, --seed + 1, ...); the in-flight requests then finish")
    soak.add_argument("--interval", type=_positive(float), default=60.0, metavar="SECONDS",
                      help="with --duration: print a row (requests, errors, tok/s, TPOT, TTFT, server RSS) "
                      "every this many seconds")
    soak.add_argument("--server-pid", type=int, default=None, metavar="PID",
                      help="with --duration: the server's pid (e.g. `bentoml serve`'s); RSS is the sum over it "
                      "and its children, the largest child (the worker) shown too. Without it: "
                      "process_resident_memory_bytes from GET /metrics when the server exports it")
    p.set_defaults(func=run_serve)


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


def run_serve(args: argparse.Namespace) -> int:
    import os

    from transformers import AutoTokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = "/" + args.endpoint.lstrip("/")
    if args.duration is not None and args.max_concurrency is None:
        print("error: --duration needs --max-concurrency (the number of streams to keep busy)", file=sys.stderr)
        return 2
    if args.server_pid is not None and args.duration is None:
        print("error: --server-pid is only used with --duration", file=sys.stderr)
        return 2
    if not endpoint.endswith("completions"):
        print(f"error: --endpoint {endpoint} is neither /v1/completions nor /v1/chat/completions",
              file=sys.stderr)
        return 2
    chat = endpoint.endswith("chat/completions")
    api_url = base_url + endpoint
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    goodput = parse_goodput(args.goodput) if args.goodput else None

    model, served_root = args.model, None
    if model is None:
        try:
            models = _served_models(base_url, headers)
        except Exception as exc:
            print(f"error: cannot list the models at {base_url}/v1/models ({type(exc).__name__}: {exc}); "
                  f"is the server up? (or pass --model)", file=sys.stderr)
            return 1
        if not models:
            print(f"error: {base_url}/v1/models lists no model; pass --model", file=sys.stderr)
            return 1
        model, served_root = models[0]["id"], models[0].get("root")
    try:
        tok_dir = resolve_tokenizer(args.tokenizer, model, served_root)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if args.duration is not None:
        return _run_soak_command(args, tokenizer=tokenizer, tok_dir=tok_dir, model=model, base_url=base_url,
                                 endpoint=endpoint, chat=chat, headers=headers, goodput=goodput)
    requests = sample_random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.seed)
    print(f"bench serve: {len(requests)} prompts to {api_url} (model {model}, tokenizer {tok_dir}), "
          f"request rate {args.request_rate}, burstiness {args.burstiness}, max concurrency {args.max_concurrency}")

    def make_payload(req: SampleRequest) -> dict[str, Any]:
        return build_payload(req, model=model, chat=chat, temperature=args.temperature, ignore_eos=args.ignore_eos)

    results, duration = asyncio.run(run_benchmark(
        requests, api_url=api_url, make_payload=make_payload, chat=chat, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed, headers=headers,
        timeout_s=args.timeout, progress=not args.disable_tqdm))
    metrics = compute_metrics(results, duration, percentiles=args.percentiles, goodput=goodput)
    print(format_report(metrics, percentiles=args.percentiles, metrics=args.percentile_metrics,
                        max_concurrency=args.max_concurrency))
    if args.json:
        row = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if chat else "openai",
               "base_url": base_url, "endpoint": endpoint, "model_id": model, "tokenizer_id": tok_dir,
               "dataset": args.dataset, "num_prompts": len(requests), "random_input_len": args.random_input_len,
               "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
               "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
               "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "goodput": goodput,
               **metrics}
        if args.save_detailed:
            row.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                       ttfts=[r.ttft for r in results], e2els=[r.latency for r in results],
                       itls=[r.itl for r in results], text_chunks=[r.text_chunks for r in results],
                       errors=[r.error for r in results])
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0 if metrics["completed"] else 1


def _run_soak_command(args: argparse.Namespace, *, tokenizer: Any, tok_dir: str, model: str, base_url: str,
                      endpoint: str, chat: bool, headers: dict[str, str], goodput: dict[str, float] | None) -> int:
    """``bench serve --duration``: the soak's table, its totals and the RSS verdict."""
    import psutil

    if args.server_pid is not None and not psutil.pid_exists(args.server_pid):
        print(f"error: --server-pid {args.server_pid}: no such process", file=sys.stderr)
        return 2
    api_url = base_url + endpoint

    def make_batch(seed: int) -> list[SampleRequest]:
        return sample_random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, seed)

    def make_payload(req: SampleRequest) -> dict[str, Any]:
        return build_payload(req, model=model, chat=chat, temperature=args.temperature, ignore_eos=args.ignore_eos)

    rss_from = (f"pid {args.server_pid} and its children" if args.server_pid is not None
                else f"{base_url}/metrics process_resident_memory_bytes")
    prompts = PromptStream(make_batch, args.seed)
    print(f"bench serve soak: {args.duration:g} s to {api_url} (model {model}, tokenizer {tok_dir}), "
          f"{args.max_concurrency} streams, request rate {args.request_rate}, a row every {args.interval:g} s; "
          f"RSS from {rss_from}", flush=True)
    print(_ROW_HEADER, flush=True)
    common = {"backend": "openai-chat" if chat else "openai", "base_url": base_url, "endpoint": endpoint,
              "model_id": model, "random_input_len": args.random_input_len,
              "random_output_len": args.random_output_len, "max_concurrency": args.max_concurrency,
              "soak_duration": args.duration, "interval": args.interval, "server_pid": args.server_pid}

    def on_row(row: dict[str, Any]) -> None:
        print(format_interval_row(row), flush=True)
        if row["errors"]:
            print(f"     first error of interval {row['interval']}: {row['first_error']}", file=sys.stderr,
                  flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"kind": "soak_interval", "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
                                    **common, **row}) + "\n")

    results, wall, rows = asyncio.run(run_soak(
        prompts, api_url=api_url, make_payload=make_payload, chat=chat, duration_s=args.duration,
        interval_s=args.interval, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
        burstiness=args.burstiness, seed=args.seed, headers=headers, timeout_s=args.timeout,
        server_pid=args.server_pid, metrics_url=None if args.server_pid is not None else f"{base_url}/metrics",
        on_row=on_row))
    metrics = compute_metrics(results, wall, percentiles=args.percentiles, goodput=goodput)
    print(format_report(metrics, percentiles=args.percentiles, metrics=args.percentile_metrics,
                        max_concurrency=args.max_concurrency))
    verdict = rss_flatness(rows)
    worker = rss_flatness(rows, key="worker_rss_bytes")
    print(format_rss_summary(verdict, "server RSS (process tree)" if args.server_pid is not None else "server RSS"))
    if worker["intervals"]:
        print(format_rss_summary(worker, "worker RSS (largest child)"))
    if args.json:
        row = {"kind": "soak", "date": datetime.now().strftime("%Y%m%d-%H%M%S"), **common, "tokenizer_id": tok_dir,
               "dataset": args.dataset, "num_prompts": len(results), "random_range_ratio": args.random_range_ratio,
               "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
               "burstiness": args.burstiness, "goodput": goodput, **metrics, "intervals": len(rows),
               "rss_verdict": verdict, "worker_rss_verdict": worker}
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0 if metrics["completed"] else 1
