"""``bench serve`` at one or several load points against one server.

``--concurrency 1,4,16`` and/or ``--request-rate 2,8,inf`` (comma lists) make one run per
point (every concurrency with every rate), each with fresh prompts (seed ``--seed`` + the
point's index, so no point finds the previous one's prompts in the prefix cache). One point
prints vLLM's result table; several print one row each (output tok/s, request/s, goodput,
TTFT / TPOT / ITL / E2E p50 and p99). ``--json`` appends a line per point, ``--plot`` draws
the throughput / latency curve beside the runs of ``--compare`` (a results file another
server's run saved with ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_backend.benchmarks.bench_plot import PlotUnavailable, load_json_lines, plot_serve_curves
from paged_backend.benchmarks.serve_client import ServeTarget, run_benchmark
from paged_backend.benchmarks.serve_multi import run_clients
from paged_backend.benchmarks.serve_report import (
    append_json_line,
    compute_metrics,
    format_report,
    rate_field,
    stamp,
)
from paged_backend.benchmarks.serve_requests import SampleRequest, sample_random_requests

SWEEP_PERCENTILES = (50.0, 99.0)  # always computed: the sweep table and the plot read them
_TABLE_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


@dataclass(frozen=True)
class LoadPoint:
    """One run of a sweep."""

    max_concurrency: int | None
    request_rate: float
    num_prompts: int
    seed: int


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    """Every ``--concurrency`` with every ``--request-rate``; ``--prompts-per-concurrency K`` sends
    K x C prompts at concurrency C (else ``--num-prompts`` at every point)."""
    concurrencies = args.concurrency or [args.max_concurrency]
    points = []
    for i, (conc, rate) in enumerate(itertools.product(concurrencies, args.request_rates)):
        per = args.prompts_per_concurrency
        n = per * conc if per and conc else args.num_prompts
        points.append(LoadPoint(conc, rate, n, args.seed + i))
    return points


def _result_row(args: argparse.Namespace, target: ServeTarget, point: LoadPoint, results: list, metrics: dict,
                goodput: dict[str, float] | None) -> dict[str, Any]:
    """One JSON line (vLLM's keys, as ``vllm bench serve --save-result`` has them)."""
    row = {"date": stamp(), "backend": target.backend, "base_url": target.base_url, "endpoint": target.endpoint,
           "model_id": target.model, "tokenizer_id": target.tok_dir, "dataset": args.dataset,
           "num_prompts": len(results), "random_input_len": args.random_input_len,
           "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
           "request_rate": rate_field(point.request_rate), "burstiness": args.burstiness,
           "max_concurrency": point.max_concurrency, "num_clients": args.num_clients, "seed": point.seed,
           "goodput": goodput, **metrics}
    if args.save_detailed:
        row.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                   ttfts=[r.ttft for r in results], e2els=[r.latency for r in results],
                   itls=[r.itl for r in results], text_chunks=[r.text_chunks for r in results],
                   errors=[r.error for r in results])
    return row


def _prompts(args: argparse.Namespace, target: ServeTarget, n: int, seed: int) -> list[SampleRequest]:
    return sample_random_requests(target.tokenizer, n, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, seed)


def _client_args(args: argparse.Namespace, target: ServeTarget, point: LoadPoint) -> dict[str, Any]:
    """``run_benchmark``'s keyword arguments for ``point`` (the requests and progress left out)."""
    return {"api_url": target.api_url, "make_payload": target.payload_maker(args.temperature, args.ignore_eos),
            "chat": target.chat, "request_rate": point.request_rate, "burstiness": args.burstiness,
            "max_concurrency": point.max_concurrency, "seed": point.seed, "headers": target.headers,
            "timeout_s": args.timeout}


def warm_up(args: argparse.Namespace, target: ServeTarget, first: LoadPoint, seed: int) -> None:
    """``--num-warmups`` requests (prompts of ``seed``, one no point uses) at the first point's
    concurrency, all at once, before it; not counted."""
    if not args.num_warmups:
        return
    warm = LoadPoint(first.max_concurrency, math.inf, args.num_warmups, seed)
    results, duration = asyncio.run(run_benchmark(_prompts(args, target, warm.num_prompts, warm.seed),
                                                  **_client_args(args, target, warm)))
    failed = [r for r in results if not r.success]
    print(f"  warm-up: {len(results)} requests in {duration:.2f} s, {len(failed)} failed (not counted)"
          + (f"; first error: {failed[0].error}" if failed else ""), flush=True)


def run_point(args: argparse.Namespace, target: ServeTarget, point: LoadPoint,
              goodput: dict[str, float] | None) -> dict[str, Any]:
    """One run at ``point`` (over ``--num-clients`` processes when more than one): its JSON row."""
    requests = _prompts(args, target, point.num_prompts, point.seed)
    common = _client_args(args, target, point)
    if args.num_clients > 1:
        results, duration = run_clients(requests, num_clients=args.num_clients, **common)
    else:
        results, duration = asyncio.run(run_benchmark(requests, progress=not args.disable_tqdm, **common))
    percentiles = sorted(set(args.percentiles) | set(SWEEP_PERCENTILES))
    metrics = compute_metrics(results, duration, percentiles=percentiles, goodput=goodput)
    return _result_row(args, target, point, results, metrics, goodput)


def _rate_text(rate: float | str) -> str:
    return "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{rate:g}"


def format_sweep_table(rows: list[dict[str, Any]]) -> str:
    """One Markdown row per point: load, requests, throughputs, p50 / p99 latencies in ms."""
    goodput = any("request_goodput" in r for r in rows)
    head = ["concurrency", "rate (req/s)", "ok / failed", "req/s", "output tok/s"]
    head += ["goodput (req/s)"] * goodput + [f"{name} p50 / p99 ms" for _, name in _TABLE_METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r in rows:
        cells = ["-" if r["max_concurrency"] is None else str(r["max_concurrency"]), _rate_text(r["request_rate"]),
                 f"{r['completed']} / {r['failed']}", f"{r['request_throughput']:.2f}",
                 f"{r['output_throughput']:,.1f}"]
        if goodput:
            cells.append(f"{r.get('request_goodput', 0.0):.2f}")
        cells += [f"{r[f'p50_{key}_ms']:,.2f} / {r[f'p99_{key}_ms']:,.2f}" for key, _ in _TABLE_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plot(args: argparse.Namespace, target: ServeTarget, rows: list[dict[str, Any]]) -> bool:
    """``--plot``: this run's curve and the ``--compare`` file's; False (said on stderr) without
    matplotlib."""
    series = [(args.label or f"{Path(target.model).name} at {target.base_url}", rows)]
    if args.compare:
        series.append((args.compare_label or Path(args.compare).stem, load_json_lines(args.compare)))
    try:
        plot_serve_curves(series, args.plot)
    except PlotUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    print(f"plot: {args.plot}")
    return True


def run_fixed_points(args: argparse.Namespace, target: ServeTarget, goodput: dict[str, float] | None) -> int:
    """Every load point in turn, then the table (vLLM's for one point), the JSON lines, the plot."""
    points = load_points(args)
    clients = f", {args.num_clients} client processes" if args.num_clients > 1 else ""
    print(f"bench serve: {len(points)} load point(s) to {target.api_url} (model {target.model}, tokenizer "
          f"{target.tok_dir}), burstiness {args.burstiness}{clients}")
    warm_up(args, target, points[0], seed=args.seed + len(points))
    rows = []
    for point in points:
        print(f"  point {len(rows) + 1}/{len(points)}: {point.num_prompts} prompts, max concurrency "
              f"{point.max_concurrency}, request rate {_rate_text(point.request_rate)}", flush=True)
        rows.append(run_point(args, target, point, goodput))
        if args.json:
            append_json_line(args.json, rows[-1])
    if len(rows) == 1:
        print(format_report(rows[0], percentiles=args.percentiles, metrics=args.percentile_metrics,
                            max_concurrency=points[0].max_concurrency))
    else:
        print(format_sweep_table(rows))
        for r in rows:
            if r["first_error"]:
                print(f"first error at concurrency {r['max_concurrency']}, rate {_rate_text(r['request_rate'])}: "
                      f"{r['first_error']}")
    plotted = write_plot(args, target, rows) if args.plot else True
    return 0 if all(r["completed"] for r in rows) and plotted else 1
