"""``paged-backend bench moe``: the fused-MoE kernel against its pure-torch reference (CUDA).

Per M (tokens): random routing over E experts (top-k), the kernel's output checked against
``fused_moe_ref`` (relative error), then both timed (``triton.testing.do_bench`` median, L2
flushed). The weight bandwidth counts the bytes of the experts the batch touches (the decode
floor), over the kernel's time. Prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import sys

from paged_backend.benchmarks.results import parse_ints, rel_err, report_check, run_header
from paged_backend.benchmarks.timing import do_bench_ms

DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", default="1,4,16,64,512,4096", help="tokens per call")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336, help="one expert's intermediate size")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench's timing budget per measurement")
    p.add_argument("--seed", type=int, default=0)


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
    from paged_backend.kernels.fused_moe import fused_moe, pick_config
    from paged_backend.kernels.fused_moe_ref import fused_moe_ref

    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=dev, generator=gen) * i**-0.5).to(dtype)
    print(run_header(torch.cuda.get_device_name(dev)), flush=True)
    print(f"E {e}, top-{k}, H {h}, I {i}, {args.dtype}", flush=True)
    rows, failures = [], []
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for m in parse_ints(args.m):
        x = torch.randn(m, h, device=dev, generator=gen).to(dtype)
        logits = torch.randn(m, e, device=dev, generator=gen)
        weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).float().contiguous()
        ids = ids.contiguous()
        report_check(f"M {m}", rel_err(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids)),
                     tol, failures)
        inputs = (x, w13, w2, weights, ids)
        ours = do_bench_ms(functools.partial(fused_moe, *inputs, check=False), args.rep_ms)
        ref = do_bench_ms(functools.partial(fused_moe_ref, *inputs), args.rep_ms)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * (w13[0].numel() + w2[0].numel()) * w13.element_size()
        cfg = pick_config(m, e, i, h, dtype, top_k=k)
        rows.append((m, "pairs" if cfg.BLOCK_M == 1 else f"sorted {cfg.BLOCK_M}-row", ours, ref, touched,
                     nbytes / (ours * 1e-3) / 1e12))
    print(f"{'M':>6} | {'path':<15} | {'fused_moe us':>12} | {'reference us':>12} | {'experts':>7} | {'weights TB/s':>12}")
    for m, path, ours, ref, touched, tbs in rows:
        print(f"{m:>6} | {path:<15} | {ours * 1e3:>12.1f} | {ref * 1e3:>12.1f} | {touched:>7} | {tbs:>12.2f}")
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
