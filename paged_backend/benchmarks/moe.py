"""``paged-backend bench moe``: the fused-MoE kernel against its pure-torch reference (CUDA).

Per M (tokens): random routing over E experts (top-k), the kernel's output checked against
``fused_moe_ref`` (relative error), then both timed: the kernel, with the config ``fused_moe``
picks (this device's tuned table where ``paged_backend/kernels/fused_moe_configs`` has one), as CUDA-graph
replays over four routings (GPU time, as the engine replays its steps); the reference, which
syncs with the host, by ``triton.testing.do_bench`` (median, L2 flushed). The weight bandwidth counts the bytes of the experts the
batch touches (the decode floor), over the kernel's time. Prints a table last.

``--tune`` writes that table instead (``moe_tune.py``). ``--quant fp8-block`` (128 x 128 block scales,
activations per token and 128 inputs) or ``fp8-channel`` (per-channel scales, per-token activations)
runs e4m3 experts, ``int4`` W4A16 experts (groups of 128), with ``--dtype`` the activations' type; the
bandwidth then counts the e4m3 bytes or the packed int4 words (scales and zeros left out).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from paged_backend.benchmarks.moe_tune import QUANTS
from paged_backend.benchmarks.results import parse_ints, rel_err, report_check, run_header
from paged_backend.benchmarks.timing import do_bench_ms

DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_M = "1,4,16,64,512,4096"
TUNE_MS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", default=DEFAULT_M, help=f"tokens per call (--tune: default {TUNE_MS})")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336, help="one expert's intermediate size")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--quant", choices=QUANTS, default="none", help="e4m3 experts: block-wise 128 x 128 or "
                   "per-channel weight scales (dynamic fp8 activations); int4: W4A16 experts, groups of 128")
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench's timing budget for the reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tune", action="store_true", help="search the configs per M and write the tuning table")
    p.add_argument("--out-dir", default=None, help="--tune: where the table goes (default: the package's "
                   "paged_backend/kernels/fused_moe_configs)")
    p.add_argument("--jobs", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 2)),
                   help="--tune: processes compiling the candidates")


def add_moe_parser(sub) -> None:
    """Registers ``bench moe`` on the ``paged-backend bench`` subparsers."""
    p = sub.add_parser("moe", help="the fused-MoE kernel against its torch reference (CUDA)")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench moe needs a CUDA device", file=sys.stderr)
        return 2
    from paged_backend.kernels.fused_moe import CONFIG_DIR, fused_moe, pick_config
    from paged_backend.kernels.fused_moe_ref import fused_moe_ref

    if args.tune:
        from paged_backend.benchmarks.moe_tune import tune

        if args.m == DEFAULT_M:
            args.m = TUNE_MS
        args.out_dir = args.out_dir or CONFIG_DIR
        return tune(args)

    from paged_backend.benchmarks.moe_tune import (
        moe_weights,
        pick_kwargs,
        quant_table,
        routing_sets,
        time_moe_ms,
    )

    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    w13, w2, quant = moe_weights(e, i, h, dtype, args.seed, args.quant)
    fp8 = args.quant.startswith("fp8")
    table = quant_table(torch.empty(0, dtype=dtype, device=dev), e, i, args.quant)
    print(run_header(torch.cuda.get_device_name(dev)), flush=True)
    print(f"E {e}, top-{k}, H {h}, I {i}, {args.dtype}, experts {args.quant}, "
          f"{'tuned table' if table else 'no tuned table for this device: default configs'}", flush=True)
    rows, failures = [], []
    tol = (2e-3 if fp8 else 1e-4) if dtype == torch.float32 else 2e-2  # fp8: an intermediate rounding flip
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    for m in parse_ints(args.m):
        sets = routing_sets(m, e, k, h, dtype, args.seed)
        x, weights, ids = sets[0]
        report_check(f"M {m}", rel_err(fused_moe(x, w13, w2, weights, ids, **quant),
                                       fused_moe_ref(x, w13, w2, weights, ids, **quant)), tol, failures)
        ours = time_moe_ms(None, w13, w2, sets, quant=quant)
        ref = do_bench_ms(functools.partial(fused_moe_ref, x, w13, w2, weights, ids, **quant), args.rep_ms)
        touched = sum(int(torch.unique(s[2]).numel()) for s in sets) / len(sets)
        cfg = pick_config(m, e, i, h, dtype, top_k=k, table=table, **pick_kwargs(args.quant))
        rows.append((m, "pairs" if cfg.BLOCK_M == 1 else f"sorted {cfg.BLOCK_M}-row", ours, ref, touched,
                     touched * expert_bytes / (ours * 1e-3) / 1e12))
    print(f"{'M':>6} | {'path':<15} | {'fused_moe us':>12} | {'reference us':>12} | {'experts':>7} | {'weights TB/s':>12}")
    for m, path, ours, ref, touched, tbs in rows:
        print(f"{m:>6} | {path:<15} | {ours * 1e3:>12.1f} | {ref * 1e3:>12.1f} | {touched:>7.0f} | {tbs:>12.2f}")
    if failures:
        print(f"FAILED checks: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="paged-backend bench moe", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
