"""``paged-backend bench kernels``: check the Triton kernels against their references on the GPU,
then time them and print a table (CUDA only).

What is timed, and the ceiling each is held to (the kernels' minimums: docs/BENCHMARKS.md, "Kernels")::

    ceilings     device copy (bytes read + written) and a bf16 GEMM, measured in the same run
    decode       paged attention, one query token per request, 32 q heads over 8 KV heads,
                 head_dim 128, batch x context grid; achieved bandwidth = (K/V + q + out) bytes / time,
                 bf16 and fp8 KV (fp8 speed-up over bf16)
    prefill      causal prefill of one 2k / 8k-token request, FLOP rate against
                 torch's scaled_dot_product_attention on contiguous tensors; ours takes q as the
                 engine's rotary kernel writes it for prefill (softmax scale folded in,
                 ``query_prescale``), and once more unscaled (the launcher's own pass over q)
    elementwise  cache write, RMSNorm (+residual), rotary, SiLU-and-mul at 8k tokens x 4096 hidden,
                 bytes moved / time against the copy bandwidth

``--variants`` times the paged-attention code-path variants side by side instead of the
decode / prefill grids (``attention_sweep.py``, the variants in ``attention_variants.py``).

Decode times are medians of CUDA-graph replays of back-to-back calls on disjoint block
tables (~1 GB touched per replay, so L2 cannot serve reruns; no host launch overhead);
elementwise kernels and prefill (ours and SDPA alike; the verdict) are CUDA-graph replays over
rotating input sets (>= 1 GiB moved per replay); prefill once more, and the torch references, as
medians of ``triton.testing.do_bench`` (L2 flushed before every run; host launch time can leak
into those).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from paged_backend.benchmarks import kernels_attention, kernels_elementwise
from paged_backend.benchmarks.kernel_bench import Bench, add_attention_grid_args
from paged_backend.benchmarks.results import run_header, versions

GROUPS = ["ceilings", "decode", "prefill", "elementwise", "int4"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-backend bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=GROUPS, default=None,
                   help="run only these groups (ceilings always run: the others are judged against them)")
    add_attention_grid_args(p)
    p.add_argument("--tokens", type=int, default=8192, help="elementwise kernels: tokens")
    p.add_argument("--hidden", type=int, default=4096, help="elementwise kernels: hidden size")
    p.add_argument("--sweep", action="store_true", help="also time split counts and tile configs")
    p.add_argument("--variants", action="store_true",
                   help="decode/prefill: time the paged-attention code-path variants side by side instead of "
                        "the grids (paged_backend/benchmarks/attention_variants.py)")
    p.add_argument("--variant-cells", default="8x4096,64x4096,1x32768,8x32768,256x32768,1x4096",
                   help="--variants: decode cells batch x context, in priority order")
    p.add_argument("--variant-names", default=None,
                   help="--variants: comma-separated names (or name prefixes) of the variants to time; "
                        "'default' always runs")
    p.add_argument("--budget-s", type=float, default=230.0,
                   help="--variants: seconds the variant jobs may take; later jobs/variants are skipped")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    p.add_argument("--json", default=None, help="write every row here as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``paged-backend bench kernels``; returns 1 when a check fails."""
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA device", file=sys.stderr)
        return 2
    bench = Bench(args)
    groups = args.only or GROUPS
    print(run_header(torch.cuda.get_device_name()), flush=True)
    kernels_elementwise.ceilings(bench)
    if args.variants:  # the variant sweep replaces the decode / prefill grids
        from paged_backend.benchmarks.attention_sweep import VariantSweep

        VariantSweep(bench, args.budget_s).run([g for g in groups if g in ("decode", "prefill")])
        groups = [g for g in groups if g not in ("decode", "prefill")]
    run = {"decode": kernels_attention.decode, "prefill": kernels_attention.prefill,
           "elementwise": kernels_elementwise.elementwise}
    for g, fn in run.items():
        if g in groups:
            t0 = time.time()
            fn(bench)
            print(f"  [{g} took {time.time() - t0:.0f} s]", flush=True)
    bench.summary()
    int4_rc = 0
    if "int4" in groups:  # the int4 table: the int4 GEMM vs bf16 cuBLAS, from `bench quant`'s code
        from paged_backend.benchmarks import quant as bench_quant

        quant_args = ["--only", "int4"] + (["--json", args.json + ".int4.json"] if args.json else [])
        int4_rc = bench_quant.run(bench_quant.build_parser().parse_args(quant_args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), **versions(), "failures": bench.failures,
                       "rows": [asdict(r) for r in bench.rows]}, f, indent=1)
    return 1 if bench.failures or int4_rc else 0


if __name__ == "__main__":
    raise SystemExit(main())
