"""Timing helpers of the kernel benchmarks: CUDA-graph replays timed with CUDA events,
``triton.testing.do_bench`` medians, wall-clock runs for CPU smoke runs, and how many input
copies a replay rotates over so the L2 cache cannot serve a rerun.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

GIB = 1 << 30


def capture_graph(fns):
    """``fns`` warmed on a side stream (compiles, allocator), then captured back to back and replayed once."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def copies_to_touch(nbytes: float, touch: float, most: int, least: int = 1) -> int:
    """How many input copies a graph replay rotates over so it moves >= ``touch`` bytes (L2 then
    cannot serve a rerun), ``nbytes`` per copy, between ``least`` and ``most``."""
    return max(least, min(most, math.ceil(touch / max(1, nbytes))))


def replay_ms(graph) -> float:
    """GPU time (ms) of one replay of ``graph``, between two CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median(values: Sequence[float]) -> float:
    """The upper median (the middle element of the sorted values)."""
    return sorted(values)[len(values) // 2]


def time_graph_ms(fns, replays: int = 20) -> float:
    """Median GPU time per call (ms) of ``fns`` captured back to back in one CUDA graph."""
    graph = capture_graph(fns)
    times = [replay_ms(graph) for _ in range(replays)]
    del graph
    return median(times) / len(fns)


def time_graphs_round_robin(fn_lists: list[list], rounds: int = 20,
                            capture_more: Callable[[], bool] = lambda: True) -> list[float | None]:
    """Per list: median ms per call over ``rounds`` replays of one CUDA graph holding the calls
    back to back; the graphs replay round robin so drift hits every list alike. A list whose
    capture fails, or comes after ``capture_more()`` turned false, gets None."""
    graphs: list = []
    for fns in fn_lists:
        if not capture_more():
            graphs.append(None)
            continue
        try:
            graphs.append(capture_graph(fns))  # warms the allocator / split counters first
        except Exception as e:
            print(f"  graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            graphs.append(None)
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            if graph is not None:
                times[i].append(replay_ms(graph) / len(fn_lists[i]))
    return [median(t) if t else None for t in times]


def do_bench_ms(fn, rep: int, warmup: int = 25) -> float:
    """Median ms of ``triton.testing.do_bench`` (L2 flushed before every run), after one untimed call."""
    import torch
    import triton

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_cpu_us(fns, reps: int = 2) -> float:
    """Wall-clock median per call (us) of a few plain runs (CPU smoke runs only)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for f in fns:
            f()
        times.append((time.perf_counter() - t) / len(fns))
    return 1e6 * median(times)
