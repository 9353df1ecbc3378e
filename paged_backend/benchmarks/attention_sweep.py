"""``paged-backend bench kernels --variants``: paged-attention code paths side by side (CUDA only).

Three of the minimums the kernels are held to (docs/BENCHMARKS.md, "Kernels") were unmet when
this sweep was written: bf16 decode at batch 8 x 4k, the fp8 decode speed-up over bf16, and
prefill against SDPA. The kernel has candidate code paths behind ``AttentionConfig`` fields
(paged_backend/kernels/paged_attention.py) whose defaults are the measured baseline; the variants timed are
listed in ``attention_variants.py``. This module runs them in one process, in jobs of falling
priority (a decode cell with both KV dtypes, or a prefill length)::

    per job   compile every variant in parallel (Triton's AsyncCompileMode, when present)
              check every variant against the reference (decode: the first <= 8 requests of
              the timed batch; prefill: SDPA), before and again after timing
              time them interleaved: decode = CUDA-graph replays of back-to-back calls on
              disjoint block tables (~1 GB per replay, round robin over variants);
              prefill = triton.testing.do_bench (L2 flushed), best of two rounds
    print     one table per job, then a summary against the minimums

A variant that fails to compile or launch (e.g. out of shared memory) is reported and
skipped. ``--budget-s`` bounds the whole sweep: jobs and variants past it are skipped, so
the tables come back inside one time-limited run. Pick winners from the tables and set them in
``pick_config`` / ``pick_num_splits``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from paged_backend.benchmarks.attention_sweep_decode import decode_job
from paged_backend.benchmarks.attention_sweep_prefill import prefill_job
from paged_backend.benchmarks.attention_variants import parse_cells
from paged_backend.benchmarks.results import Row


class VariantSweep:
    """Runs the decode and prefill variant jobs on a ``kernel_bench.Bench``."""

    def __init__(self, bench, budget_s: float) -> None:
        import torch

        self.bench = bench
        self.args = bench.args
        self.torch = torch
        self.dev = bench.dev
        self.deadline = time.time() + budget_s
        self.summary_lines: list[str] = []
        self.report: list[str] = []  # every table line, also written next to --json as <stem>.variants.txt
        self.one = torch.ones((), device=self.dev)

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, line: str) -> None:
        """Print a report line and keep it for the report file."""
        print(line, flush=True)
        self.report.append(line)

    def record(self, group: str, name: str, ms: float, metric: str, value: float, ok: bool, **extra) -> None:
        """One variant's row (the tables print their own lines; ``Bench.summary`` skips these)."""
        self.bench.rows.append(Row(group, name, ms, metric, value, "", ok, extra))

    def checked(self, items: list, compile_one: Callable[[Any], object], error: Callable[[Any], float],
                label: Callable[[Any], str]) -> list[tuple[Any, float]]:
        """Compiles every item's kernels in parallel (errors surface in the check), then runs each
        once: (item, ``error(item)``) for those that ran; the others are reported and dropped."""
        from paged_backend.kernels._launch import async_compiles

        with async_compiles(ignore_errors=True):
            for item in items:
                with contextlib.suppress(Exception):
                    compile_one(item)
        out = []
        for item in items:
            try:
                err = error(item)
            except Exception as e:  # out of shared memory, compile error, ...
                self.say(f"  {label(item)}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            out.append((item, err))
        return out

    # -- driver ---------------------------------------------------------------------------

    def jobs(self, groups: list[str]) -> list[tuple[str, Any]]:
        """Decode cells and prefill lengths (longest first), alternating: first decode cell,
        first prefill length, second decode cell, ..."""
        a = self.args
        lens = sorted((int(x) for x in a.prefill_lens.split(",") if x), reverse=True)
        decode_jobs = [("decode", cell) for cell in parse_cells(a.variant_cells)] if "decode" in groups else []
        prefill_jobs = [("prefill", n) for n in lens] if "prefill" in groups else []
        jobs: list[tuple[str, Any]] = []
        while decode_jobs or prefill_jobs:
            if decode_jobs:
                jobs.append(decode_jobs.pop(0))
            if prefill_jobs:
                jobs.append(prefill_jobs.pop(0))
        return jobs

    def run(self, groups: list[str]) -> None:
        results: dict = {}
        for what, arg in self.jobs(groups):
            if self.left() <= 0:
                self.say(f"  [budget] skipped {what} {arg}")
                continue
            t0 = time.time()
            try:  # one failed job (out of memory, a bug) must not cost the rest of the sweep
                if what == "decode":
                    decode_job(self, *arg, results)
                else:
                    prefill_job(self, arg)
            except Exception:
                self.say(f"  {what} {arg} FAILED:\n{traceback.format_exc(limit=6)}")
                self.bench.failures.append(f"variant job {what} {arg}")
            self.torch.cuda.empty_cache()
            print(f"  [{what} {arg} took {time.time() - t0:.0f} s, {max(0.0, self.left()):.0f} s of budget left]",
                  flush=True)
            self.dump_json()
        self.say("\nVariant summary (best variant whose checks passed, per job):")
        for line in self.summary_lines:
            self.say(f"  {line}")
        self.dump_json()

    def dump_json(self) -> None:
        """Write the rows so far (``bench kernels`` overwrites the JSON at the end) and the tables
        (``<json stem>.variants.txt``), so a run cut short still leaves its results."""
        if not self.args.json:
            return
        with open(self.args.json, "w") as f:
            json.dump({"partial": True, "failures": self.bench.failures,
                       "rows": [asdict(r) for r in self.bench.rows]}, f, indent=1)
        with open(os.path.splitext(self.args.json)[0] + ".variants.txt", "w") as f:
            f.write("\n".join(self.report) + "\n")
