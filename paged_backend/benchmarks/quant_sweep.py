"""``bench quant --sweep``: the int4 kernel's launch configs at one (shape, M) cell, and the
``default_config`` per M they suggest.

Stage 1 times ``sweep_candidates`` (the FMA GEMV and the tl.dot paths, tiles, warps, stages;
automatic split-K), stage 2 split-K counts and the reduce kernel on the two best. Every config is
checked first (a wrong or failing one is dropped, never timed); ``--sweep-budget`` caps the
seconds (later candidates are skipped, the defaults always run).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any


def sweep_candidates(m: int) -> list[Any]:
    """Stage-1 configs for ``m`` rows (automatic split-K): the FMA GEMV for up to four rows
    (output columns per thread, warps, k-block, prefetch), the tl.dot path (W^T x^T for few
    tokens, x W for many) with its tiles, warps and stages around each default."""
    from paged_backend.kernels.int4_gemm import Int4Config as C

    def dot(bm, bn, bk, w, s, swap=True):
        return C("dot", block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, swap_ab=swap)

    mma = [C("mma", block_m=8 if m <= 8 else 16, block_n=bn, block_k=128, num_warps=w)  # bn < 16 w: warps split K
           for bn, w in ((64, 4), (32, 2), (128, 8), (16, 4), (32, 4), (16, 8), (32, 8), (16, 2))]

    if m <= 4:
        bm = 1 << (m - 1).bit_length()
        gemv = [C("gemv", block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                for bn, bk, w, s in ((128, 128, 4, 2), (128, 128, 4, 3), (128, 128, 2, 2), (128, 128, 2, 3),
                                     (256, 128, 4, 2), (64, 128, 2, 2), (128, 128, 4, 1), (64, 128, 1, 2))]
        return mma + (gemv if m == 1 else gemv[:4]) + [dot(16, 128, 128, 4, 3), dot(16, 256, 128, 8, 3),
                                                         dot(16, 64, 128, 4, 3)]
    if m <= 16:
        return mma + [dot(16, 128, 128, 4, 3), dot(16, 256, 128, 8, 3), dot(16, 64, 128, 4, 3), dot(16, 128, 64, 4, 4),
                dot(16, 128, 128, 8, 3), dot(16, 128, 128, 4, 4), dot(16, 128, 128, 4, 3, swap=False)]
    if m <= 64:
        bm = 32 if m <= 32 else 64
        return [dot(bm, 128, 128, 4, 3), dot(bm, 256, 128, 8, 3), dot(32, 128, 128, 4, 4), dot(bm, 128, 128, 8, 3),
                dot(bm, 64, 128, 4, 4), dot(bm, 128, 128, 4, 3, swap=False), dot(bm, 128, 64, 4, 4, swap=False)]
    return [dot(128, 128, 64, 8, 3, False), dot(128, 128, 128, 8, 3, False), dot(128, 256, 64, 8, 3, False),
            dot(256, 128, 64, 8, 3, False), dot(64, 128, 64, 4, 4, False), dot(128, 64, 64, 4, 4, False),
            dot(128, 128, 64, 4, 4, False), dot(128, 256, 64, 8, 3), dot(128, 128, 128, 8, 3)]


def split_candidates(m: int) -> list[int]:
    return [1, 2, 4, 8, 16, 32] if m <= 16 else ([1, 2, 4, 8] if m <= 64 else [1, 2, 4])


def sweep_cell(bench, x, ws: list, k: int, n: int, m: int, bf16_us: float) -> None:
    """Every candidate config of one cell on a ``quant_bench.QuantBench``; the results go to
    ``bench.sweep_rows``, fastest first."""
    from paged_backend.kernels.int4_gemm import _mma_ok, default_config

    act_order = ws[0].perm is not None
    ref = bench.int4_ref(x, ws[0])
    t0 = time.time()
    results: list[dict[str, Any]] = []
    skipped = 0

    def trial(cfg) -> None:
        nonlocal skipped
        if any(r["cfg"] == cfg for r in results):
            return
        if time.time() - bench.sweep_t0 > bench.args.sweep_budget:
            skipped += 1
            return
        r = bench.int4_cell(x, ws, k, n, m, act_order, bf16_us, config=cfg, variant="sweep", ref=ref)
        if r is not None:
            r["cfg"] = cfg
            results.append(r)

    gs = k if ws[0].group_size == -1 else ws[0].group_size
    default = default_config(m, n, k, gs, act_order, _mma_ok(x))
    trial(default)
    if default.path == "dot":  # the paired 16-bit dequantization against the fp32 route
        trial(dataclasses.replace(default, pairs=False))
    for cfg in sweep_candidates(m):  # stage 1: kernels, tiles, warps, stages (automatic split-K)
        trial(cfg)
    for best in sorted(results, key=lambda r: r["us"])[:2]:  # stage 2: split-K on the two best
        for sk in split_candidates(m):
            trial(dataclasses.replace(best["cfg"], split_k=sk))
        trial(dataclasses.replace(best["cfg"], reduce="kernel"))
    results.sort(key=lambda r: r["us"])
    for r in results:
        bench.sweep_rows.append({key: v for key, v in r.items() if key != "cfg"} | {
            "cfg": dataclasses.asdict(r["cfg"])})
    note = f", {skipped} skipped (budget)" if skipped else ""
    if not results:
        print(f"  sweep {k}x{n} M={m}: no config ran{note}", flush=True)
        return
    top = results[0]
    default_row = next((r for r in bench.rows if r["variant"] == ("int4 act-order" if act_order else "int4")
                        and (r["K"], r["N"], r["M"]) == (k, n, m)), None)
    base = f", default {default_row['us']:.2f} us" if default_row else ""
    print(f"  sweep {k}x{n} M={m}: {len(results)} configs in {time.time() - t0:.0f} s{note}; best "
          f"{top['us']:.2f} us [{top['config']}] ({bf16_us / top['us']:.2f}x bf16){base}", flush=True)


def suggested_defaults(sweep_rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per M: the config whose worst slowdown against each shape's best is smallest."""
    by_m: dict[int, dict[tuple[int, int], list[dict[str, Any]]]] = {}
    for r in sweep_rows:
        by_m.setdefault(r["M"], {}).setdefault((r["K"], r["N"]), []).append(r)
    out = {}
    for m, shapes in sorted(by_m.items()):
        best = {s: min(r["us"] for r in rows) for s, rows in shapes.items()}
        scores: dict[str, list[float]] = {}
        cfgs: dict[str, dict[str, Any]] = {}
        for s, rows in shapes.items():
            for r in rows:
                key = json.dumps(r["cfg"], sort_keys=True)
                cfgs[key] = r["cfg"]
                scores.setdefault(key, []).append(r["us"] / best[s])
        full = {key: v for key, v in scores.items() if len(v) == len(shapes)}
        if not full:
            continue
        key = min(full, key=lambda c: (max(full[c]), sum(full[c])))
        out[str(m)] = {"config": cfgs[key], "worst_slowdown": round(max(full[key]), 3)}
    return out
