"""``QuantBench``: ``bench quant``'s cells. Per weight shape and M: bf16 cuBLAS, the int4 kernel
(act-order off / on) and the fp8 ``torch._scaled_mm`` variants, each checked against dequantize +
matmul, then timed as CUDA-graph replays over rotating weight copies (wall clock on the CPU).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from paged_backend.benchmarks.quant_sweep import sweep_cell
from paged_backend.benchmarks.quant_weights import Int4Weight, copies_for, make_fp8, make_int4
from paged_backend.benchmarks.results import parse_ints, rel_err, report_check
from paged_backend.benchmarks.timing import time_cpu_us, time_graph_ms

INT4_TOL = 1e-2  # relative error vs the reference (bf16 output rounding is ~4e-3)
FP8_TOL = 1e-2
FP8_VARIANTS = [  # name, one weight scale (tensor-wise), activation scheme, rows M is padded to
    ("fp8 token", False, "dynamic_token", 17), ("fp8 token nopad", False, "dynamic_token", 0),
    ("fp8 tensor", True, "dynamic_tensor", 17), ("fp8 tensor nopad", True, "dynamic_tensor", 0)]


def time_graph_us(fns, replays: int) -> float:
    """Median GPU time per call (us) of ``fns`` captured back to back in one CUDA graph."""
    return 1000.0 * time_graph_ms(fns, replays)


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


class QuantBench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.torch = torch
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.timer = time_graph_us if self.cuda else (lambda fns, replays: time_cpu_us(fns))
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
        return report_check(name, err, tol, self.failures)

    # -- one weight shape --------------------------------------------------------------------

    def _weights(self, k: int, n: int, only: list[str], gen):
        """Copies of a dense bf16 weight, of int4 weights per act-order, and of the dense weight in
        fp8 per scale kind (one scale or per channel)."""
        torch, a, dev = self.torch, self.args, self.dev
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
        return dense, int4, fp8

    def run_shape(self, k: int, n: int) -> None:
        torch = self.torch
        a = self.args
        only = a.only or ["int4", "fp8"]
        gen = torch.Generator(device=self.dev).manual_seed(k * 7 + n)
        dense, int4, fp8 = self._weights(k, n, only, gen)
        for m in parse_ints(a.m):
            x = torch.randn(m, k, generator=gen, device=self.dev).to(torch.bfloat16)
            bf16_us = self.timer([lambda w=w, x=x: torch.matmul(x, w.t()) for w in dense], a.replays)
            self.record(kind="bf16", variant="bf16 cuBLAS", K=k, N=n, M=m, us=bf16_us,
                        weight_GBps=2 * k * n / (bf16_us * 1e3), speedup=None)
            if "int4" in only:
                for act_order, ws in int4.items():
                    self.int4_cell(x, ws, k, n, m, act_order, bf16_us)
            if "fp8" in only:
                self._fp8_cells(x, fp8, k, n, m, bf16_us)
            if a.sweep and "int4" in only:
                sweep_cell(self, x, int4[bool(a.sweep_act_order)], k, n, m, bf16_us)
        del dense, int4, fp8
        if self.cuda:
            torch.cuda.empty_cache()

    # -- int4 ----------------------------------------------------------------------------------

    def int4_ref(self, x, w: Int4Weight):
        from paged_backend.kernels.int4_gemm_ref import dequantize_int4_ref

        wd = dequantize_int4_ref(w.qweight, w.scales, w.zeros, w.group_size, self.torch.bfloat16).float()
        xs = x.float() if w.perm is None else x.float().index_select(1, w.perm.long())
        return xs @ wd

    def int4_cell(self, x, ws: list[Int4Weight], k: int, n: int, m: int, act_order: bool, bf16_us: float,
                  config=None, variant: str | None = None, ref=None) -> dict[str, Any] | None:
        """Checks then times one int4 variant: ``config=None`` is the default (recorded, a failure
        counts), a config is a sweep candidate (returned, dropped when wrong or failing)."""
        from paged_backend.kernels.int4_gemm import _device_index, _mma_ok, _plan, int4_gemm

        variant = variant or ("int4 act-order" if act_order else "int4")
        name = f"{variant} {k}x{n} M={m}" + (f" [{config.label()}]" if config else "")
        recorded = config is None

        def call(w: Int4Weight, check: bool):
            return int4_gemm(x, w.qweight, w.scales, w.zeros, w.group_size, w.perm, config=config, check=check)

        w0 = ws[0]
        try:
            got = call(w0, True)
            err = rel_err(got, self.int4_ref(x, w0) if ref is None else ref)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            print(f"  {name}: {_first_line(e)}", flush=True)
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
        gs = k if w0.group_size == -1 else w0.group_size  # as the launcher passes it
        plan = _plan(m, n, k, gs, _device_index(x.device), config, w0.perm is not None, _mma_ok(x))
        row = dict(kind="int4", variant=variant, K=k, N=n, M=m, us=us, weight_GBps=w0.nbytes / (us * 1e3),
                   speedup=bf16_us / us, config=f"{plan.cfg.label()} -> split {plan.splits}", act_order=act_order)
        return self.record(**row) if recorded else row

    # -- fp8 -----------------------------------------------------------------------------------

    def _fp8_cells(self, x, fp8, k: int, n: int, m: int, bf16_us: float) -> None:
        torch = self.torch
        from paged_backend.kernels.fp8_quant import quantize_fp8
        from paged_backend.kernels.fp8_quant_ref import fp8_scale_from_amax
        from paged_backend.quantization.fp8 import scaled_mm_support

        tensorwise, rowwise = scaled_mm_support(torch.cuda.current_device()) if self.cuda else (True, True)
        if not tensorwise:
            print(f"  fp8: torch._scaled_mm is not available on this GPU/torch (row-wise: {rowwise})")
            return
        for name, uniform, scheme, min_rows in FP8_VARIANTS:
            self._fp8_cell(x, fp8[uniform], name, scheme, min_rows, rowwise, k, n, m, bf16_us)
        # the GEMM alone: tensor-wise scales on activations quantized beforehand
        xs1 = fp8_scale_from_amax(x.abs().amax().reshape(1))
        xq, _ = quantize_fp8(x.contiguous(), xs1)
        us = self.timer([lambda w=w: torch._scaled_mm(xq, w[0].t(), scale_a=xs1, scale_b=w[2],
                                                         out_dtype=torch.bfloat16) for w in fp8[True]],
                        self.args.replays)
        self.record(kind="fp8", variant="fp8 gemm only", K=k, N=n, M=m, us=us, weight_GBps=k * n / (us * 1e3),
                    speedup=bf16_us / us)

    def _fp8_cell(self, x, ws, name: str, scheme: str, min_rows: int, rowwise: bool, k: int, n: int, m: int,
                  bf16_us: float) -> None:
        """One fp8 variant: quantize the activations (per token or per tensor), then the scaled GEMM."""
        from paged_backend.kernels.fp8_quant_ref import quantize_fp8_ref
        from paged_backend.quantization.fp8 import fp8_linear

        q, row, one = ws[0]
        label = f"{name} {k}x{n} M={m}"
        try:
            got = fp8_linear(x, q, row, one, scheme, min_rows=min_rows, rowwise=rowwise)
            xq, xs = quantize_fp8_ref(x, per_token=scheme == "dynamic_token")
            want = (xq.float() * xs) @ (q.float() * row.t()).t()
            ok = self.check(label, rel_err(got, want), FP8_TOL)
        except Exception as e:  # noqa: BLE001
            print(f"  {label}: {_first_line(e)}", flush=True)
            self.failures.append(label)
            return
        if not ok:
            return
        us = self.timer([lambda w=w: fp8_linear(x, w[0], w[1], w[2], scheme, min_rows=min_rows, rowwise=rowwise)
                         for w in ws], self.args.replays)
        self.record(kind="fp8", variant=name, K=k, N=n, M=m, us=us, weight_GBps=k * n / (us * 1e3),
                    speedup=bf16_us / us)
