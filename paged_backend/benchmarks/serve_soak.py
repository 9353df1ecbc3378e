"""``bench serve --duration``: a soak. ``--max-concurrency`` streams kept busy with fresh prompts
for a time, one table row per ``--interval`` (requests, errors, tok/s, TPOT, TTFT, server RSS),
then the totals and whether the server's memory stayed flat.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from paged_backend.benchmarks.serve_client import TIMEOUT_S, ServeTarget, send_request
from paged_backend.benchmarks.serve_report import (
    append_json_line,
    compute_metrics,
    format_report,
    rate_field,
    request_tpot,
    stamp,
)
from paged_backend.benchmarks.serve_requests import (
    PromptStream,
    RequestResult,
    SampleRequest,
    sample_from_args,
)
from paged_backend.benchmarks.serve_rss import (
    MIB,
    format_rss_summary,
    metrics_rss,
    process_tree_rss,
    rss_flatness,
)


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
        return num(None if value is None else value / MIB, width)

    return (f"{row['interval']:>4} {row['elapsed_s']:>9.1f} {row['completed']:>6} {row['errors']:>5} "
            f"{row['output_throughput']:>9.1f} {num(row['p50_tpot_ms'], 9, 2)} {num(row['p99_tpot_ms'], 9, 2)} "
            f"{num(row['p50_ttft_ms'], 9)} {mib(row['rss_bytes'], 9)} {mib(row['worker_rss_bytes'], 10)}")


class _Soak:
    """One soak's state: the streams in flight, the results of the current interval and of the
    whole run, the rows so far."""

    def __init__(self, prompts: PromptStream, *, api_url: str, make_payload: Callable[[SampleRequest], dict[str, Any]],
                 chat: bool, max_concurrency: int, request_rate: float, burstiness: float, seed: int,
                 headers: dict[str, str] | None, server_pid: int | None, metrics_url: str | None,
                 on_row: Callable[[dict[str, Any]], None] | None) -> None:
        import numpy as np

        self.prompts, self.api_url, self.make_payload, self.chat, self.headers = (
            prompts, api_url, make_payload, chat, headers)
        self.request_rate, self.burstiness = request_rate, burstiness
        self.server_pid, self.metrics_url, self.on_row = server_pid, metrics_url, on_row
        self.rng = np.random.default_rng([seed, 1])
        self.sem = asyncio.Semaphore(max_concurrency)
        self.everything: list[RequestResult] = []
        self.current: list[RequestResult] = []
        self.rows: list[dict[str, Any]] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.metrics_seen = True

    async def sample_rss(self, side) -> tuple[int | None, int | None]:
        """(server RSS, largest child's RSS): the process tree's, else from ``/metrics``."""
        import aiohttp

        if self.server_pid is not None:
            return process_tree_rss(self.server_pid)
        if self.metrics_url is None or not self.metrics_seen:
            return None, None
        try:
            async with side.get(self.metrics_url) as resp:
                value = metrics_rss(await resp.text()) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None, None
        if value is None and not self.rows:
            self.metrics_seen = False  # the server does not export it: stop asking
        return value, None

    async def one(self, client, req: SampleRequest) -> None:
        try:
            res = await send_request(client, self.api_url, self.make_payload(req), prompt_len=req.prompt_len,
                                     chat=self.chat, headers=self.headers)
            self.everything.append(res)
            self.current.append(res)
        finally:
            self.sem.release()

    async def dispatch(self, client, t0: float, deadline: float) -> None:
        """Starts a request whenever a stream is free (and, with a rate, its arrival time has come)
        until the deadline."""
        next_at = t0
        while True:
            if not math.isinf(self.request_rate):
                delay = min(next_at, deadline) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() >= deadline:
                    return
                next_at += float(self.rng.gamma(shape=self.burstiness,
                                                scale=1.0 / (self.request_rate * self.burstiness)))
            req = await self.prompts.next()
            await self.sem.acquire()
            if time.perf_counter() >= deadline:
                self.sem.release()
                return
            task = asyncio.ensure_future(self.one(client, req))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def intervals(self, side, t0: float, deadline: float, interval_s: float, dispatcher) -> None:
        """A row at every interval's end; the last one waits for the dispatcher and the requests
        still in flight."""
        start_of = 0.0
        index = 1
        while True:
            tick = t0 + index * interval_s
            last = tick >= deadline - 1e-6
            if last:
                await dispatcher
                while self.tasks:
                    await asyncio.gather(*list(self.tasks), return_exceptions=True)
            else:
                await asyncio.sleep(max(0.0, tick - time.perf_counter()))
            now = time.perf_counter() - t0
            done, self.current[:] = list(self.current), []
            rss, worker = await self.sample_rss(side)
            row = aggregate_interval(index, now, now - start_of, done, rss, worker)
            self.rows.append(row)
            if self.on_row is not None:
                self.on_row(row)
            start_of = now
            index += 1
            if last:
                return


async def run_soak(prompts: PromptStream, *, api_url: str, make_payload: Callable[[SampleRequest], dict[str, Any]],
                   chat: bool, duration_s: float, interval_s: float, max_concurrency: int,
                   request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
                   headers: dict[str, str] | None = None, timeout_s: float = TIMEOUT_S,
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

    soak = _Soak(prompts, api_url=api_url, make_payload=make_payload, chat=chat, max_concurrency=max_concurrency,
                 request_rate=request_rate, burstiness=burstiness, seed=seed, headers=headers, server_pid=server_pid,
                 metrics_url=metrics_url, on_row=on_row)
    connector = aiohttp.TCPConnector(limit=max_concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as side:
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        dispatcher = asyncio.ensure_future(soak.dispatch(client, t0, deadline))
        try:
            await soak.intervals(side, t0, deadline, interval_s, dispatcher)
        finally:
            dispatcher.cancel()
            for task in list(soak.tasks):
                task.cancel()
        wall = time.perf_counter() - t0
    return soak.everything, wall, soak.rows


# -- the command ---------------------------------------------------------------------------


def run_soak_command(args: argparse.Namespace, target: ServeTarget, goodput: dict[str, float] | None) -> int:
    """``bench serve --duration``: the soak's table, its totals and the RSS verdict."""
    import psutil

    if args.server_pid is not None and not psutil.pid_exists(args.server_pid):
        print(f"error: --server-pid {args.server_pid}: no such process", file=sys.stderr)
        return 2
    rss_from = (f"pid {args.server_pid} and its children" if args.server_pid is not None
                else f"{target.base_url}/metrics process_resident_memory_bytes")
    prompts = PromptStream(lambda seed: sample_from_args(target.tokenizer, args, seed), args.seed)
    print(f"bench serve soak: {args.duration:g} s to {target.api_url} (model {target.model}, tokenizer "
          f"{target.tok_dir}), {args.max_concurrency} streams, request rate {args.request_rate}, a row every "
          f"{args.interval:g} s; RSS from {rss_from}", flush=True)
    print(_ROW_HEADER, flush=True)
    common = {"backend": target.backend, "base_url": target.base_url, "endpoint": target.endpoint,
              "model_id": target.model, "random_input_len": args.random_input_len,
              "random_output_len": args.random_output_len, "max_concurrency": args.max_concurrency,
              "soak_duration": args.duration, "interval": args.interval, "server_pid": args.server_pid}

    def on_row(row: dict[str, Any]) -> None:
        print(format_interval_row(row), flush=True)
        if row["errors"]:
            print(f"     first error of interval {row['interval']}: {row['first_error']}", file=sys.stderr,
                  flush=True)
        if args.json:
            append_json_line(args.json, {"kind": "soak_interval", "date": stamp(), **common, **row})

    results, wall, rows = asyncio.run(run_soak(
        prompts, api_url=target.api_url, make_payload=target.payload_maker(args.temperature, args.ignore_eos),
        chat=target.chat, duration_s=args.duration, interval_s=args.interval, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed, headers=target.headers,
        timeout_s=args.timeout, server_pid=args.server_pid,
        metrics_url=None if args.server_pid is not None else f"{target.base_url}/metrics", on_row=on_row))
    metrics = compute_metrics(results, wall, percentiles=args.percentiles, goodput=goodput)
    print(format_report(metrics, percentiles=args.percentiles, metrics=args.percentile_metrics,
                        max_concurrency=args.max_concurrency))
    verdict, worker = _print_rss_verdicts(args, rows)
    if args.json:
        append_json_line(args.json, {
            "kind": "soak", "date": stamp(), **common, "tokenizer_id": target.tok_dir, "dataset": args.dataset,
            "num_prompts": len(results), "random_range_ratio": args.random_range_ratio,
            "request_rate": rate_field(args.request_rate), "burstiness": args.burstiness, "goodput": goodput,
            **metrics, "intervals": len(rows), "rss_verdict": verdict, "worker_rss_verdict": worker})
    return 0 if metrics["completed"] else 1


def _print_rss_verdicts(args: argparse.Namespace, rows: list[dict[str, Any]]) -> tuple[dict, dict]:
    """The server's RSS verdict (and the largest child's, when there are children)."""
    verdict = rss_flatness(rows)
    worker = rss_flatness(rows, key="worker_rss_bytes")
    print(format_rss_summary(verdict, "server RSS (process tree)" if args.server_pid is not None else "server RSS"))
    if worker["intervals"]:
        print(format_rss_summary(worker, "worker RSS (largest child)"))
    return verdict, worker
