"""``bench quant``'s closing output: with ``--sweep`` the best int4 config per cell and the
suggested ``default_config`` per M, then the table of every variant against bf16 cuBLAS.
"""

from __future__ import annotations

from typing import Any

from paged_backend.benchmarks.quant_sweep import suggested_defaults

COLUMNS = ["int4", "int4 act-order", "fp8 token", "fp8 tensor", "fp8 token nopad", "fp8 tensor nopad",
           "fp8 gemm only"]


def print_sweep(sweep_rows: list[dict[str, Any]]) -> None:
    best: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in sweep_rows:
        key = (r["K"], r["N"], r["M"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nbest int4 config per cell:")
    for (k, n, m), r in sorted(best.items()):
        print(f"  {k}x{n} M={m}: {r['us']:.2f} us ({r['speedup']:.2f}x bf16) [{r['config']}]")
    print("\nsuggested int4 default_config per M (worst slowdown vs each shape's best):")
    for m, v in suggested_defaults(sweep_rows).items():
        print(f"  M={m}: Int4Config({', '.join(f'{a}={b!r}' for a, b in v['config'].items())})"
              f"  worst {v['worst_slowdown']:.2f}x")


def _cell(c: str, m: int, r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    flag = ""
    if c == "int4" and m in (1, 64):
        flag = " ok" if r["speedup"] >= (3.0 if m == 1 else 1.0) else " **below**"
    return f"{r['us']:.1f} ({r['speedup']:.2f}x){flag}"


def print_summary(rows: list[dict[str, Any]], sweep_rows: list[dict[str, Any]], failures: list[str]) -> None:
    cells: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["K"], r["N"], r["M"]), {})[r["variant"]] = r
    cols = [c for c in COLUMNS if any(c in v for v in cells.values())]
    if sweep_rows:
        print_sweep(sweep_rows)
    print("\nus per call (speed-up over bf16 cuBLAS); targets: int4 >= 3x at M=1, >= 1x at M=64")
    print("| K x N | M | bf16 | " + " | ".join(cols) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in cols) + " |")
    for (k, n, m), v in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        bf = v.get("bf16 cuBLAS")
        bf_us = f"{bf['us']:.1f}" if bf else "-"
        print(f"| {k} x {n} | {m} | {bf_us} | " + " | ".join(_cell(c, m, v.get(c)) for c in cols) + " |")
    if failures:
        print(f"\nCHECKS FAILED: {', '.join(failures)}")
