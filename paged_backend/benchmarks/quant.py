"""``paged-backend bench quant``: quantized-weight GEMMs against bf16 cuBLAS on the GPU (CUDA only).

For each K x N (Llama-3.1-8B's 4096 x 4096, 4096 x 14336, 14336 x 4096) and each M (1, 16, 64,
256), in one process:

    bf16        torch.matmul(x, W.T): cuBLAS on the dense bf16 weight (the baseline)
    int4        the Triton W4A16 kernel (paged_backend/kernels/int4_gemm.py), group 128, fp16 scales (as the
                checkpoints store them), act-order off / on, ``default_config``
    fp8 token   torch._scaled_mm, e4m3 weight with per-channel scales, activations quantized per
                token by paged_backend/kernels/fp8_quant.py (what FP8_DYNAMIC checkpoints run), M padded to 17
    fp8 tensor  same with one weight scale and a dynamic per-tensor activation scale (tensor-wise)
    ... nopad   the two fp8 rows without padding M to 17 rows
    fp8 gemm    torch._scaled_mm alone on already-quantized activations (the quantization's cost
                is the difference)

Every variant is first checked against dequantize + matmul (relative error of the output);
a failed check is reported and the variant is not timed. Times are medians of CUDA-graph
replays of back-to-back calls on rotating weight copies (>= 256 MB touched per replay, so the
50 MB L2 cannot serve a rerun, and no host launch overhead): per-call GPU time.

``--sweep`` then times, per (shape, M), the int4 kernel's candidate configs
(``quant_sweep.sweep_candidates``: the FMA GEMV and the tl.dot paths, tiles, warps, stages,
split-K reductions), then split-K counts on the two best; each config is checked first (a wrong
or failing one is dropped, never timed). It prints the best per cell and a suggested
``default_config`` per M (the config with the smallest worst-case slowdown over the shapes);
``--sweep-budget`` caps its seconds (later candidates are skipped, defaults always run). The
summary table is printed last; ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from paged_backend.benchmarks.quant_bench import QuantBench
from paged_backend.benchmarks.quant_report import print_summary
from paged_backend.benchmarks.quant_sweep import suggested_defaults
from paged_backend.benchmarks.results import run_header, versions


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


def run(args: argparse.Namespace) -> int:
    """Entry point of ``paged-backend bench quant``; returns 1 when a check fails."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench quant needs a CUDA device (--device cpu: a smoke run under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    bench = QuantBench(args)
    name = torch.cuda.get_device_name() if bench.cuda else "cpu (smoke run)"
    print(run_header(name, after_date=(f"group {args.group_size}",)), flush=True)
    t0 = time.time()
    for k, n in _shapes(args.shapes):
        bench.run_shape(k, n)
    print(f"  [took {time.time() - t0:.0f} s]", flush=True)
    print_summary(bench.rows, bench.sweep_rows, bench.failures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, **versions(), "failures": bench.failures, "rows": bench.rows,
                       "sweep": bench.sweep_rows,
                       "suggested": suggested_defaults(bench.sweep_rows) if bench.sweep_rows else None}, f, indent=1)
    return 1 if bench.failures else 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser("python -m paged_backend.benchmarks.quant").parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
