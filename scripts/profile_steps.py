"""Where an engine step goes on CUDA: per-step host time by phase, and the GPU's idle time.

Usage: python scripts/profile_steps.py [--shape llama-3.2-1b] [--running 256,512] [--input-len 256]
       [--output-len 64] [--temperature 0] [--kv-cache-dtype auto] [--no-async-scheduling]

For each count of running requests N, N prompts of random token ids (random weights of the
named shape, EOS ignored) are generated together; the decode steps with all N requests running
are measured:

- host time per step, by phase: schedule (scheduler), runner (step inputs + forward launch),
  finish (appending the previous step's tokens, stop checks, outputs; the wait for those ids
  is counted apart as "wait"), sample (sampler launch + copy of the ids to pinned memory);
  "host" = all but the wait, i.e. what the GPU would wait for if nothing overlapped;
- the GPU's idle time: kernels and copies of a window of decode steps traced with
  torch.profiler; busy = the union of their intervals, idle = the window's span minus busy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from paged_backend.benchmarks.model_shapes import write_shape_config
from paged_backend.benchmarks.throughput import random_prompts
from paged_backend.engine.llm import LLM
from paged_backend.sampling_params import SamplingParams

PHASES = ("schedule", "runner", "wait", "finish", "sample")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_busy_idle(trace_path: str) -> tuple[float, float, int]:
    """(busy ms, idle ms, kernels) over the span of the trace's GPU kernels, copies and sets."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not spans:
        return 0.0, 0.0, 0
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in spans) - spans[0][0]
    return busy / 1e3, (span - busy) / 1e3, len(spans)


def _timed(cur: dict[str, float], phase: str, fn):
    """``fn`` adding its wall time to ``cur[phase]``."""
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            cur[phase] += time.perf_counter() - t
    return wrapper


def _wrap_phases(eng, cur: dict[str, float]) -> dict[str, Any]:
    """Times the engine's step phases into ``cur`` (the wait for the sampled ids apart from
    finish; rows and tokens of the step's batch too); returns the originals for ``_unwrap``."""
    orig = {"schedule": eng.scheduler.schedule, "execute": eng.runner.execute, "finish": eng._finish,
            "launch": eng._launch_sampling, "step": eng.step}

    def finish(launched):
        if launched.event is not None:
            t = time.perf_counter()
            launched.event.synchronize()
            cur["wait"] += time.perf_counter() - t
        return _timed(cur, "finish", orig["finish"])(launched)

    def execute(sched, *a, **kw):
        cur["rows"] = len(sched.scheduled)
        cur["tokens"] = sum(s.num_new_tokens for s in sched.scheduled)
        return _timed(cur, "runner", orig["execute"])(sched, *a, **kw)

    eng.scheduler.schedule = _timed(cur, "schedule", orig["schedule"])
    eng.runner.execute, eng._finish = execute, finish
    eng._launch_sampling = _timed(cur, "sample", orig["launch"])
    return orig


def _unwrap(eng, orig: dict[str, Any]) -> None:
    eng.scheduler.schedule, eng.runner.execute = orig["schedule"], orig["execute"]
    eng._finish, eng._launch_sampling, eng.step = orig["finish"], orig["launch"], orig["step"]


def _summarize(n: int, steps: list[dict[str, float]], trace: str) -> dict[str, Any]:
    """The row of N: median phase times over the full decode steps, GPU busy / idle per traced step."""
    busy, idle, kernels = gpu_busy_idle(trace)
    traced = [s for s in steps if s["traced"]]
    med = {p: statistics.median(s.get(p, 0.0) for s in steps) * 1e3 for p in (*PHASES, "step")}
    host = statistics.median(sum(s.get(p, 0.0) for p in PHASES if p != "wait") for s in steps) * 1e3
    return dict(running=n, steps=len(steps), step_ms=med["step"], host_ms=host,
                **{f"{p}_ms": med[p] for p in PHASES},
                traced_steps=len(traced), gpu_busy_ms=busy / len(traced), gpu_idle_ms=idle / len(traced),
                gpu_idle_pct=100 * idle / (busy + idle) if busy + idle else 0.0, kernels_per_step=kernels / len(traced))


def measure(llm: LLM, n: int, args: argparse.Namespace) -> dict[str, Any]:
    eng = llm.engine
    prompts = random_prompts(n, args.input_len, eng.info.vocab_size, seed=10 + n)
    sp = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True,
                        detokenize=False, temperature=args.temperature)
    cur: dict[str, float] = defaultdict(float)
    steps: list[dict[str, float]] = []
    window = (args.skip_steps, args.skip_steps + args.trace_steps)
    trace = tempfile.mktemp(suffix=".json")
    prof = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
    decode_seen = 0
    tracing = False
    orig = _wrap_phases(eng, cur)

    def step():
        nonlocal decode_seen, tracing
        cur.clear()
        full = eng.scheduler.num_running == n and not eng.scheduler.num_waiting
        if full and decode_seen == window[0] and not tracing:
            sync()
            prof.start()
            tracing = True
        t = time.perf_counter()
        out = orig["step"]()
        cur["step"] = time.perf_counter() - t
        if full and cur.get("rows") == n == cur.get("tokens"):
            decode_seen += 1
            if decode_seen == window[1]:
                sync()
                prof.stop()
                prof.export_chrome_trace(trace)
            steps.append(dict(cur, traced=float(window[0] < decode_seen <= window[1])))
        return out

    eng.step = step
    try:
        llm.generate(prompts, sp, use_tqdm=False)
    finally:
        _unwrap(eng, orig)
    if decode_seen < window[1]:
        raise SystemExit(f"N={n}: only {decode_seen} full decode steps, fewer than the trace window {window}")
    row = _summarize(n, steps, trace)
    os.unlink(trace)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--running", default="256,512", help="comma-separated counts of running requests")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--skip-steps", type=int, default=8, help="full decode steps before the traced window")
    p.add_argument("--trace-steps", type=int, default=24, help="decode steps traced for the GPU idle time")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--json", default=None, help="append one JSON line per N")
    args = p.parse_args()
    llm = LLM(model=write_shape_config(args.shape), load_format="dummy", max_model_len=2048, disable_log_stats=True,
              kv_cache_dtype=args.kv_cache_dtype, async_scheduling=args.async_scheduling)
    eng = llm.engine
    warm = random_prompts(16, args.input_len, eng.info.vocab_size, seed=2)
    llm.generate(warm, SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True, detokenize=False,
                                      temperature=args.temperature), use_tqdm=False)
    print(f"{args.shape}, kv {args.kv_cache_dtype}, temperature {args.temperature}, async "
          f"{eng.async_scheduling}, {args.input_len} in / {args.output_len} out; medians over the decode "
          f"steps with every request running (ms)")
    cols = ["running", "steps", "step_ms", "host_ms", *(f"{p}_ms" for p in PHASES), "gpu_busy_ms", "gpu_idle_ms",
            "gpu_idle_pct", "kernels_per_step"]
    print(" | ".join(cols))
    for n in (int(x) for x in args.running.split(",")):
        row = measure(llm, n, args)
        print(" | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in cols))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(row, shape=args.shape, temperature=args.temperature,
                                        kv=args.kv_cache_dtype, async_scheduling=eng.async_scheduling)) + "\n")


if __name__ == "__main__":
    main()
