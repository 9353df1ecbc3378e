"""``bench throughput --plot``: output tok/s per run beside a peer's results file (``--compare``),
and the KV-cache usage of each timed run over time, read from the engine's per-step stats.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from paged_backend.benchmarks.bench_plot import (
    PlotUnavailable,
    add_plot_args,
    load_json_lines,
    plot_throughput,
)


class KVUsageTrace:
    """(seconds since the start, KV-cache usage) after every engine step while active.

    It wraps the engine's ``stats.on_step`` (called once a step with the KV manager) on this
    one engine object, and puts it back on exit; the engine's code is not changed.
    """

    def __init__(self, engine: Any) -> None:
        self.stats = engine.stats
        self.samples: list[tuple[float, float]] = []
        self._t0 = 0.0

    def __enter__(self) -> KVUsageTrace:
        original = self.stats.on_step
        self._t0 = time.perf_counter()

        def on_step(computed_tokens: int, sampled_tokens: int, scheduler: Any, kv: Any) -> None:
            original(computed_tokens, sampled_tokens, scheduler, kv)
            self.samples.append((time.perf_counter() - self._t0, float(kv.usage)))

        self.stats.on_step = on_step  # an instance attribute shadowing the method
        return self

    def __exit__(self, *exc: object) -> None:
        del self.stats.on_step


def add_throughput_plot_args(p: argparse.ArgumentParser) -> None:
    add_plot_args(p, plot_help="draw output tok/s per run, and the KV-cache usage over each timed run",
                  compare_help="a peer's results (JSON lines with output_tok_s, as --json writes them and the "
                  "vLLM peer script does), drawn beside ours")


def write_throughput_plot(args: argparse.Namespace, rows: list[dict[str, Any]],
                          kv_traces: list[tuple[str, list[tuple[float, float]]]]) -> bool:
    """The plot of ``rows`` (and the ``--compare`` file's); False (said on stderr) without matplotlib."""
    series = [("paged-backend", rows)]
    if args.compare:
        peer = [r for r in load_json_lines(args.compare) if "output_tok_s" in r]
        if not peer:
            print(f"warning: --compare {args.compare} has no row with output_tok_s", file=sys.stderr)
        name = args.compare_label or Path(args.compare).stem
        series.append((name, [r if "engine" in r else dict(r, engine=name) for r in peer]))
    try:
        plot_throughput(series, args.plot, kv_usage=kv_traces)
    except PlotUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    print(f"plot: {args.plot}")
    return True
