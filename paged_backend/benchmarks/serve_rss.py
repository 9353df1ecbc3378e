"""Server memory during a ``bench serve --duration`` soak: RSS of a process tree (the ``bentoml
serve`` parent and its workers) or from a Prometheus ``/metrics`` page, and whether it stayed flat.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_SOAK_WINDOW_S = 1200.0  # the RSS verdict looks at the last 20 minutes of a soak ...
_SOAK_TOLERANCE = 0.05  # ... and calls it flat when max / min - 1 stays within 5%
MIB = 1024.0 * 1024.0


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
            f"{v['first'] / MIB:.1f}, last {v['last'] / MIB:.1f}, min {v['min'] / MIB:.1f}, "
            f"max {v['max'] / MIB:.1f} MiB")
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
