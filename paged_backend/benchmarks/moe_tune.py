"""``paged-backend bench moe --tune``: a tuning table of the fused-MoE kernel for one device and shape.

For each token count M, candidate ``MoEConfig``s run the whole op (routing, both grouped GEMMs,
the activation and the top-k sum) on seeded random routings over E experts, top-k; the fastest
(GPU time of CUDA-graph replays over four routings, median of 10) is written to
``<out-dir>/E=..,N=..,device_name=....json`` in vLLM's table format, which ``fused_moe`` reads
for that device and shape (``paged_backend/kernels/fused_moe_configs``). The winner is checked against
``fused_moe_ref`` before it is kept.

The search has two rounds per M:

    tiles    BLOCK_M x BLOCK_N x BLOCK_K x 4 or 8 warps, no swizzle (3 stages; the pairs path 4
             warps, 2 stages). BLOCK_M 1 (the pairs path) while M * top_k <= PAIRS_TUNE_MAX; row
             tiles up to twice the mean pairs per touched expert (taller ones are mostly padding)
    launch   stages and GROUP_M (the pairs path: warps and stages) around the round's best
             ``REFINE`` configs

Tiles whose pipeline would not fit the shared memory are skipped. Every candidate is compiled
first in ``--jobs`` worker processes on the same GPU (each compiles its share; Triton's on-disk
cache then serves the timing process), so the timing process spends its time timing.

``--quant fp8-block`` / ``fp8-channel`` tunes e4m3 experts (block-wise 128 x 128 scales, or one
per output channel) and writes vLLM's fp8 table name (``...,dtype=fp8_w8a8[,block_shape=[128,128]].json``);
block-wise candidates all step 128 inputs (one scale group), channel ones at least 64. ``--quant int4``
tunes int4 experts (groups of 128 inputs, as GPTQ / AWQ releases) under vLLM's ``dtype=int4_w4a16``
name; their candidates step 64 or 128 inputs (inside one group).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace

from paged_backend.benchmarks.results import parse_ints, rel_err, report_check, run_header

PAIRS_TUNE_MAX = 64  # the pairs path is a candidate while M * top_k is at most this
SMEM_BYTES = 200 * 1024  # shared memory a pipelined tile may take (the H100/H200 give 227 KiB a block)
PAIRS_TILE_MAX = 16384  # pairs path: BLOCK_K x BLOCK_N elements a program holds (registers)
ROUTINGS = 4  # routings a timing replays back to back
REFINE = 2  # round-one configs whose launch parameters round two varies


def _smem_ok(cfg, elem_bytes: int) -> bool:
    if not cfg.sorted:
        return cfg.BLOCK_N * cfg.BLOCK_K <= PAIRS_TILE_MAX
    return (cfg.BLOCK_M * cfg.BLOCK_K + cfg.BLOCK_K * cfg.BLOCK_N) * elem_bytes * cfg.num_stages <= SMEM_BYTES


def tile_candidates(m: int, e: int, k: int, elem_bytes: int = 2, block_k: int | None = None) -> list:
    """Round one: the tile shapes (and warp counts) worth timing for M tokens over E experts, top-k
    (``block_k``: block-wise fp8, every step exactly one scale group)."""
    from paged_backend.kernels.fused_moe import MoEConfig

    pairs = m * k
    steps = (block_k,) if block_k else (64, 128, 256)
    out = []
    if pairs <= PAIRS_TUNE_MAX:
        out += [MoEConfig(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=2)
                for bn in (16, 32, 64, 128) for bk in steps]
    per_expert = pairs / min(e, pairs)
    for bm in (16, 32, 64, 128):
        if bm > 16 and bm > 2 * per_expert:
            continue
        out += [MoEConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3)
                for bn in (32, 64, 128, 256) for bk in steps for w in (4, 8)]
    return [c for c in out if _smem_ok(c, elem_bytes)]


def launch_candidates(best: list, elem_bytes: int = 2) -> list:
    """Round two: pipeline depth and program-id swizzle (the pairs path: warps and depth) around
    each of round one's ``best`` configs, deduplicated."""
    out = []
    for cfg in best:
        if not cfg.sorted:
            out += [replace(cfg, num_warps=w, num_stages=s) for w in (1, 2, 4, 8) for s in (1, 2, 3)]
        else:
            out += [replace(cfg, num_stages=s, GROUP_M=g) for s in (2, 3, 4, 5) for g in (1, 8, 16, 32)]
    return [c for c in dict.fromkeys(out) if _smem_ok(c, elem_bytes)]


# -- inputs (the same in the workers and the timing process) --------------------------------------


QUANTS = ("none", "fp8-block", "fp8-channel", "int4")
FP8_BLOCK = (128, 128)
INT4_GROUP = 128


def quant_block(quant: str) -> tuple[int, int] | None:
    return FP8_BLOCK if quant == "fp8-block" else None


def pick_kwargs(quant: str) -> dict:
    """``pick_config``'s keyword arguments for experts of kind ``quant``."""
    return dict(fp8=quant.startswith("fp8"), block_shape=quant_block(quant),
                int4_group=INT4_GROUP if quant == "int4" else None)


def quant_table(x, e: int, i: int, quant: str):
    """The tuned table ``fused_moe`` reads for experts of kind ``quant`` and activations like ``x``."""
    from paged_backend.kernels.fused_moe import table_for

    kw = pick_kwargs(quant)
    return table_for(x, e, i, kw["fp8"], kw["block_shape"], quant == "int4")


def moe_weights(e: int, i: int, h: int, dtype, seed: int, quant: str = "none"):
    """(w13, w2, the MoE op's scale arguments): seeded experts in ``dtype``, or e4m3 with their scales
    (``quant``: fp8-block, 128 x 128 blocks; fp8-channel, one per output row), or int4 (random codes, zero
    point 8, fp16 group scales of ``INT4_GROUP`` inputs, in the kernel layout)."""
    import torch

    from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE, FP8_MAX, expand_block_scales

    gen = torch.Generator(device="cuda").manual_seed(seed)
    if quant == "int4":
        from paged_backend.quantization.int4 import dummy_scales, random_int32

        out = []
        for n, kd in ((2 * i, h), (h, i)):
            words = random_int32((e, n, kd // 8), gen, torch.device("cuda"))
            shape = (e, kd // INT4_GROUP, n)
            out += [words, dummy_scales(shape, gen, torch.device("cuda"), kd**-0.5).half(),
                    torch.full(shape, 8, dtype=torch.uint8, device="cuda")]
        return out[0], out[3], dict(w13_scale=out[1], w2_scale=out[4], w13_zeros=out[2], w2_zeros=out[5],
                                    group_size=INT4_GROUP)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5
    if quant == "none":
        return w13.to(dtype), w2.to(dtype), {}
    out, block = [], quant_block(quant)
    for w in (w13, w2):
        n, k = w.shape[1:]
        if block is None:
            scale = w.abs().amax(-1) / FP8_MAX
            full = scale[..., None]
        else:
            bn, bk = block
            rows, cols = -(-n // bn), -(-k // bk)
            padded = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n))
            scale = padded.reshape(e, rows, bn, cols, bk).abs().amax(dim=(2, 4)) / FP8_MAX
            full = torch.stack([expand_block_scales(s, n, k, bn, bk) for s in scale])
        out += [(w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.float().contiguous()]
    return out[0], out[2], dict(w13_scale=out[1], w2_scale=out[3], block_shape=block)


def routing_sets(m: int, e: int, k: int, h: int, dtype, seed: int, copies: int = ROUTINGS) -> list[tuple]:
    """``copies`` inputs of M tokens: x [M, H] and a seeded softmax top-k routing (float32 weights,
    int64 ids, as the router gives them); each copy touches other experts, so a graph replaying them
    back to back reads the weights from memory, not from L2."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed + m)
    out = []
    for _ in range(copies):
        x = torch.randn(m, h, device="cuda", generator=gen).to(dtype)
        weights, ids = torch.topk(torch.randn(m, e, device="cuda", generator=gen).softmax(-1), k, dim=-1)
        out.append((x, (weights / weights.sum(-1, keepdim=True)).float().contiguous(), ids.contiguous()))
    return out


def time_moe_ms(cfg, w13, w2, sets: list[tuple], replays: int = 10, quant: dict | None = None) -> float:
    """GPU ms per call of ``fused_moe`` with ``cfg`` (None: its own pick) over ``sets``, as CUDA-graph
    replays (no host launch time: the engine replays its steps as graphs too); ``quant``: the fp8
    experts' scale arguments."""
    from paged_backend.benchmarks.timing import time_graph_ms
    from paged_backend.kernels.fused_moe import fused_moe

    return time_graph_ms([lambda s=s: fused_moe(s[0], w13, w2, s[1], s[2], config=cfg, check=False, **(quant or {}))
                          for s in sets], replays)


_WORKER: dict = {}


def _worker_init(e: int, i: int, h: int, k: int, dtype_name: str, seed: int, quant: str = "none") -> None:
    import torch

    dtype = getattr(torch, dtype_name)
    _WORKER.update(shape=(e, i, h, k), dtype=dtype, seed=seed, w=moe_weights(e, i, h, dtype, seed, quant))


def _compile_one(task: tuple[dict, int]) -> str | None:
    """Runs one (config, M) once in a worker (compiling it into the on-disk cache); the error if any."""
    import torch

    from paged_backend.kernels.fused_moe import MoEConfig, fused_moe

    cfg_fields, m = task
    e, _, h, k = _WORKER["shape"]
    x, tw, ids = routing_sets(m, e, k, h, _WORKER["dtype"], _WORKER["seed"], copies=1)[0]
    w13, w2, quant = _WORKER["w"]
    try:
        fused_moe(x, w13, w2, tw, ids, config=MoEConfig(**cfg_fields), check=False, **quant)
        torch.cuda.synchronize()
    except Exception as exc:  # a config this GPU cannot run (resources): reported, then skipped
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return None


class Compiler:
    """``args.jobs`` spawned worker processes (CUDA cannot fork) that compile (config, M) runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        import multiprocessing as mp

        self.pool = None
        if args.jobs > 1:
            init = (args.experts, args.intermediate, args.hidden, args.top_k, args.dtype, args.seed, args.quant)
            self.pool = mp.get_context("spawn").Pool(args.jobs, initializer=_worker_init, initargs=init)
        self.jobs = args.jobs

    def compile(self, tasks: list[tuple]) -> None:
        """Each distinct config run once, at one of its M, on some worker; returns when all are done.
        (The kernel does not specialize on the batch size, so one run compiles a config for every M.)"""
        tasks = list(dict(tasks).items())
        if self.pool is None or not tasks:
            return
        t0 = time.time()
        errors = [err for err in self.pool.map(_compile_one, [(asdict(c), m) for c, m in tasks], chunksize=1)
                  if err]
        print(f"  compiled {len(tasks)} configs in {time.time() - t0:.0f} s on {self.jobs} processes"
              f"{f' ({len(errors)} could not run)' if errors else ''}", flush=True)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


def _time(cfg, w13, w2, sets: list[tuple], quant: dict) -> float:
    """``time_moe_ms``, or inf when the config cannot run here."""
    try:
        return time_moe_ms(cfg, w13, w2, sets, quant=quant)
    except Exception:
        return math.inf


def tune(args: argparse.Namespace) -> int:
    """Writes the table for the current device (see the module docstring); 1 if a winner fails its check."""
    import torch

    from paged_backend.kernels.fused_moe import (
        FP8_SELECTOR,
        INT4_SELECTOR,
        config_file_name,
        fused_moe,
        pick_config,
    )
    from paged_backend.kernels.fused_moe_ref import fused_moe_ref

    dtype = getattr(torch, args.dtype)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    fp8, block, int4 = args.quant.startswith("fp8"), quant_block(args.quant), args.quant == "int4"
    elem = 1 if fp8 else torch.empty((), dtype=dtype).element_size()
    device_name = torch.cuda.get_device_name()
    print(run_header(device_name), flush=True)
    print(f"tuning E {e}, top-{k}, H {h}, I {i}, {args.dtype}, experts {args.quant}", flush=True)
    ms = parse_ints(args.m)
    w13, w2, quant = moe_weights(e, i, h, dtype, args.seed, args.quant)
    inputs = {m: routing_sets(m, e, k, h, dtype, args.seed) for m in ms}

    def timed(cfg, m: int) -> float:
        return _time(cfg, w13, w2, inputs[m], quant)

    defaults = {m: pick_config(m, e, i, h, dtype, top_k=k, **pick_kwargs(args.quant)) for m in ms}
    tiles = {m: [c for c in tile_candidates(m, e, k, elem, block and block[1])
                 if (not fp8 or c.BLOCK_K >= 64) and (not int4 or 64 <= c.BLOCK_K <= INT4_GROUP)] for m in ms}
    compiler = Compiler(args)
    try:
        compiler.compile([(c, m) for m in ms for c in (defaults[m], *tiles[m])])
        t_default = {m: timed(defaults[m], m) for m in ms}
        round1 = {m: {c: timed(c, m) for c in tiles[m]} for m in ms}
        launches = {m: launch_candidates(sorted(round1[m], key=round1[m].get)[:REFINE], elem) for m in ms}
        compiler.compile([(c, m) for m in ms for c in launches[m]])
    finally:
        compiler.close()
    best_cfgs, rows, failures = {}, [], []
    for m in ms:
        times = {**round1[m], **{c: timed(c, m) for c in launches[m] if c not in round1[m]}}
        best = min(times, key=times.get)
        x, tw, ids = inputs[m][0]
        got = fused_moe(x, w13, w2, tw, ids, config=best, check=False, **quant)
        if not report_check(f"M {m} best", rel_err(got, fused_moe_ref(x, w13, w2, tw, ids, **quant)), 2e-2, failures):
            continue
        best_cfgs[m] = best
        rows.append((m, best, times[best], t_default[m]))
        print(f"  M {m}: {times[best] * 1e3:.1f} us with {best} ({len(times)} timed; "
              f"default {t_default[m] * 1e3:.1f} us)", flush=True)
    name = config_file_name(e, i, device_name, FP8_SELECTOR if fp8 else INT4_SELECTOR if int4 else None, block)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, name)
    table = {str(m): {"BLOCK_SIZE_M": c.BLOCK_M, "BLOCK_SIZE_N": c.BLOCK_N, "BLOCK_SIZE_K": c.BLOCK_K,
                      "GROUP_SIZE_M": c.GROUP_M, "num_warps": c.num_warps, "num_stages": c.num_stages}
             for m, c in best_cfgs.items()}
    with open(path, "w") as f:
        json.dump(table, f, indent=4)
        f.write("\n")
    print(f"wrote {path}")
    print(f"{'M':>6} | {'BM':>3} {'BN':>3} {'BK':>3} {'G':>2} {'w':>2} {'s':>2} | {'tuned us':>9} | "
          f"{'default us':>10} | {'speed-up':>8}")
    for m, c, t, t0 in rows:
        print(f"{m:>6} | {c.BLOCK_M:>3} {c.BLOCK_N:>3} {c.BLOCK_K:>3} {c.GROUP_M:>2} {c.num_warps:>2} "
              f"{c.num_stages:>2} | {t * 1e3:>9.1f} | {t0 * 1e3:>10.1f} | {t0 / t:>7.2f}x")
    if failures:
        print(f"FAILED checks: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0
