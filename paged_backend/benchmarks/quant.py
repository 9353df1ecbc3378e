"""``paged-backend bench quant``: quantized-weight GEMMs against bf16 cuBLAS on the GPU (CUDA only).

For each K x N (Llama-3.1-8B's 4096 x 4096, 4096 x 14336, 14336 x 4096) and each M (1, 16, 64,
256), in one process:

    bf16        torch.matmul(x, W.T): cuBLAS on the dense bf16 weight (the baseline)
    int4        the Triton W4A16 kernel (kernels/int4_gemm.py), group 128, fp16 scales (as the
                checkpoints store them), act-order off / on, ``default_config``
    fp8 token   torch._scaled_mm, e4m3 weight with per-channel scales, activations quantized per
                token by kernels/fp8_quant.py (what FP8_DYNAMIC checkpoints run), M padded to 17
    fp8 tensor  same with one weight scale and a dynamic per-tensor activation scale (tensor-wise)
    ... nopad   the two fp8 rows without padding M to 17 rows
    fp8 gemm    torch._scaled_mm alone on already-quantized activations (the quantization's cost
                is the difference)

Every variant is first checked against dequantize + matmul (relative error of the output);
a failed check is reported and the variant is not timed. Times are medians of CUDA-graph
replays of back-to-back calls on rotating weight copies (>= 256 MB touched per replay, so the
50 MB L2 cannot serve a rerun, and no host launch overhead): per-call GPU time.

``--sweep`` then times, per (shape, M), the previous kernel with its default
(kernels/int4_gemm_legacy.py, the "int4 legacy" column) and the new kernel's candidate configs
(``sweep_candidates``: the FMA GEMV and the tl.dot paths, tiles, warps, stages, split-K
reductions), then split-K counts on the two best; each config is checked first (a wrong or
failing one is dropped, never timed). It prints the best per cell and a suggested
``default_config`` per M (the config with the smallest worst-case slowdown over the shapes);
``--sweep-budget`` caps its seconds (later candidates are skipped, defaults always run). The
summary table is printed last; ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any

TOUCH_BYTES = 256 << 20  # bytes of weights read per graph replay (>> the H200's 50 MB L2)
MAX_COPIES = 32
INT4_TOL = 1e-2  # relative error vs the reference (bf16 output rounding is ~4e-3)
FP8_TOL = 1e-2


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def _shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        k, n = part.lower().split("x")
        out.append((int(k), int(n)))
    return out


def build_parser(prog: str = "paged-backend bench quant") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", default="1,16,64,256", help="rows of x (tokens)")
    p.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096", help="K x N of the weight")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--only", nargs="+", choices=["int4", "fp8"], default=None, help="only these weight types")
    p.add_argument("--sweep", action="store_true", help="also sweep the int4 kernel's launch configs")
    p.add_argument("--sweep-act-order", action="store_true", help="sweep with act-order on (default off)")
    p.add_argument("--sweep-budget", type=float, default=240.0,
                   help="seconds (from the start of the run) after which further sweep candidates are skipped")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json", default=None, help="write every row here as JSON")
    p.add_argument("--device", default="cuda",
                   help="cuda; cpu = a smoke run of every code path (TRITON_INTERPRET=1; times meaningless)")


def add_quant_parser(sub) -> None:
    """Registers ``bench quant`` on the ``paged-backend bench`` subparsers."""
    p = sub.add_parser("quant", help="int4 / fp8 weight GEMMs vs bf16 cuBLAS, optional int4 tuning sweep (CUDA)")
    add_arguments(p)
    p.set_defaults(func=lambda args: run(args))


# -- timing and checks --------------------------------------------------------------------


def time_graph_us(fns, replays: int) -> float:
    """Median GPU time per call (us) of ``fns`` captured back to back in one CUDA graph."""
    from paged_backend.benchmarks.kernels import time_graph_ms

    return 1000.0 * time_graph_ms(fns, replays)


def _time_cpu_us(fns, reps: int = 2) -> float:
    """Wall-clock median per call of a few plain runs (CPU smoke runs only)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for f in fns:
            f()
        times.append((time.perf_counter() - t) / len(fns))
    return 1e6 * sorted(times)[len(times) // 2]


def rel_err(got, want) -> float:
    g, w = got.float(), want.float()
    if not bool(g.isfinite().all()):
        return math.inf
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


def copies_for(nbytes: int, cuda: bool = True) -> int:
    """Weight copies rotated per replay so the L2 cannot serve reruns (1 on the CPU)."""
    from paged_backend.benchmarks.kernels import copies_to_touch

    return copies_to_touch(nbytes, TOUCH_BYTES, MAX_COPIES) if cuda else 1


# -- weights ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Int4Weight:
    qweight: Any  # int32 [N, K/8], the kernel layout
    scales: Any
    zeros: Any
    perm: Any
    group_size: int
    legacy_qweight: Any = None  # int32 [K/8, N] for kernels/int4_gemm_legacy.py (made on demand)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros)
                   if t is not None) + (self.perm.numel() * 4 if self.perm is not None else 0)

    def legacy(self):
        if self.legacy_qweight is None:
            from paged_backend.kernels.int4_gemm_legacy import legacy_layout

            self.legacy_qweight = legacy_layout(self.qweight)
        return self.legacy_qweight


def make_int4(k: int, n: int, group_size: int, act_order: bool, seed: int, dev) -> Int4Weight:
    """Random nibbles, zero points near 8, fp16 scales ~ 1 / (8 sqrt(K)) (outputs of order one)."""
    import torch

    from paged_backend.quantization.int4 import random_int32

    gen = torch.Generator(device=dev).manual_seed(seed)
    g = k // (k if group_size == -1 else group_size)
    qweight = random_int32((n, k // 8), gen, dev)
    zeros = torch.randint(6, 11, (g, n), generator=gen, device=dev, dtype=torch.uint8)
    scales = ((torch.rand(g, n, generator=gen, device=dev) + 0.5) / (8 * math.sqrt(k))).to(torch.float16)
    perm = torch.randperm(k, generator=gen, device=dev).to(torch.int32) if act_order else None
    return Int4Weight(qweight, scales, zeros, perm, group_size)


def make_fp8(w_bf16, uniform: bool):
    """e4m3 [N, K] with per-channel scales (or one scale when ``uniform``) from a dense weight."""
    import torch

    from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, FP8_MAX, fp8_scale_from_amax

    w = w_bf16.float()
    amax = w.abs().amax() * torch.ones(w.shape[0], device=w.device) if uniform else w.abs().amax(dim=1)
    scale = fp8_scale_from_amax(amax)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(1, -1).contiguous(), (scale[:1].clone() if uniform else None)


# -- the benchmark -----------------------------------------------------------------------------


class QuantBench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.torch = torch
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.timer = time_graph_us if self.cuda else (lambda fns, replays: _time_cpu_us(fns))
        self.rows: list[dict[str, Any]] = []
        self.sweep_rows: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.sweep_t0 = time.time()  # --sweep-budget counts from the start of the run

    def record(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        us, gbs = row.get("us"), row.get("weight_GBps")
        extra = f" {row['speedup']:.2f}x bf16" if row.get("speedup") else ""
        cfg = f"  [{row['config']}]" if row.get("config") else ""
        print(f"  {row['K']:>5}x{row['N']:<5} M={row['M']:<4} {row['variant']:<18} "
              f"{us:9.2f} us {gbs:8.0f} GB/s{extra}{cfg}", flush=True)
        return row

    def check(self, name: str, err: float, tol: float) -> bool:
        ok = err < tol
        print(f"  check {name:<52} rel err {err:.2e} (< {tol:g}) {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            self.failures.append(name)
        return ok

    def run_shape(self, k: int, n: int) -> None:
        torch = self.torch
        a = self.args
        only = a.only or ["int4", "fp8"]
        dev = self.dev
        gen = torch.Generator(device=dev).manual_seed(k * 7 + n)
        w_dense = (torch.randn(n, k, generator=gen, device=dev) / math.sqrt(k)).to(torch.bfloat16)
        dense = [w_dense] + [w_dense.clone() for _ in range(copies_for(w_dense.numel() * 2, self.cuda) - 1)]
        int4 = {}
        if "int4" in only:
            for act_order in (False, True):
                first = make_int4(k, n, a.group_size, act_order, seed=k + n, dev=dev)
                int4[act_order] = [first] + [make_int4(k, n, a.group_size, act_order, seed=k + n + i, dev=dev)
                                             for i in range(1, copies_for(first.nbytes, self.cuda))]
        fp8 = {}
        if "fp8" in only:
            for uniform in (False, True):
                q, row, one = make_fp8(w_dense, uniform)
                fp8[uniform] = [(q if i == 0 else q.clone(), row, one) for i in range(copies_for(q.numel(), self.cuda))]
        for m in _ints(a.m):
            x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
            bf16_us = self.timer([lambda w=w, x=x: torch.matmul(x, w.t()) for w in dense], a.replays)
            self.record(kind="bf16", variant="bf16 cuBLAS", K=k, N=n, M=m, us=bf16_us,
                        weight_GBps=2 * k * n / (bf16_us * 1e3), speedup=None)
            if "int4" in only:
                for act_order, ws in int4.items():
                    self._int4_cell(x, ws, k, n, m, act_order, bf16_us)
            if "fp8" in only:
                self._fp8_cells(x, w_dense, fp8, k, n, m, bf16_us)
            if a.sweep and "int4" in only:
                self._sweep_cell(x, int4[bool(a.sweep_act_order)], k, n, m, bf16_us)
        del dense, int4, fp8
        if self.cuda:
            torch.cuda.empty_cache()

    # -- int4 ----------------------------------------------------------------------------------

    def _int4_ref(self, x, w: Int4Weight):
        from paged_backend.kernels.int4_gemm_ref import dequantize_int4_ref

        wd = dequantize_int4_ref(w.qweight, w.scales, w.zeros, w.group_size, self.torch.bfloat16).float()
        xs = x.float() if w.perm is None else x.float().index_select(1, w.perm.long())
        return xs @ wd

    def _int4_cell(self, x, ws: list[Int4Weight], k: int, n: int, m: int, act_order: bool, bf16_us: float,
                   config=None, variant: str | None = None, ref=None, legacy: bool = False) -> dict[str, Any] | None:
        """Checks then times one int4 variant: ``config=None`` is the default (recorded, a failure
        counts), a config is a sweep candidate (returned, dropped when wrong or failing),
        ``legacy`` the previous kernel with its default (recorded)."""
        from paged_backend.kernels import int4_gemm_legacy
        from paged_backend.kernels.int4_gemm import _device_index, _mma_ok, _plan, int4_gemm

        variant = variant or ("int4 act-order" if act_order else "int4")
        name = f"{variant} {k}x{n} M={m}" + (f" [{config.label()}]" if config else "")
        recorded = config is None

        def call(w: Int4Weight, check: bool):
            if legacy:
                return int4_gemm_legacy.int4_gemm(x, w.legacy(), w.scales, w.zeros, w.group_size, w.perm, check=check)
            return int4_gemm(x, w.qweight, w.scales, w.zeros, w.group_size, w.perm, config=config, check=check)

        w0 = ws[0]
        try:
            got = call(w0, True)
            err = rel_err(got, self._int4_ref(x, w0) if ref is None else ref)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            if recorded:  # the defaults must work; a swept config may not
                self.failures.append(name)
            return None
        if recorded:
            if not self.check(name, err, INT4_TOL):
                return None
        elif err >= INT4_TOL:
            print(f"  {name}: rel err {err:.2e} -> dropped", flush=True)
            return None
        us = self.timer([lambda w=w: call(w, False) for w in ws], self.args.replays)
        if legacy:
            label = f"legacy {int4_gemm_legacy.default_config(m, n, k, w0.group_size).label()}"
        else:
            gs = k if w0.group_size == -1 else w0.group_size  # as the launcher passes it
            plan = _plan(m, n, k, gs, _device_index(x.device), config, w0.perm is not None, _mma_ok(x))
            label = f"{plan.cfg.label()} -> split {plan.splits}"
        row = dict(kind="int4", variant=variant, K=k, N=n, M=m, us=us, weight_GBps=w0.nbytes / (us * 1e3),
                   speedup=bf16_us / us, config=label, act_order=act_order)
        return self.record(**row) if recorded else row

    # -- fp8 -----------------------------------------------------------------------------------

    def _fp8_cells(self, x, w_dense, fp8, k: int, n: int, m: int, bf16_us: float) -> None:
        torch = self.torch
        from paged_backend.kernels.fp8_quant import quantize_fp8
        from paged_backend.kernels.fp8_quant_ref import fp8_scale_from_amax, quantize_fp8_ref
        from paged_backend.quantization.fp8 import fp8_linear, scaled_mm_support

        tensorwise, rowwise = scaled_mm_support(torch.cuda.current_device()) if self.cuda else (True, True)
        if not tensorwise:
            print(f"  fp8: torch._scaled_mm is not available on this GPU/torch (row-wise: {rowwise})")
            return
        variants = [("fp8 token", False, "dynamic_token", 17), ("fp8 token nopad", False, "dynamic_token", 0),
                    ("fp8 tensor", True, "dynamic_tensor", 17), ("fp8 tensor nopad", True, "dynamic_tensor", 0)]
        for name, uniform, scheme, min_rows in variants:
            ws = fp8[uniform]
            q, row, one = ws[0]
            label = f"{name} {k}x{n} M={m}"
            try:
                got = fp8_linear(x, q, row, one, scheme, min_rows=min_rows, rowwise=rowwise)
                xq, xs = quantize_fp8_ref(x, per_token=scheme == "dynamic_token")
                want = (xq.float() * xs) @ (q.float() * row.t()).t()
                ok = self.check(label, rel_err(got, want), FP8_TOL)
            except Exception as e:  # noqa: BLE001
                print(f"  {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                self.failures.append(label)
                continue
            if not ok:
                continue
            us = self.timer([lambda w=w, s=scheme, r=min_rows: fp8_linear(x, w[0], w[1], w[2], s, min_rows=r,
                                                                           rowwise=rowwise) for w in ws],
                               self.args.replays)
            self.record(kind="fp8", variant=name, K=k, N=n, M=m, us=us, weight_GBps=k * n / (us * 1e3),
                        speedup=bf16_us / us)
        # the GEMM alone: tensor-wise scales on activations quantized beforehand
        xs1 = fp8_scale_from_amax(x.abs().amax().reshape(1))
        xq, _ = quantize_fp8(x.contiguous(), xs1)
        us = self.timer([lambda w=w: torch._scaled_mm(xq, w[0].t(), scale_a=xs1, scale_b=w[2],
                                                         out_dtype=torch.bfloat16) for w in fp8[True]],
                           self.args.replays)
        self.record(kind="fp8", variant="fp8 gemm only", K=k, N=n, M=m, us=us, weight_GBps=k * n / (us * 1e3),
                    speedup=bf16_us / us)

    # -- int4 sweep ------------------------------------------------------------------------------

    def _sweep_cell(self, x, ws: list[Int4Weight], k: int, n: int, m: int, bf16_us: float) -> None:
        from paged_backend.kernels.int4_gemm import _mma_ok, default_config

        act_order = ws[0].perm is not None
        ref = self._int4_ref(x, ws[0])
        t0 = time.time()
        results: list[dict[str, Any]] = []
        skipped = 0

        def trial(cfg) -> None:
            nonlocal skipped
            if any(r["cfg"] == cfg for r in results):
                return
            if time.time() - self.sweep_t0 > self.args.sweep_budget:
                skipped += 1
                return
            r = self._int4_cell(x, ws, k, n, m, act_order, bf16_us, config=cfg, variant="sweep", ref=ref)
            if r is not None:
                r["cfg"] = cfg
                results.append(r)

        legacy = self._int4_cell(x, ws, k, n, m, act_order, bf16_us, variant="int4 legacy", legacy=True)
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
            self.sweep_rows.append({key: v for key, v in r.items() if key != "cfg"} | {
                "cfg": dataclasses.asdict(r["cfg"])})
        note = f", {skipped} skipped (budget)" if skipped else ""
        if not results:
            print(f"  sweep {k}x{n} M={m}: no config ran{note}", flush=True)
            return
        top = results[0]
        default = next((r for r in self.rows if r["variant"] == ("int4 act-order" if act_order else "int4")
                        and (r["K"], r["N"], r["M"]) == (k, n, m)), None)
        base = (f"default {default['us']:.2f} us, " if default else "") + (
            f"legacy {legacy['us']:.2f} us" if legacy else "legacy failed")
        print(f"  sweep {k}x{n} M={m}: {len(results)} configs in {time.time() - t0:.0f} s{note}; best "
              f"{top['us']:.2f} us [{top['config']}] ({bf16_us / top['us']:.2f}x bf16), {base}", flush=True)

    def suggested_defaults(self) -> dict[str, dict[str, Any]]:
        """Per M: the config whose worst slowdown against each shape's best is smallest."""
        by_m: dict[int, dict[tuple[int, int], list[dict[str, Any]]]] = {}
        for r in self.sweep_rows:
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

    # -- output --------------------------------------------------------------------------------

    def summary(self) -> None:
        cells: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = {}
        for r in self.rows:
            cells.setdefault((r["K"], r["N"], r["M"]), {})[r["variant"]] = r
        cols = ["int4", "int4 act-order", "fp8 token", "fp8 tensor", "fp8 token nopad", "fp8 tensor nopad",
                "fp8 gemm only", "int4 legacy"]
        cols = [c for c in cols if any(c in v for v in cells.values())]
        if self.sweep_rows:
            best: dict[tuple[int, int, int], dict[str, Any]] = {}
            for r in self.sweep_rows:
                key = (r["K"], r["N"], r["M"])
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
            legacy = {(r["K"], r["N"], r["M"]): r["us"] for r in self.rows if r["variant"] == "int4 legacy"}
            print("\nbest int4 config per cell (vs the previous kernel's default):")
            for (k, n, m), r in sorted(best.items()):
                old = f", {legacy[k, n, m] / r['us']:.2f}x legacy" if (k, n, m) in legacy else ""
                print(f"  {k}x{n} M={m}: {r['us']:.2f} us ({r['speedup']:.2f}x bf16{old}) [{r['config']}]")
            sug = self.suggested_defaults()
            print("\nsuggested int4 default_config per M (worst slowdown vs each shape's best):")
            for m, v in sug.items():
                print(f"  M={m}: Int4Config({', '.join(f'{a}={b!r}' for a, b in v['config'].items())})"
                      f"  worst {v['worst_slowdown']:.2f}x")
        print("\nus per call (speed-up over bf16 cuBLAS); targets: int4 >= 3x at M=1, >= 1x at M=64")
        print("| K x N | M | bf16 | " + " | ".join(cols) + " |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in cols) + " |")
        for (k, n, m), v in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            bf = v.get("bf16 cuBLAS")
            parts = []
            for c in cols:
                r = v.get(c)
                if r is None:
                    parts.append("-")
                    continue
                flag = ""
                if c == "int4" and m in (1, 64):
                    flag = " ok" if r["speedup"] >= (3.0 if m == 1 else 1.0) else " **below**"
                parts.append(f"{r['us']:.1f} ({r['speedup']:.2f}x){flag}")
            bf_us = f"{bf['us']:.1f}" if bf else "-"
            print(f"| {k} x {n} | {m} | {bf_us} | " + " | ".join(parts) + " |")
        if self.failures:
            print(f"\nCHECKS FAILED: {', '.join(self.failures)}")


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


def run(args: argparse.Namespace) -> int:
    """Entry point of ``paged-backend bench quant``; returns 1 when a check fails."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench quant needs a CUDA device (--device cpu: a smoke run under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    import triton

    bench = QuantBench(args)
    name = torch.cuda.get_device_name() if bench.cuda else "cpu (smoke run)"
    print(f"device {name} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')} | group {args.group_size}", flush=True)
    t0 = time.time()
    for k, n in _shapes(args.shapes):
        bench.run_shape(k, n)
    print(f"  [took {time.time() - t0:.0f} s]", flush=True)
    bench.summary()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__,
                       "triton": triton.__version__, "failures": bench.failures, "rows": bench.rows,
                       "sweep": bench.sweep_rows,
                       "suggested": bench.suggested_defaults() if bench.sweep_rows else None}, f, indent=1)
    return 1 if bench.failures else 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser("python -m paged_backend.benchmarks.quant").parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
