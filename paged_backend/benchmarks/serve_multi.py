"""``bench serve --num-clients N``: N client processes share one run's load.

One Python client (one event loop parsing every stream's events) tops out near 12k output
tok/s; above that it measures itself. Each process gets every N-th request, its share of
``--max-concurrency`` and of ``--request-rate`` (its own arrival seed); all start together
(each waits at a barrier once imported), and their results come back in request order, so
the metrics are computed over every request's samples (percentiles of the merged samples,
never averaged percentiles). ``time.perf_counter`` is the system-wide monotonic clock on
Linux, so the processes' request times share one time line.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from paged_backend.benchmarks.serve_client import TIMEOUT_S, run_benchmark
from paged_backend.benchmarks.serve_requests import RequestResult, SampleRequest

START_TIMEOUT_S = 120.0  # for every client process to import and reach the start barrier


@dataclass
class ClientShare:
    """What one client process sends."""

    requests: list[SampleRequest]
    max_concurrency: int | None
    request_rate: float
    seed: int


def split_load(requests: Sequence[SampleRequest], num_clients: int, max_concurrency: int | None,
               request_rate: float, seed: int) -> list[ClientShare]:
    """Every N-th request to each client, the concurrency and the rate split as evenly as whole
    numbers allow; fewer clients than asked when there are fewer requests or streams."""
    n = max(1, min(num_clients, len(requests), max_concurrency or num_clients))
    shares = []
    for i in range(n):
        conc = None if max_concurrency is None else max_concurrency // n + (i < max_concurrency % n)
        rate = request_rate if math.isinf(request_rate) else request_rate / n
        shares.append(ClientShare(list(requests[i::n]), conc, rate, seed + 7919 * i))
    return shares


def merge_results(parts: Sequence[list[RequestResult]]) -> list[RequestResult]:
    """The clients' results back in request order (client i had requests i, i + N, ...)."""
    merged: list[RequestResult] = []
    for k in range(max((len(p) for p in parts), default=0)):
        merged += [p[k] for p in parts if k < len(p)]
    return merged


def merged_duration(parts: Sequence[tuple[list[RequestResult], float]]) -> float:
    """From the first client's first send to the last client's end (each client's run starts
    with its first request, sent at once)."""
    spans = [(min(r.start for r in results), duration) for results, duration in parts if results]
    if not spans:
        return 0.0
    return max(t0 + d for t0, d in spans) - min(t0 for t0, _ in spans)


def _client(share: ClientShare, common: dict[str, Any], barrier: Any, out: Any) -> None:
    """One client process: wait for the others, run its share, send back (results, duration)."""
    try:
        barrier.wait(START_TIMEOUT_S)
        results, duration = asyncio.run(run_benchmark(
            share.requests, request_rate=share.request_rate, max_concurrency=share.max_concurrency,
            seed=share.seed, progress=False, **common))
        out.put((results, duration))
    except BaseException as exc:  # the parent reports it
        out.put(exc)


def _collect(out: Any, proc: Any) -> Any:
    """What a client process sent back, or a ``RuntimeError`` once it is gone without sending."""
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                try:
                    return out.get(timeout=1.0)
                except queue.Empty:
                    raise RuntimeError(f"a client process exited ({proc.exitcode}) without results") from None


def run_clients(requests: Sequence[SampleRequest], *, num_clients: int, api_url: str,
                make_payload: Callable[[SampleRequest], dict[str, Any]], chat: bool,
                request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
                seed: int = 0, headers: dict[str, str] | None = None,
                timeout_s: float = TIMEOUT_S) -> tuple[list[RequestResult], float]:
    """``run_benchmark``'s results over ``num_clients`` processes: every result in request order
    and the wall time from the first send to the last answer. ``make_payload`` must pickle."""
    shares = split_load(requests, num_clients, max_concurrency, request_rate, seed)
    common = {"api_url": api_url, "make_payload": make_payload, "chat": chat, "burstiness": burstiness,
              "headers": headers, "timeout_s": timeout_s}
    ctx = mp.get_context("spawn")  # no fork of a process that may hold tokenizer threads
    barrier, queues = ctx.Barrier(len(shares)), [ctx.Queue() for _ in shares]
    procs = [ctx.Process(target=_client, args=(share, common, barrier, q), daemon=True)
             for share, q in zip(shares, queues, strict=True)]
    for p in procs:
        p.start()
    try:
        got = [_collect(q, p) for q, p in zip(queues, procs, strict=True)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [g for g in got if isinstance(g, BaseException)]
    if errors:
        raise RuntimeError(f"a client process failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    return merge_results([results for results, _ in got]), merged_duration(got)
