"""``paged-backend bench kernels --variants``: paged-attention code paths side by side (CUDA only).

Three of the minimums the kernels are held to (docs/BENCHMARKS.md, "Kernels") were unmet when
this sweep was written: bf16 decode at batch 8 x 4k, the fp8 decode speed-up over bf16, and
prefill against SDPA. The kernel has candidate code paths behind ``AttentionConfig`` fields
(kernels/paged_attention.py) whose defaults are the measured baseline. This module runs them
in one process, in jobs of falling priority (a decode cell with both KV dtypes, or a prefill
length)::

    per job   compile every variant in parallel (Triton's AsyncCompileMode, when present)
              check every variant against the reference (decode: the first <= 8 requests of
              the timed batch; prefill: SDPA), before and again after timing
              time them interleaved: decode = CUDA-graph replays of back-to-back calls on
              disjoint block tables (~1 GB per replay, round robin over variants);
              prefill = triton.testing.do_bench (L2 flushed), best of two rounds
    print     one table per job, then a summary against the minimums

A variant that fails to compile or launch (e.g. out of shared memory) is reported and
skipped. ``--budget-s`` bounds the whole sweep: jobs and variants past it are skipped, so
the tables come back inside one time-limited run. Pick winners from the tables and set them in
``pick_config`` / ``pick_num_splits``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from paged_backend.benchmarks.kernels import capture_graph
from paged_backend.kernels._launch import async_compiles

GIB = 1 << 30
REF_SEQS = 8  # decode checks run the reference on this many requests of the timed batch


@dataclass(frozen=True)
class Variant:
    """Overrides of the launcher's choice: AttentionConfig fields and a split rule."""

    name: str
    cfg: dict[str, Any] = field(default_factory=dict)
    splits: str = "auto"  # auto (the launcher's pick for this config), x2, /2, or a count ("32")
    kinds: tuple[str, ...] = ("bf16", "fp8")


_FO = {"fused_merge": True, "offsets32": True}
_VE = {**_FO, "v_early": True}
_P4 = {"fp8_pairs": True, "offsets32": True, "maxnreg": 128, "programs_per_sm": 4}
DECODE_VARIANTS = [
    Variant("default"),
    Variant("fused", {"fused_merge": True}),
    Variant("fused+o32", _FO),
    Variant("fo32 stages5", {**_FO, "num_stages": 5}, kinds=("bf16",)),
    Variant("fo32 t64 stages5", {**_FO, "tile_n": 64, "num_stages": 5}, kinds=("bf16",)),
    Variant("fo32 t64", {**_FO, "tile_n": 64}, kinds=("bf16",)),
    Variant("fo32 w8", {**_FO, "num_warps": 8}, kinds=("bf16",)),
    Variant("fo32 maxnreg128", {**_FO, "maxnreg": 128}, kinds=("bf16",)),
    Variant("fo32 splits x2", _FO, "x2", kinds=("bf16",)),
    Variant("fo32 maxnreg168", {**_FO, "maxnreg": 168}, kinds=("bf16",)),  # 3 programs per SM at head_dim 128
    Variant("fo32 maxnreg168 splits x2", {**_FO, "maxnreg": 168}, "x2", kinds=("bf16",)),
    Variant("fo32 maxnreg128 splits x2", {**_FO, "maxnreg": 128}, "x2", kinds=("bf16",)),
    Variant("fo32 splits /2", _FO, "/2", kinds=("bf16",)),
    Variant("fo32 v_early", _VE, kinds=("fp8",)),
    Variant("ve w8", {**_VE, "num_warps": 8}, kinds=("fp8",)),
    Variant("ve t64", {**_VE, "tile_n": 64}, kinds=("fp8",)),
    Variant("ve t64 w8", {**_VE, "tile_n": 64, "num_warps": 8}, kinds=("fp8",)),
    Variant("ve stages5", {**_VE, "num_stages": 5}, kinds=("fp8",)),
    Variant("ve t64 stages5", {**_VE, "tile_n": 64, "num_stages": 5}, kinds=("fp8",)),
    Variant("ve t256 w8", {**_VE, "tile_n": 256, "num_warps": 8}, kinds=("fp8",)),
    Variant("ve maxnreg128", {**_VE, "maxnreg": 128}, kinds=("fp8",)),
    Variant("ve splits x2", _VE, "x2", kinds=("fp8",)),
    Variant("ve splits /2", _VE, "/2", kinds=("fp8",)),
    Variant("pairs", {"fp8_pairs": True}, kinds=("fp8",)),
    Variant("pairs fo32", {**_FO, "fp8_pairs": True}, kinds=("fp8",)),
    Variant("pairs fo32 t64", {**_FO, "fp8_pairs": True, "tile_n": 64}, kinds=("fp8",)),
    Variant("pairs fo32 stages4", {**_FO, "fp8_pairs": True, "num_stages": 4}, kinds=("fp8",)),
    Variant("pairs fo32 w8", {**_FO, "fp8_pairs": True, "num_warps": 8}, kinds=("fp8",)),
    Variant("pairs fo32 t256 w8", {**_FO, "fp8_pairs": True, "tile_n": 256, "num_warps": 8}, kinds=("fp8",)),
    Variant("pairs splits x2", {"fp8_pairs": True}, "x2", kinds=("fp8",)),
    Variant("pairs splits /2", {"fp8_pairs": True}, "/2", kinds=("fp8",)),
    Variant("pairs maxnreg128", {"fp8_pairs": True, "maxnreg": 128}, kinds=("fp8",)),
    Variant("pairs t64", {"fp8_pairs": True, "tile_n": 64}, kinds=("fp8",)),
    Variant("pairs t64 splits x2", {"fp8_pairs": True, "tile_n": 64}, "x2", kinds=("fp8",)),
    Variant("pairs stages4", {"fp8_pairs": True, "num_stages": 4}, kinds=("fp8",)),
    # 2026-11-30: context splits matched to the occupancy (programs_per_sm), fixed split counts
    Variant("o32", {"offsets32": True}, kinds=("bf16",)),
    Variant("o32 maxnreg168 sm3", {"offsets32": True, "maxnreg": 168, "programs_per_sm": 3}, kinds=("bf16",)),
    Variant("fo32 maxnreg168 sm3", {**_FO, "maxnreg": 168, "programs_per_sm": 3}, kinds=("bf16",)),
    Variant("o32 n32", {"offsets32": True}, "32", kinds=("bf16",)),
    Variant("pairs sm3", {"fp8_pairs": True, "programs_per_sm": 3}, kinds=("fp8",)),
    Variant("pairs o32 sm3", {"fp8_pairs": True, "offsets32": True, "programs_per_sm": 3}, kinds=("fp8",)),
    Variant("pairs fo32 sm3", {**_FO, "fp8_pairs": True, "programs_per_sm": 3}, kinds=("fp8",)),
    Variant("pairs maxnreg128 sm4", {"fp8_pairs": True, "maxnreg": 128, "programs_per_sm": 4}, kinds=("fp8",)),
    Variant("pairs o32 maxnreg128 sm4", {"fp8_pairs": True, "offsets32": True, "maxnreg": 128,
                                         "programs_per_sm": 4}, kinds=("fp8",)),
    Variant("pairs fo32 maxnreg128 sm4", {**_FO, "fp8_pairs": True, "maxnreg": 128, "programs_per_sm": 4},
            kinds=("fp8",)),
    Variant("pairs stages4 sm3", {"fp8_pairs": True, "num_stages": 4, "programs_per_sm": 3}, kinds=("fp8",)),
    Variant("pairs t64 maxnreg128 sm4", {"fp8_pairs": True, "tile_n": 64, "maxnreg": 128, "programs_per_sm": 4},
            kinds=("fp8",)),
    Variant("pairs o32 n32", {"fp8_pairs": True, "offsets32": True}, "32", kinds=("fp8",)),
    Variant("pairs o32 n64", {"fp8_pairs": True, "offsets32": True}, "64", kinds=("fp8",)),
    Variant("pairs o32 maxnreg128 n64", {"fp8_pairs": True, "offsets32": True, "maxnreg": 128}, "64",
            kinds=("fp8",)),
    # 2026-11-30: split merge loading all splits at once (rb), launched programmatically dependent (pdl)
    # ("new": the decode defaults since 2026-11-30, timed against these as 'default')
    Variant("new fused", {**_FO, "reduce_block": 64, "pdl": True}, kinds=("bf16",)),
    Variant("new sm3", {"offsets32": True, "reduce_block": 64, "pdl": True, "programs_per_sm": 3}, kinds=("bf16",)),
    Variant("new t64 stages4", {"offsets32": True, "reduce_block": 64, "pdl": True, "tile_n": 64, "num_stages": 4},
            kinds=("bf16",)),
    Variant("new fp8 t64 stages4", {**_P4, "reduce_block": 64, "pdl": True, "tile_n": 64, "num_stages": 4},
            kinds=("fp8",)),
    Variant("rb o32", {"offsets32": True, "reduce_block": 64}, kinds=("bf16",)),
    Variant("pdl o32", {"offsets32": True, "pdl": True}, kinds=("bf16",)),
    Variant("rb pdl o32", {"offsets32": True, "reduce_block": 64, "pdl": True}, kinds=("bf16",)),
    Variant("rb pdl o32 n64", {"offsets32": True, "reduce_block": 64, "pdl": True}, "64", kinds=("bf16",)),
    Variant("rb pdl o32 n8", {"offsets32": True, "reduce_block": 64, "pdl": True}, "8", kinds=("bf16",)),
    Variant("rb pairs o32 cap sm4", {**_P4, "reduce_block": 64}, kinds=("fp8",)),
    Variant("rb pdl pairs o32 cap sm4", {**_P4, "reduce_block": 64, "pdl": True}, kinds=("fp8",)),
    Variant("rb pdl pairs o32 sm3", {"fp8_pairs": True, "offsets32": True, "programs_per_sm": 3,
                                     "reduce_block": 64, "pdl": True}, kinds=("fp8",)),
    Variant("rb pdl pairs o32 cap n64", {**_P4, "reduce_block": 64, "pdl": True}, "64", kinds=("fp8",)),
    Variant("rb pdl pairs o32 cap n16", {**_P4, "reduce_block": 64, "pdl": True}, "16", kinds=("fp8",)),
]

_F2 = {"q_fold": 2, "offsets32": True}
PREFILL_VARIANTS = [
    Variant("default"),
    Variant("o32", {"offsets32": True}),
    Variant("fold2 o32", _F2),
    Variant("fold2 o32 lazy", {**_F2, "lazy_rescale": True}),
    Variant("fold2 o32 stages5", {**_F2, "num_stages": 5}),
    Variant("fold2 o32 stages5 lazy", {**_F2, "num_stages": 5, "lazy_rescale": True}),
    Variant("fold1 o32 stages5", {"q_fold": 1, "offsets32": True, "num_stages": 5}),
    Variant("fold2 o32 t64 stages5", {**_F2, "tile_n": 64, "num_stages": 5}),
    Variant("fold2 o32 t32 stages5 maxnreg128", {**_F2, "tile_n": 32, "num_stages": 5, "maxnreg": 128}),  # 2 CTAs/SM
    Variant("fold2 o32 m64 t64 w4 stages5", {**_F2, "block_m": 64, "tile_n": 64, "num_warps": 4, "num_stages": 5}),
    # 2026-11-30: 256-row q tiles (each K/V tile feeds twice the rows), one warpgroup per 128 rows
    Variant("m256 t64 stages3", {**_F2, "block_m": 256, "tile_n": 64, "num_stages": 3}),
    Variant("m256 t64 stages4", {**_F2, "block_m": 256, "tile_n": 64, "num_stages": 4}),
    Variant("m256 t64 stages5", {**_F2, "block_m": 256, "tile_n": 64, "num_stages": 5}),
    Variant("m256 t64 w16 stages4", {**_F2, "block_m": 256, "tile_n": 64, "num_warps": 16, "num_stages": 4}),
    Variant("m256 t128 w16 stages3", {**_F2, "block_m": 256, "tile_n": 128, "num_warps": 16, "num_stages": 3}),
    Variant("fold0 t32 stages5 maxnreg128", {"offsets32": True, "tile_n": 32, "num_stages": 5, "maxnreg": 128}),
    Variant("fold1 t32 stages5 maxnreg128", {"q_fold": 1, "offsets32": True, "tile_n": 32, "num_stages": 5,
                                             "maxnreg": 128}),
    Variant("fold0 stages5", {"offsets32": True, "num_stages": 5}),
    Variant("fold1 stages5", {"q_fold": 1, "offsets32": True, "num_stages": 5}),
    Variant("fold0 m256 t64 stages3", {"offsets32": True, "block_m": 256, "tile_n": 64, "num_stages": 3}),
    Variant("fold0 m256 t64 stages4", {"offsets32": True, "block_m": 256, "tile_n": 64, "num_stages": 4}),
    Variant("fold1 m256 t64 stages3", {"q_fold": 1, "offsets32": True, "block_m": 256, "tile_n": 64,
                                       "num_stages": 3}),
    Variant("m256 t32 stages4", {**_F2, "block_m": 256, "tile_n": 32, "num_stages": 4}),
    Variant("m256 t128 stages3", {**_F2, "block_m": 256, "tile_n": 128, "num_stages": 3}),
    Variant("m128 t64 w4 stages4", {**_F2, "tile_n": 64, "num_warps": 4, "num_stages": 4}),
    Variant("m128 t128 w4 stages4", {**_F2, "tile_n": 128, "num_warps": 4, "num_stages": 4}),
    Variant("m128 t64 stages5 maxnreg128", {**_F2, "tile_n": 64, "num_stages": 5, "maxnreg": 128}),
]


def parse_cells(spec: str) -> list[tuple[int, int]]:
    """'8x4096,1x32768' -> [(8, 4096), (1, 32768)]."""
    cells = []
    for item in spec.split(","):
        if item.strip():
            b, c = item.lower().split("x")
            cells.append((int(b), int(c)))
    return cells


def selected(variants: list[Variant], names: str | None) -> list[Variant]:
    """The variants named in ``names`` (comma-separated names or name prefixes), 'default' first;
    all of them when ``names`` is empty."""
    if not names:
        return list(variants)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    return [v for v in variants if v.name == "default" or any(v.name.startswith(w) for w in wanted)]


class VariantSweep:
    """Runs the decode and prefill variant jobs on a ``bench_kernels.Bench``."""

    def __init__(self, bench, budget_s: float) -> None:
        import torch

        self.bench = bench
        self.args = bench.args
        self.torch = torch
        self.dev = bench.dev
        self.deadline = time.time() + budget_s
        self.summary_lines: list[str] = []
        self.report: list[str] = []  # every table line, also written next to --json as <stem>.variants.txt
        self.one = torch.ones((), device=self.dev)

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, line: str) -> None:
        """Print a report line and keep it for the report file."""
        print(line, flush=True)
        self.report.append(line)

    # -- decode ---------------------------------------------------------------------------

    def _resolve(self, v: Variant, b: int, c: int, kv_elem: int):
        """(config or None, num_splits or None) of a decode variant at one cell; None if it adds nothing."""
        from paged_backend.kernels.paged_attention import device_sms, pick_config, pick_num_splits

        a = self.args
        if v.name == "default":
            return None, None
        cfg = replace(pick_config(1, a.heads // a.kv_heads, a.head_dim, kv_elem, baseline=True), **v.cfg)
        auto = pick_num_splits(b * a.kv_heads, c, cfg.tile_n, device_sms(self.dev), cfg.programs_per_sm)
        if v.splits.isdigit():  # a fixed count, if every split keeps a KV tile
            return (cfg, int(v.splits)) if int(v.splits) * cfg.tile_n <= c else None
        if v.splits == "x2":
            more = min(2 * auto, max(1, c // (2 * cfg.tile_n)))  # keep >= 2 KV tiles per split
            return (cfg, more) if more > auto else None
        if v.splits == "/2":
            return (cfg, auto // 2) if auto > 1 else None
        return cfg, None

    def decode_job(self, b: int, c: int, results: dict) -> None:
        """One decode cell: bf16 variants, then fp8 variants (their speed-up is against bf16's default)."""
        for kind in ("bf16", "fp8"):
            if self.left() <= 0:
                self.say(f"  [budget] skipped decode {kind} {b}x{c}")
                continue
            self._decode_kind(kind, b, c, results)
            self.torch.cuda.empty_cache()

    def _decode_kind(self, kind: str, b: int, c: int, results: dict) -> None:
        torch = self.torch
        from paged_backend.kernels.paged_attention import (
            device_sms,
            paged_attention,
            pick_config,
            pick_num_splits,
        )
        from paged_backend.kernels.paged_attention_ref import paged_attention_ref

        a = self.args
        bs, hkv, d = a.block_size, a.kv_heads, a.head_dim
        nblk = math.ceil(c / bs)
        scale = d**-0.5
        bf16_default = results.get(("bf16", b, c))
        fp8 = kind == "fp8"
        elem = 1 if fp8 else 2
        kv_bytes = b * c * hkv * d * 2 * elem
        copies = max(1, min(16, -(-GIB // kv_bytes)))
        cache = self.bench._cache(copies * b * nblk + 1, fp8)
        g = torch.Generator(device=self.dev).manual_seed(b * 1000 + c)
        perm = (torch.randperm(copies * b * nblk, device=self.dev, generator=g) + 1).to(torch.int32)
        sl = torch.full((b,), c, dtype=torch.int32, device=self.dev)
        qsl = torch.arange(b + 1, dtype=torch.int32, device=self.dev)
        inputs = [(torch.randn((b, a.heads, d), dtype=torch.bfloat16, device=self.dev),
                   perm[i * b * nblk : (i + 1) * b * nblk].view(b, nblk)) for i in range(copies)]
        io_bytes = 2 * inputs[0][0].numel() * 2
        ks = torch.tensor(0.5, device=self.dev) if fp8 else self.one
        vs = torch.tensor(2.0, device=self.dev) if fp8 else self.one
        n = min(b, REF_SEQS)
        q0, bt0 = inputs[0]
        ref = paged_attention_ref(q0[:n], cache, bt0[:n], sl[:n], qsl[: n + 1], scale, ks, vs)
        variants = []
        for v in selected(DECODE_VARIANTS, a.variant_names):
            if kind in v.kinds:
                r = self._resolve(v, b, c, elem)
                if r is not None:
                    variants.append((v, *r))

        def call(x, cfg, ns, compile_only=False):
            return paged_attention(x[0], cache, x[1], sl, qsl, scale, ks, vs, max_query_len=1, max_seq_len=c,
                                   num_splits=ns, config=cfg, compile_only=compile_only)

        with async_compiles(ignore_errors=True):
            for _, cfg, ns in variants:
                with contextlib.suppress(Exception):
                    call(inputs[0], cfg, ns, compile_only=True)
        ok_variants = []
        for v, cfg, ns in variants:
            try:
                err = self._rel_err(call(inputs[0], cfg, ns)[:n], ref)
            except Exception as e:  # out of shared memory, compile error, ...
                self.say(f"  {kind} {v.name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            ok_variants.append((v, cfg, ns, err))
        times = self._time_graphs(
            [[lambda x=x, cfg=cfg, ns=ns: call(x, cfg, ns) for x in inputs] for _, cfg, ns, _ in ok_variants])
        base = pick_config(1, a.heads // hkv, d, elem)  # what 'default' runs
        auto = pick_num_splits(b * hkv, c, base.tile_n, device_sms(self.dev), base.programs_per_sm)
        self.say(f"\n== decode {kind} batch {b} x ctx {c}: KV {kv_bytes / 1e6:.0f} MB, {copies} copies per "
                 f"replay, default splits {auto}")
        self.say(f"  {'variant':<20} {'splits':>6} {'tile/warps/stages':>17} {'ms':>8} {'GB/s':>6} {'%peak':>6} "
                 f"{'vs dflt':>7} {'vs bf16':>7}  check (rel err, before / after timing)")
        best = None
        for (v, cfg, ns, err), ms in zip(ok_variants, times, strict=True):
            if ms is None:
                continue
            cfg_used = cfg or base
            splits = ns or pick_num_splits(b * hkv, c, cfg_used.tile_n, device_sms(self.dev),
                                           cfg_used.programs_per_sm)
            err2 = self._rel_err(call(inputs[0], cfg, ns)[:n], ref)
            bw = (kv_bytes + io_bytes) / (ms * 1e-3)
            if v.name == "default":
                results[(kind, b, c)] = ms
            default_ms = results.get((kind, b, c))
            vs_default = default_ms / ms if default_ms else float("nan")
            vs_bf16 = bf16_default / ms if (fp8 and bf16_default) else float("nan")
            ok = err < 1e-2 and err2 < 1e-2
            if not ok:
                self.bench.failures.append(f"decode variant {kind} {v.name} {b}x{c}")
            shape = f"{cfg_used.tile_n}/{cfg_used.num_warps}/{cfg_used.num_stages}"
            self.say(f"  {v.name:<20} {splits:>6} {shape:>17} {ms:8.4f} {bw / 1e9:6.0f} "
                     f"{100 * bw / a.peak_bw:5.1f}% {vs_default:6.3f}x {vs_bf16:6.2f}x  "
                     f"{'ok' if ok else 'FAIL'} {err:.1e} / {err2:.1e}")
            self.bench.rows.append(self._row("decode-variant", f"{kind} {b}x{c} {v.name}", ms, "GB/s", bw / 1e9,
                                           ok, kind=kind, batch=b, ctx=c, variant=v.name, splits=splits,
                                           config=asdict(cfg_used), vs_default=vs_default, vs_bf16=vs_bf16,
                                           pct_peak=100 * bw / a.peak_bw, err=err, err_after=err2))
            if ok and (best is None or ms < best[1]):
                best = (v.name, ms, bw, vs_bf16)
        if best is not None:
            results[(f"{kind} best", b, c)] = best[1]
            if fp8:
                bf16_best = results.get(("bf16 best", b, c))
                vs_best = f", x{bf16_best / best[1]:.2f} vs the best bf16 variant" if bf16_best else ""
                target = f"x{best[3]:.2f} vs bf16 default{vs_best} (>= 1.6 at ctx >= 4k)"
            else:
                target = f"{100 * best[2] / a.peak_bw:.1f}% of peak (>= 80% at batch >= 8, ctx >= 4k)"
            self.summary_lines.append(f"decode {kind} {b}x{c}: best '{best[0]}' {best[1]:.4f} ms, {target}")

    def _rel_err(self, got, ref) -> float:
        g, r = got.float(), ref.float()
        err = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        return err if bool(self.torch.isfinite(g).all()) else float("inf")

    def _time_graphs(self, fn_lists: list[list], rounds: int = 20) -> list[float | None]:
        """Per list: median ms per call over ``rounds`` replays of one CUDA graph holding the calls
        back to back; the graphs replay round robin so drift hits every variant alike."""
        torch = self.torch
        graphs: list = []
        for fns in fn_lists:
            if self.left() <= 0:
                graphs.append(None)
                continue
            try:
                graphs.append(capture_graph(fns))  # warms the allocator / split counters first
            except Exception as e:
                print(f"  graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                graphs.append(None)
        times: list[list[float]] = [[] for _ in graphs]
        for _ in range(rounds):
            for i, graph in enumerate(graphs):
                if graph is None:
                    continue
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end) / len(fn_lists[i]))
        return [sorted(t)[len(t) // 2] if t else None for t in times]

    # -- prefill --------------------------------------------------------------------------

    def prefill_job(self, n: int) -> None:
        torch = self.torch
        import torch.nn.functional as F
        import triton

        from paged_backend.kernels.cache_write import write_kv_cache
        from paged_backend.kernels.paged_attention import paged_attention, pick_config

        a = self.args
        h, hkv, d, bs = a.heads, a.kv_heads, a.head_dim, a.block_size
        scale = d**-0.5
        nblk = math.ceil(n / bs)
        cache = torch.empty((2, nblk + 1, bs, hkv, d), dtype=torch.bfloat16, device=self.dev).normal_()
        g = torch.Generator(device=self.dev).manual_seed(n)
        bt = (torch.randperm(nblk, device=self.dev, generator=g) + 1).to(torch.int32)[None]
        q = torch.randn((n, h, d), dtype=torch.bfloat16, device=self.dev)
        k = torch.randn((n, hkv, d), dtype=torch.bfloat16, device=self.dev)
        v = torch.randn((n, hkv, d), dtype=torch.bfloat16, device=self.dev)
        pos = torch.arange(n, device=self.dev)
        write_kv_cache(k, v, cache, (bt[0].long()[pos // bs] * bs + pos % bs).contiguous(), self.one, self.one)
        sl = torch.tensor([n], dtype=torch.int32, device=self.dev)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=self.dev)
        qc = q.transpose(0, 1)[None].contiguous()
        kg, vg = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()
        ke, ve = kg.repeat_interleave(h // hkv, dim=1), vg.repeat_interleave(h // hkv, dim=1)
        ref = F.scaled_dot_product_attention(qc, ke, ve, is_causal=True, scale=scale)[0].transpose(0, 1)
        flops = 4 * h * d * n * (n + 1) / 2
        rep = min(a.rep, 100)

        def bench_ms(fn) -> float:
            fn()
            torch.cuda.synchronize()
            return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))

        t_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(qc, ke, ve, is_causal=True, scale=scale))
        with contextlib.suppress(Exception):
            t_sdpa = min(t_sdpa, bench_ms(lambda: F.scaled_dot_product_attention(
                qc, kg, vg, is_causal=True, scale=scale, enable_gqa=True)))
        base = pick_config(n, h // hkv, d, baseline=True)  # variants override the untuned baseline
        variants = [(vr, None if vr.name == "default" else replace(base, **vr.cfg))
                    for vr in selected(PREFILL_VARIANTS, a.variant_names)]

        def call(cfg, compile_only=False):
            return paged_attention(q, cache, bt, sl, qsl, scale, self.one, self.one, max_query_len=n,
                                   max_seq_len=n, config=cfg, compile_only=compile_only)

        with async_compiles(ignore_errors=True):
            for _, cfg in variants:
                with contextlib.suppress(Exception):
                    call(cfg, compile_only=True)
        checked = []
        for vr, cfg in variants:
            try:
                err = self._rel_err(call(cfg), ref)
            except Exception as e:
                self.say(f"  prefill {vr.name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            checked.append((vr, cfg, err, []))
        for _ in range(2):  # two interleaved rounds, best median counts
            for _vr, cfg, _err, ts in checked:
                if self.left() > 0:
                    ts.append(bench_ms(lambda cfg=cfg: call(cfg)))
        self.say(f"\n== prefill causal {n} tokens: SDPA {t_sdpa:.4f} ms ({flops / (t_sdpa * 1e-3) / 1e12:.0f} "
                 f"TFLOP/s, best of MHA-expanded / enable_gqa)")
        self.say(f"  {'variant':<32} {'m/tile/warps/stages':>19} {'ms':>8} {'TFLOP/s':>7} {'vs SDPA':>7} "
                 f"{'vs dflt':>7}  check (rel err vs SDPA, before / after)")
        default_ms, best = None, None
        for vr, cfg, err, ts in checked:
            if not ts:
                continue
            ms = min(ts)
            default_ms = ms if vr.name == "default" else default_ms
            err2 = self._rel_err(call(cfg), ref)
            ok = err < 1e-2 and err2 < 1e-2
            if not ok:
                self.bench.failures.append(f"prefill variant {vr.name} {n}")
            c = cfg or pick_config(n, h // hkv, d)  # the launcher's pick for 'default'
            ratio = t_sdpa / ms
            vs_default = default_ms / ms if default_ms else float("nan")
            self.say(f"  {vr.name:<32} {f'{c.block_m}/{c.tile_n}/{c.num_warps}/{c.num_stages}':>19} {ms:8.4f} "
                     f"{flops / (ms * 1e-3) / 1e12:7.0f} {ratio:6.2f}x {vs_default:6.3f}x  "
                     f"{'ok' if ok else 'FAIL'} {err:.1e} / {err2:.1e}")
            self.bench.rows.append(self._row("prefill-variant", f"{n} {vr.name}", ms, "TFLOP/s",
                                           flops / (ms * 1e-3) / 1e12, ok, tokens=n, variant=vr.name,
                                           config=asdict(c), vs_sdpa=ratio, sdpa_ms=t_sdpa, vs_default=vs_default,
                                           err=err, err_after=err2))
            if ok and (best is None or ms < best[1]):
                best = (vr.name, ms, ratio)
        if best is not None:
            self.summary_lines.append(f"prefill {n}: best '{best[0]}' {best[1]:.4f} ms, x{best[2]:.2f} of SDPA "
                                      f"(>= 0.8)")

    # -- driver ---------------------------------------------------------------------------

    def _row(self, group: str, name: str, ms: float, metric: str, value: float, ok: bool, **extra):
        from paged_backend.benchmarks.kernels import Row

        return Row(group, name, ms, metric, value, "", ok, extra)

    def run(self, groups: list[str]) -> None:
        a = self.args
        cells = parse_cells(a.variant_cells)
        lens = [int(x) for x in a.prefill_lens.split(",") if x]
        lens.sort(reverse=True)
        jobs: list[tuple[str, Any]] = []
        decode_jobs = [("decode", cell) for cell in cells] if "decode" in groups else []
        prefill_jobs = [("prefill", n) for n in lens] if "prefill" in groups else []
        # priority: first decode cell, first prefill length, then alternate
        while decode_jobs or prefill_jobs:
            if decode_jobs:
                jobs.append(decode_jobs.pop(0))
            if prefill_jobs:
                jobs.append(prefill_jobs.pop(0))
        results: dict = {}
        for what, arg in jobs:
            if self.left() <= 0:
                self.say(f"  [budget] skipped {what} {arg}")
                continue
            t0 = time.time()
            try:  # one failed job (out of memory, a bug) must not cost the rest of the sweep
                if what == "decode":
                    self.decode_job(*arg, results)
                else:
                    self.prefill_job(arg)
            except Exception:
                self.say(f"  {what} {arg} FAILED:\n{traceback.format_exc(limit=6)}")
                self.bench.failures.append(f"variant job {what} {arg}")
            self.torch.cuda.empty_cache()
            print(f"  [{what} {arg} took {time.time() - t0:.0f} s, {max(0.0, self.left()):.0f} s of budget left]",
                  flush=True)
            self.dump_json()
        self.say("\nVariant summary (best variant whose checks passed, per job):")
        for line in self.summary_lines:
            self.say(f"  {line}")
        self.dump_json()

    def dump_json(self) -> None:
        """Write the rows so far (bench_kernels.main overwrites the JSON at the end) and the tables
        (``<json stem>.variants.txt``), so a run cut short still leaves its results."""
        if not self.args.json:
            return
        with open(self.args.json, "w") as f:
            json.dump({"partial": True, "failures": self.bench.failures,
                       "rows": [asdict(r) for r in self.bench.rows]}, f, indent=1)
        with open(os.path.splitext(self.args.json)[0] + ".variants.txt", "w") as f:
            f.write("\n".join(self.report) + "\n")
