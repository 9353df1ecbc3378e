"""The benchmarks' plots (matplotlib, the optional ``bench`` extra): ``bench serve``'s throughput /
latency curve and ``bench throughput``'s runs, each beside a peer's saved results.

Without matplotlib the benchmarks still run and print their tables; asking for a plot then ends
with ``PlotUnavailable``, whose message says how to get one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

INSTALL_HINT = ("--plot needs matplotlib, which is not installed: pip install 'paged-backend[bench]' "
                "(or pip install matplotlib); the results above are complete without the plot")

Series = tuple[str, list[dict[str, Any]]]  # a label and its result rows


class PlotUnavailable(Exception):
    """matplotlib is missing; the message says how to install it."""


def add_plot_args(p: Any, *, plot_help: str, compare_help: str) -> None:
    """``--plot PNG``, ``--compare FILE`` and ``--compare-label`` on a parser or an argument group."""
    p.add_argument("--plot", default=None, metavar="PNG",
                   help=f"{plot_help} (needs matplotlib: pip install 'paged-backend[bench]')")
    p.add_argument("--compare", default=None, metavar="JSONL", help=f"with --plot: {compare_help}")
    p.add_argument("--compare-label", default=None, help="the --compare runs' name (default: the file's stem)")


def plot_args_error(args: Any) -> str | None:
    """What is wrong with ``--plot`` / ``--compare`` as given (checked before any work)."""
    if args.compare and not args.plot:
        return "--compare draws saved runs beside this one: add --plot PNG"
    if args.compare and not Path(args.compare).is_file():
        return f"--compare {args.compare}: no such file"
    return None


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or ``PlotUnavailable``."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_json_lines(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (or of a JSON file holding one object or a list of them)."""
    text = Path(path).read_text()
    try:
        whole = json.loads(text)
    except ValueError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return whole if isinstance(whole, list) else [whole]


def _rate_text(rate: Any) -> str:
    return "inf" if rate in ("inf", None) or (isinstance(rate, float) and math.isinf(rate)) else f"{rate:g}/s"


def point_label(row: dict[str, Any], varies: Sequence[str] = ("max_concurrency",)) -> str:
    """How a serve point is named on the plot: ``c=16`` (its concurrency), ``8/s`` (its request
    rate), or both, by what ``varies`` over its series."""
    parts = []
    if "max_concurrency" in varies:
        parts.append(f"c={row.get('max_concurrency') if row.get('max_concurrency') is not None else '-'}")
    if "request_rate" in varies:
        parts.append(_rate_text(row.get("request_rate")))
    return ", ".join(parts)


def varying(rows: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """What changes between a series' points: concurrency unless only the rate does, and both if both."""
    out = tuple(k for k in ("max_concurrency", "request_rate") if len({str(r.get(k)) for r in rows}) > 1)
    return out or ("max_concurrency",)


def serve_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fixed-size ``bench serve`` rows of a results file (soak rows and other kinds left out)."""
    keys = ("output_throughput", "median_tpot_ms", "p99_ttft_ms")
    return [r for r in rows if all(k in r for k in keys) and r.get("kind") in (None, "sweep_point")]


def _load_key(row: dict[str, Any]) -> tuple[float, float]:
    conc, rate = row.get("max_concurrency"), row.get("request_rate")
    return (math.inf if conc is None else float(conc), math.inf if rate in (None, "inf") else float(rate))


def _annotated_line(ax: Any, xs: list[float], ys: list[float], labels: list[str], name: str) -> None:
    (line,) = ax.plot(xs, ys, marker="o", label=name)
    for x, y, text in zip(xs, ys, labels, strict=True):
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8, color=line.get_color())


def plot_serve_curves(series: Sequence[Series], path: str | Path) -> None:
    """Output tok/s against TPOT p50 (left) and TTFT p99 (right), a line per series, each point
    labelled with its concurrency (``c=16``) or request rate (``8/s``)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for name, rows in series:
        rows = sorted(serve_rows(rows), key=_load_key)  # the line goes from the lightest load up
        if not rows:
            continue
        labels = [point_label(r, varying(rows)) for r in rows]
        ys = [r["output_throughput"] for r in rows]
        _annotated_line(left, [r["median_tpot_ms"] for r in rows], ys, labels, name)
        _annotated_line(right, [r["p99_ttft_ms"] for r in rows], ys, labels, name)
    left.set(xlabel="TPOT p50 (ms)", ylabel="output tok/s", title="output tok/s vs TPOT p50")
    right.set(xlabel="TTFT p99 (ms)", title="output tok/s vs TTFT p99")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def throughput_bar_label(row: dict[str, Any], series: str) -> str:
    """A ``bench throughput`` row's name under its bar: its temperature (``median`` for the median
    row), after its engine when that is not the series' name (transformers' rows)."""
    engine, temp = str(row.get("engine", "?")), row.get("temperature")
    if engine.endswith("(median)"):
        return "median"
    text = "-" if temp is None else f"T={temp}"
    return text if engine == series else f"{engine}\n{text}"


def plot_throughput(series: Sequence[Series], path: str | Path,
                    kv_usage: Sequence[tuple[str, list[tuple[float, float]]]] = ()) -> None:
    """Output tok/s per run, a colour per series (left); KV-cache usage over time per timed run
    (right, when given)."""
    plt = pyplot()
    panels = 2 if kv_usage else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels + 2, 5), squeeze=False)
    bars, colors = axes[0][0], plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ticks: list[int] = []
    names: list[str] = []
    for i, (name, rows) in enumerate(series):
        rows = [r for r in rows if "output_tok_s" in r]
        xs = list(range(len(ticks) + i, len(ticks) + i + len(rows)))  # a gap between series
        drawn = bars.bar(xs, [r["output_tok_s"] for r in rows], color=colors[i % len(colors)], label=name)
        bars.bar_label(drawn, fmt="%.0f", fontsize=8)
        ticks += xs
        names += [throughput_bar_label(r, name) for r in rows]
    bars.set_xticks(ticks, names, fontsize=7)
    bars.set(ylabel="output tok/s", title="output tok/s per run")
    bars.legend(fontsize=8)
    if kv_usage:
        ax = axes[0][1]
        for name, samples in kv_usage:
            ax.plot([t for t, _ in samples], [100 * u for _, u in samples], label=name)
        ax.set(xlabel="seconds into the run", ylabel="KV-cache usage (%)", title="KV-cache usage per engine step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
