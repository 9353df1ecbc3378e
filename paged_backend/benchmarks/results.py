"""What the kernel benchmarks record and print: a timed row, the correctness check against a
reference (relative error of the output), the run's header line, and the grid options' parsing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    """One timed measurement."""

    group: str
    name: str
    ms: float
    metric: str  # "GB/s" or "TFLOP/s"
    value: float
    target: str = ""
    ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_ints(s: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64] (the benches' comma-separated grid options)."""
    return [int(x) for x in s.split(",") if x]


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| in fp32; inf when ``got`` holds a NaN or an infinity."""
    g, r = got.float(), ref.float()
    if not bool(g.isfinite().all()):
        return math.inf
    return ((g - r).norm() / r.norm().clamp_min(1e-30)).item()


def report_check(name: str, err: float, tol: float, failures: list[str]) -> bool:
    """Prints one check line; a relative error at or above ``tol`` adds ``name`` to ``failures``."""
    ok = err < tol
    print(f"  check {name:<52} rel err {err:.2e} (< {tol:g}) {'ok' if ok else 'FAIL'}", flush=True)
    if not ok:
        failures.append(name)
    return ok


def run_header(device: str, *, before_date: tuple[str, ...] = (), after_date: tuple[str, ...] = ()) -> str:
    """``device NAME | torch V | triton V | ... | DATE | ...``: the first line of a benchmark run."""
    import torch
    import triton

    parts = [f"device {device}", f"torch {torch.__version__}", f"triton {triton.__version__}", *before_date,
             time.strftime("%Y-%m-%d %H:%M:%S"), *after_date]
    return " | ".join(parts)


def versions() -> dict[str, str]:
    """torch's and Triton's versions, as the benchmarks' JSON files record them."""
    import torch
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__}
