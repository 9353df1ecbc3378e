"""``paged-backend bench kv-swap``: the host KV tier's copies, device -> host (swap out, write-back) and
host -> device (swap in, prefix load), of N blocks at random device block ids.

A device cache of ``--num-blocks`` blocks of a model's shapes (``--model-shapes``, else the small
``--num-layers`` / ``--num-kv-heads`` / ``--head-dim`` / ``--latent-dim`` shapes) and a host tier of
``--num-host-blocks``; per count of ``--blocks``, host ids scattered (a random sample) or consecutive:

    batched   ``HostKVTier.swap`` (worker/host_kv_tier.py): per staging chunk one gather / scatter per
              layer and one copy per run of consecutive host ids, on the tier's stream
    per-run   ``KVCacheSpec.copy_block_runs`` into per-layer host caches of the spec's layout: one copy
              per run of consecutive (device, host) pairs, per layer and per K/V part (the tier's copies
              before the batched path; ``--no-reference`` skips it)

Each is timed from the call to the end of its copies (wall clock, the host's launch time included;
median of ``--reps`` after one warm-up) and checked against the blocks it should have moved. Prints a
table (ms, GiB/s of the blocks' bytes, copies issued per call); ``--json PATH`` writes the rows.
Runs on the CPU too (``--device cpu``: plain host tensors stand for the device cache).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from paged_backend.benchmarks.model_shapes import MODEL_SHAPES, add_model_shapes_args
from paged_backend.benchmarks.results import parse_ints

GIB = 1 << 30
DTYPES = ("bfloat16", "float16", "float32")


def add_kv_swap_parser(sub) -> None:
    """Registers ``bench kv-swap`` on the ``paged-backend bench`` subparsers."""
    p = sub.add_parser("kv-swap", help="the host KV tier's device <-> host block copies: batched against per-run")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_shapes_args(p, tokenizer=False)
    p.add_argument("--num-layers", type=int, default=4, help="without --model-shapes: layers")
    p.add_argument("--num-kv-heads", type=int, default=2, help="without --model-shapes: KV heads")
    p.add_argument("--head-dim", type=int, default=32, help="without --model-shapes: head dim")
    p.add_argument("--latent-dim", type=int, default=0, help="without --model-shapes: an MLA latent of this width "
                   "instead of per-head K/V")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the cache's dtype (--kv-cache-dtype auto)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--num-blocks", type=int, default=2048, help="device cache blocks")
    p.add_argument("--num-host-blocks", type=int, default=None,
                   help="host tier blocks (default: twice the largest --blocks, plus the null block)")
    p.add_argument("--blocks", default="256", help="blocks per copy, comma-separated (default: 256)")
    p.add_argument("--staging-mib", type=int, default=256, help="the tier's staging buffer (MiB)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per row (the median is reported)")
    p.add_argument("--no-reference", action="store_true", help="skip the per-run reference path")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows here as JSON")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="paged-backend bench kv-swap", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def kv_specs(args: argparse.Namespace) -> list:
    """One spec per layer: the ``--model-shapes`` model's cache (all its KV heads), else the small shapes."""
    import torch

    from paged_backend.attention.kv_cache_spec import KVCacheSpec
    from paged_backend.kernels.fp8_types import FP8_DTYPE
    from paged_backend.models.model_info import ModelInfo

    dtype = FP8_DTYPE if args.kv_cache_dtype == "fp8" else getattr(torch, args.dtype)
    if args.model_shapes:
        info = ModelInfo.from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                      **MODEL_SHAPES[args.model_shapes]}, source=args.model_shapes)
        if info.mla is not None:
            spec = KVCacheSpec(args.block_size, dtype, latent_dim=info.mla.latent_dim)
        else:
            spec = KVCacheSpec(args.block_size, dtype, info.num_kv_heads, info.head_dim)
        return [spec] * info.num_layers
    if args.latent_dim:
        return [KVCacheSpec(args.block_size, dtype, latent_dim=args.latent_dim)] * args.num_layers
    return [KVCacheSpec(args.block_size, dtype, args.num_kv_heads, args.head_dim)] * args.num_layers


def _timed_ms(fn: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    """Median wall time (ms) from calling ``fn`` to ``sync`` returning, after one untimed call."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _moved(spec, src, dst, pairs) -> bool:
    """Every (s, d): block d of ``dst`` holds block s of ``src`` (bytes; ``dst`` may be strided)."""
    import torch

    dim = spec.block_dim
    s = torch.tensor([a for a, _ in pairs], device=src.device)
    d = torch.tensor([b for _, b in pairs], device=dst.device)
    got = dst.index_select(dim, d).cpu().contiguous().view(torch.uint8)
    return torch.equal(got, src.index_select(dim, s).cpu().contiguous().view(torch.uint8))


def run(args: argparse.Namespace) -> int:
    import torch

    from paged_backend.worker.host_kv_tier import HostKVTier

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench kv-swap --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    specs = kv_specs(args)
    counts = parse_ints(args.blocks)
    if max(counts) >= args.num_blocks:
        print(f"--blocks up to {max(counts)} needs --num-blocks above it", file=sys.stderr)
        return 2
    num_host = args.num_host_blocks or 2 * max(counts) + 1
    if max(counts) >= num_host:
        print(f"--blocks up to {max(counts)} needs --num-host-blocks above it", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    dev = []
    for spec in specs:  # random bytes (every bit pattern: the check compares bytes)
        cache = spec.allocate(args.num_blocks, device)
        cache.view(torch.uint8).random_(0, 256)
        dev.append(cache)
    tier = HostKVTier(specs, num_host, device, pin_memory=cuda, staging_bytes=args.staging_mib << 20)
    reference = None if args.no_reference else [s.allocate(num_host, "cpu", pin_memory=cuda) for s in specs]
    side = torch.cuda.Stream(device) if cuda else None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def per_run(src: list, dst: list, pairs: list[tuple[int, int]]) -> Callable[[], None]:
        def fn() -> None:
            with torch.cuda.stream(side) if side is not None else nullcontext():
                for spec, a, b in zip(specs, src, dst, strict=True):
                    spec.copy_block_runs(a, b, pairs)
        return fn

    name = args.model_shapes or f"{len(specs)} layers x {specs[0].bytes_per_block} B"
    head = (f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'} | torch {torch.__version__} | "
            f"{name} | {specs[0].dtype} | block {tier.block_bytes / (1 << 20):.2f} MiB over {len(specs)} layers | "
            f"staging {tier.staging.shape[0]} blocks | {args.num_blocks} device / {num_host} host blocks")
    print(head, flush=True)
    rows: list[dict[str, Any]] = []
    for n in counts:
        src_ids = rng.sample(range(1, args.num_blocks), n)
        dst_ids = rng.sample(range(1, args.num_blocks), n)
        for host_order in ("scattered", "consecutive"):
            host_ids = rng.sample(range(1, num_host), n) if host_order == "scattered" else list(range(1, n + 1))
            out = list(zip(src_ids, host_ids, strict=True))
            into = list(zip(host_ids, dst_ids, strict=True))
            cases = [("batched", "out", lambda o=out: tier.swap(dev, o, []), tier.caches, dev, out),
                     ("batched", "in", lambda i=into: tier.swap(dev, [], i), dev, tier.caches, into)]
            if reference is not None:
                cases += [("per-run", "out", per_run(dev, reference, out), reference, dev, out),
                          ("per-run", "in", per_run(reference, dev, into), dev, reference, into)]
            for path, direction, fn, dst, src, pairs in cases:
                ms = _timed_ms(fn, sync, args.reps)
                ok = all(_moved(s, a, b, pairs) for s, a, b in zip(specs, src, dst, strict=True))
                nbytes = n * tier.block_bytes
                rows.append({"path": path, "direction": direction, "blocks": n, "host_ids": host_order,
                             "ms": round(ms, 3), "gib_s": round(nbytes / GIB / (ms / 1e3), 2),
                             "copies": _copies(path, specs, tier, pairs, direction), "mib": nbytes / (1 << 20),
                             "ok": ok})
    _print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "model_shapes": args.model_shapes, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


def _copies(path: str, specs: list, tier, pairs: list[tuple[int, int]], direction: str) -> int:
    """Host <-> device copies one call issues: per chunk one per run of host ids (batched), or one per run
    of pairs, per layer and per part (per-run)."""
    from paged_backend.attention.kv_cache_spec import block_runs
    from paged_backend.worker.host_kv_tier import host_runs

    if path == "per-run":
        return sum(len(block_runs(pairs)) * (1 if s.is_latent else 2) for s in specs)
    host_at = 1 if direction == "out" else 0
    return sum(len(host_runs([p[host_at] for p in chunk])) for chunk in tier.chunks(pairs, host_at))


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'path':<8} {'dir':<4} {'blocks':>6} {'host ids':<12} {'MiB':>8} {'ms':>9} {'GiB/s':>8} "
          f"{'copies':>7} check")
    for r in rows:
        print(f"{r['path']:<8} {r['direction']:<4} {r['blocks']:>6} {r['host_ids']:<12} {r['mib']:>8.1f} "
              f"{r['ms']:>9.3f} {r['gib_s']:>8.2f} {r['copies']:>7} {'ok' if r['ok'] else 'FAIL'}", flush=True)
