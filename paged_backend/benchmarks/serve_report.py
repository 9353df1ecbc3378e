"""``bench serve``'s numbers: goodput SLOs, per-request and aggregate metrics (vLLM's keys), the
result table laid out like vLLM's, and the JSON lines ``--json`` appends.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from paged_backend.benchmarks.serve_requests import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")  # the per-request metrics goodput can be judged on
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


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


def stamp() -> str:
    """The date field of a JSON line (vLLM's format)."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def rate_field(rate: float) -> float | str:
    """``--request-rate`` as a JSON value (``"inf"`` for all at once)."""
    return "inf" if math.isinf(rate) else rate


def append_json_line(path: str, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
