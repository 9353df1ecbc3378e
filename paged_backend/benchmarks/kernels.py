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
decode / prefill grids (paged_backend/bench_attention_variants.py).

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
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any


def capture_graph(fns):
    """``fns`` warmed on a side stream (compiles, allocator), then captured back to back and replayed once."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def copies_to_touch(nbytes: float, touch: float, most: int, least: int = 1) -> int:
    """How many input copies a graph replay rotates over so it moves >= ``touch`` bytes (L2 then
    cannot serve a rerun), ``nbytes`` per copy, between ``least`` and ``most``."""
    return max(least, min(most, math.ceil(touch / max(1, nbytes))))


def time_graph_ms(fns, replays: int = 20) -> float:
    """Median GPU time per call (ms) of ``fns`` captured back to back in one CUDA graph."""
    import torch

    graph = capture_graph(fns)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    del graph
    return times[len(times) // 2] / len(fns)

GIB = 1 << 30
SWEEP_SPLITS = {(1, 32768), (8, 4096), (8, 32768)}  # decode cells where --sweep times split counts
SWEEP_TILES = {(64, 4096)}  # ... and tile configs
SWEEP_PREFILL = {8192}


@dataclass
class Row:
    """One timed measurement."""

    group: str
    name: str
    ms: float
    metric: str  # "GB/s" or "TFLOP/s"
    value: float
    target: str = ""
    ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_ints(s: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64] (the benches' comma-separated grid options)."""
    return [int(x) for x in s.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-backend bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=["ceilings", "decode", "prefill", "elementwise", "int4"], default=None,
                   help="run only these groups (ceilings always run: the others are judged against them)")
    p.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    p.add_argument("--contexts", default="512,4096,32768", help="decode context lengths")
    p.add_argument("--prefill-lens", default="2048,8192", help="causal prefill lengths")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=8192, help="elementwise kernels: tokens")
    p.add_argument("--hidden", type=int, default=4096, help="elementwise kernels: hidden size")
    p.add_argument("--peak-bw", type=float, default=4.2e12, help="bandwidth the decode target is 80%% of")
    p.add_argument("--sweep", action="store_true", help="also time split counts and tile configs")
    p.add_argument("--variants", action="store_true",
                   help="decode/prefill: time the paged-attention code-path variants side by side instead of "
                        "the grids (paged_backend/bench_attention_variants.py)")
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


class Bench:
    """Holds the device, the timing settings and the rows measured so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.torch = torch
        self.dev = torch.device("cuda")
        self.rows: list[Row] = []
        self.failures: list[str] = []
        self.copy_bw = float("nan")

    # -- helpers ------------------------------------------------------------------------

    def time_ms(self, fn) -> float:
        import triton

        fn()
        self.torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=25, rep=self.args.rep, return_mode="median"))

    def time_graph_ms(self, fns, replays: int = 20) -> float:
        """Median time per call of ``fns`` captured back to back in one CUDA graph (no host overhead)."""
        return time_graph_ms(fns, replays)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        flag = "" if row.ok is None else (" ok" if row.ok else " BELOW")
        print(f"  {row.group:<11} {row.name:<44} {row.ms:9.4f} ms {row.value:9.1f} {row.metric:<7} "
              f"{row.target}{flag}", flush=True)
        return row

    def check(self, name: str, got, ref, rel_tol: float) -> bool:
        torch = self.torch
        g, r = got.float(), ref.float()
        err = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        finite = bool(torch.isfinite(g).all())
        ok = finite and err < rel_tol
        print(f"  check {name:<52} rel err {err:.2e} (< {rel_tol:g}) {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            self.failures.append(name)
        return ok

    # -- ceilings -------------------------------------------------------------------------

    def ceilings(self) -> None:
        self._copy()
        self._gemm()

    def _copy(self) -> None:
        torch = self.torch
        n = GIB
        src = torch.randn(n, dtype=torch.bfloat16, device=self.dev)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        self.copy_bw = 2 * n * 2 / (ms * 1e-3)
        self.add(Row("ceilings", "device copy 2 GiB (read + write)", ms, "GB/s", self.copy_bw / 1e9))

    def _gemm(self) -> None:
        torch = self.torch
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=self.dev)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=self.dev)
        ms = self.time_ms(lambda: a @ b)
        self.add(Row("ceilings", "bf16 GEMM 8192^3", ms, "TFLOP/s", 2 * 8192**3 / (ms * 1e-3) / 1e12))

    # -- decode ---------------------------------------------------------------------------

    def _cache(self, num_blocks: int, fp8: bool):
        """Random K/V cache; fp8 filled chunk by chunk from bf16 normals."""
        torch = self.torch
        a = self.args
        shape = (2, num_blocks, a.block_size, a.kv_heads, a.head_dim)
        if not fp8:
            return torch.empty(shape, dtype=torch.bfloat16, device=self.dev).normal_()
        from paged_backend.kernels.cache_write_ref import FP8_DTYPE

        cache = torch.empty(shape, dtype=FP8_DTYPE, device=self.dev)
        step = max(1, (GIB // 2) // (a.block_size * a.kv_heads * a.head_dim))
        for i in range(0, num_blocks, step):
            chunk = torch.empty_like(cache[:, i : i + step], dtype=torch.bfloat16).normal_()
            cache[:, i : i + step] = chunk.to(FP8_DTYPE)
        return cache

    def _decode_inputs(self, batch: int, ctx: int, perm, copy: int = 0):
        """Batch ``copy`` uses its own disjoint blocks (copies rotate so L2 cannot serve a rerun)."""
        torch = self.torch
        a = self.args
        nblk = math.ceil(ctx / a.block_size)
        n = batch * nblk
        bt = perm[copy * n : (copy + 1) * n].view(batch, nblk).to(torch.int32)
        q = torch.randn((batch, a.heads, a.head_dim), dtype=torch.bfloat16, device=self.dev)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=self.dev)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=self.dev)
        return q, bt, sl, qsl

    def decode(self) -> None:
        torch = self.torch
        from paged_backend.kernels.paged_attention import paged_attention
        from paged_backend.kernels.paged_attention_ref import paged_attention_ref

        a = self.args
        batches, contexts = parse_ints(a.batches), parse_ints(a.contexts)
        max_blocks = max(b * math.ceil(c / a.block_size) for b in batches for c in contexts)
        one = torch.ones((), device=self.dev)
        results: dict[tuple[str, int, int], float] = {}
        for kind in ("bf16", "fp8"):
            cache = self._cache(max_blocks + 1, kind == "fp8")
            g = torch.Generator(device=self.dev).manual_seed(0)
            perm = torch.randperm(max_blocks, device=self.dev, generator=g) + 1
            if not a.no_check:
                cells = [(b, c) for b, c in ((8, 4096), (1, 32768), (3, 1000))
                         if b * math.ceil(c / a.block_size) <= max_blocks] or [(batches[-1], contexts[-1])]
                for b, c in cells:
                    q, bt, sl, qsl = self._decode_inputs(b, c, perm)
                    out = paged_attention(q, cache, bt, sl, qsl, a.head_dim**-0.5, one, one, max_query_len=1,
                                          max_seq_len=c)
                    ref = paged_attention_ref(q, cache, bt, sl, qsl, a.head_dim**-0.5, one, one)
                    self.check(f"decode {kind} batch {b} ctx {c}", out, ref, 1e-2)
            for b in batches:
                for c in contexts:
                    self._decode_cell(kind, b, c, cache, perm, results)
            del cache
            torch.cuda.empty_cache()

    def _decode_cell(self, kind: str, b: int, c: int, cache, perm, results: dict) -> None:
        torch = self.torch
        from paged_backend.kernels.paged_attention import AttentionConfig, paged_attention, pick_config

        a = self.args
        fp8 = kind == "fp8"
        one = torch.ones((), device=self.dev)
        kv_bytes = b * c * a.kv_heads * a.head_dim * 2 * cache.element_size()
        # rotate over disjoint copies until ~1 GB is touched per graph replay (L2 is 50 MB)
        copies = max(1, min(copies_to_touch(kv_bytes, GIB, 16), len(perm) // (b * math.ceil(c / a.block_size))))
        inputs = [self._decode_inputs(b, c, perm, i) for i in range(copies)]
        io_bytes = 2 * inputs[0][0].numel() * inputs[0][0].element_size()

        def calls(ns=None, cfg=None):
            return [lambda x=x: paged_attention(x[0], cache, x[1], x[2], x[3], a.head_dim**-0.5, one, one,
                                                max_query_len=1, max_seq_len=c, num_splits=ns, config=cfg)
                    for x in inputs]

        def run(ns=None, cfg=None):
            return self.time_graph_ms(calls(ns, cfg))

        ms = run()
        bw = (kv_bytes + io_bytes) / (ms * 1e-3)
        results[(kind, b, c)] = ms
        target, ok = "", None
        if b >= 8 and c >= 4096:
            target, ok = ">= 80% of peak", bw >= 0.8 * a.peak_bw
        if fp8 and ("bf16", b, c) in results:
            sp = results[("bf16", b, c)] / ms
            target += f" x{sp:.2f} vs bf16"
            if c >= 4096:
                target += " (>= 1.6)"
                ok = (ok is not False) and sp >= 1.6
        l2 = " (L2-resident)" if copies * kv_bytes < 256e6 else ""
        self.add(Row("decode", f"{kind} batch {b:>3} ctx {c:>5}", ms, "GB/s", bw / 1e9,
                     f"{100 * bw / a.peak_bw:5.1f}% {target}{l2}", ok,
                     {"batch": b, "ctx": c, "kv": kind, "copies": copies}))
        if not a.sweep:
            return
        best = (ms, "auto")
        for ns in (1, 2, 4, 8, 16, 32, 64) if (b, c) in SWEEP_SPLITS else ():
            if ns <= max(1, c // 256):
                t = run(ns)
                print(f"    splits={ns}: {t:.4f} ms", flush=True)
                best = min(best, (t, f"splits={ns}"))
        base = pick_config(1, a.heads // a.kv_heads, a.head_dim, cache.element_size())
        for tn in (64, 128) if (b, c) in SWEEP_TILES else ():
            for nw in (4, 8):
                for st in (2, 3, 4):
                    cfg = AttentionConfig(base.block_m, tn, nw, st)
                    try:
                        t = run(None, cfg)
                    except Exception as e:  # out of shared memory etc.
                        print(f"    {cfg}: {type(e).__name__}", flush=True)
                        continue
                    best = min(best, (t, f"tile_n={tn} warps={nw} stages={st}"))
        if best[1] != "auto" or (b, c) in SWEEP_SPLITS | SWEEP_TILES:
            print(f"    sweep best: {best[1]} {best[0]:.4f} ms (auto {ms:.4f})", flush=True)

    # -- prefill --------------------------------------------------------------------------

    def prefill(self) -> None:
        for n in parse_ints(self.args.prefill_lens):
            self._prefill_one(n)
            self.torch.cuda.empty_cache()

    def prefill_inputs(self, n: int):
        """One causal request of ``n`` new tokens: q, k, v [n, heads, head_dim] (bf16), a bf16 cache
        holding k / v in shuffled pages, its block table, seq_lens and query_start_loc."""
        torch = self.torch
        from paged_backend.kernels.cache_write import write_kv_cache

        a = self.args
        h, hkv, d, bs = a.heads, a.kv_heads, a.head_dim, a.block_size
        one = torch.ones((), device=self.dev)
        nblk = math.ceil(n / bs)
        cache = torch.empty((2, nblk + 1, bs, hkv, d), dtype=torch.bfloat16, device=self.dev).normal_()
        g = torch.Generator(device=self.dev).manual_seed(1)
        bt = (torch.randperm(nblk, device=self.dev, generator=g) + 1).to(torch.int32)[None]
        q = torch.randn((n, h, d), dtype=torch.bfloat16, device=self.dev)
        k = torch.randn((n, hkv, d), dtype=torch.bfloat16, device=self.dev)
        v = torch.randn((n, hkv, d), dtype=torch.bfloat16, device=self.dev)
        pos = torch.arange(n, device=self.dev)
        write_kv_cache(k, v, cache, (bt[0].long()[pos // bs] * bs + pos % bs).contiguous(), one, one)
        sl = torch.tensor([n], dtype=torch.int32, device=self.dev)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=self.dev)
        return q, k, v, cache, bt, sl, qsl

    def _prefill_one(self, n: int) -> None:
        torch = self.torch
        import torch.nn.functional as F

        from paged_backend.kernels.paged_attention import AttentionConfig, paged_attention, query_prescale

        a = self.args
        h, hkv, d = a.heads, a.kv_heads, a.head_dim
        scale = d**-0.5
        one = torch.ones((), device=self.dev)
        q, k, v, cache, bt, sl, qsl = self.prefill_inputs(n)
        # SDPA on contiguous [1, H, N, D]; K/V expanded to all heads, or GQA-native: the faster counts
        qc = q.transpose(0, 1)[None].contiguous()
        kc = k.transpose(0, 1)[None].repeat_interleave(h // hkv, dim=1).contiguous()
        vc = v.transpose(0, 1)[None].repeat_interleave(h // hkv, dim=1).contiguous()
        kg = k.transpose(0, 1)[None].contiguous()
        vg = v.transpose(0, 1)[None].contiguous()

        # the engine's layers hand prefill attention q with the scale folded in by the rotary kernel
        factor = query_prescale(q, cache, scale, n, n)
        q_eng = q if factor is None else torch.mul(q, factor)

        def ours(cfg=None):
            return paged_attention(q_eng, cache, bt, sl, qsl, scale, one, one, max_query_len=n, max_seq_len=n,
                                   config=cfg, q_scaled=factor is not None)

        def ours_unscaled():
            return paged_attention(q, cache, bt, sl, qsl, scale, one, one, max_query_len=n, max_seq_len=n)

        def sdpa():
            return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)

        def sdpa_gqa():
            return F.scaled_dot_product_attention(qc, kg, vg, is_causal=True, scale=scale, enable_gqa=True)

        if not a.no_check:
            self.check(f"prefill {n} vs SDPA", ours(), sdpa()[0].transpose(0, 1), 1e-2)
            self.check(f"prefill {n} q unscaled vs SDPA", ours_unscaled(), sdpa()[0].transpose(0, 1), 1e-2)
        flops = 4 * h * d * n * (n + 1) / 2  # causal: QK^T and PV over the lower triangle
        t_sdpa = self.time_ms(sdpa)
        try:
            t_gqa = self.time_ms(sdpa_gqa)
        except Exception:  # older torch: no enable_gqa
            t_gqa = float("inf")
        t_ref = min(t_sdpa, t_gqa)
        self.add(Row("prefill", f"SDPA causal {n} tokens (best of MHA/GQA)", t_ref, "TFLOP/s",
                     flops / (t_ref * 1e-3) / 1e12, extra={"mha_ms": t_sdpa, "gqa_ms": t_gqa}))
        ms = self.time_ms(ours)
        ratio = t_ref / ms
        self.add(Row("prefill", f"paged causal {n} tokens", ms, "TFLOP/s", flops / (ms * 1e-3) / 1e12,
                     f"x{ratio:.2f} of SDPA (do_bench)", None, {"tokens": n, "q_scaled": factor is not None}))
        ms_u = self.time_ms(ours_unscaled)
        self.add(Row("prefill", f"paged causal {n} tokens, q unscaled", ms_u, "TFLOP/s", flops / (ms_u * 1e-3) / 1e12,
                     f"x{t_ref / ms_u:.2f} of SDPA (launcher folds the scale)", None, {"tokens": n}))
        # the verdict: the same two (SDPA's faster form, ours) as CUDA-graph replays over rotating
        # copies of their inputs, no host launch time in either (do_bench's runs wait on a slow launch:
        # our 2k call read 0.10-0.17 ms there across runs, 0.097 ms here)
        gqa = t_gqa < t_sdpa
        per_call = (qc.numel() + 2 * (kg if gqa else kc).numel() + qc.numel()) * 2

        def sdpa_set(i):
            qi, ki, vi = qc.clone(), (kg if gqa else kc).clone(), (vg if gqa else vc).clone()
            return lambda: F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)

        def ours_set(i):
            qi, ci = q_eng.clone(), cache.clone()
            return lambda: paged_attention(qi, ci, bt, sl, qsl, scale, one, one, max_query_len=n, max_seq_len=n,
                                           q_scaled=factor is not None)

        g_ref, g_ours = self.time_sets_ms(sdpa_set, per_call), self.time_sets_ms(ours_set, per_call)
        self.add(Row("prefill", f"SDPA causal {n} tokens, graph", g_ref, "TFLOP/s", flops / (g_ref * 1e-3) / 1e12,
                     "CUDA-graph replays, rotating inputs"))
        self.add(Row("prefill", f"paged causal {n} tokens, graph", g_ours, "TFLOP/s", flops / (g_ours * 1e-3) / 1e12,
                     f"x{g_ref / g_ours:.2f} of SDPA (>= 0.8)", g_ref / g_ours >= 0.8, {"tokens": n}))
        if not a.sweep or n not in SWEEP_PREFILL:
            return
        best = (ms, "auto")
        for bm, tn, nw, st in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
                               (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3),
                               (128, 32, 4, 4), (256, 64, 8, 2)]:
            cfg = AttentionConfig(bm, tn, nw, st)
            try:
                t = self.time_ms(lambda cfg=cfg: ours(cfg))
            except Exception as e:
                print(f"    {cfg}: {type(e).__name__}", flush=True)
                continue
            print(f"    {cfg}: {t:.4f} ms ({flops / (t * 1e-3) / 1e12:.0f} TFLOP/s)", flush=True)
            best = min(best, (t, str(cfg)))
        print(f"    sweep best: {best[1]} {best[0]:.4f} ms (auto {ms:.4f})", flush=True)

    # -- elementwise ----------------------------------------------------------------------

    def _report_bw(self, name: str, ms: float, nbytes: float, ref_ms: float | None = None) -> None:
        bw = nbytes / (ms * 1e-3)
        extra = f" torch ref {ref_ms:.3f} ms" if ref_ms is not None else ""
        self.add(Row("elementwise", name, ms, "GB/s", bw / 1e9,
                     f"{100 * bw / self.copy_bw:5.1f}% of copy (>= 70%){extra}", bw >= 0.7 * self.copy_bw))

    def elementwise(self) -> None:
        self._rms_norm()
        self._silu()
        self._rotary()
        self._cache_write()

    def time_sets_ms(self, make, nbytes: float) -> float:
        """GPU time per call (ms) of ``make(i)``'s calls, each on its own input set, captured back to
        back in a CUDA graph: >= 1 GiB per replay (L2 cannot serve a rerun), and no host launch
        overhead (``do_bench`` with Python launches was host-bound for these kernels: a launcher's
        argument checks outlast the L2 flush between runs)."""
        return self.time_graph_ms([make(i) for i in range(copies_to_touch(nbytes, GIB, 16, least=2))])

    def _rms_norm(self) -> None:
        torch = self.torch
        from paged_backend.kernels.rms_norm import rms_norm
        from paged_backend.kernels.rms_norm_ref import rms_norm_ref

        t, hid = self.args.tokens, self.args.hidden

        def inputs():
            return (torch.randn((t, hid), dtype=torch.bfloat16, device=self.dev),
                    torch.randn((t, hid), dtype=torch.bfloat16, device=self.dev))

        w = torch.randn((hid,), dtype=torch.bfloat16, device=self.dev)
        x, r = inputs()
        if not self.args.no_check:
            self.check("rms_norm+residual", rms_norm(x, w, 1e-5, r)[0], rms_norm_ref(x, w, 1e-5, r)[0], 1e-2)

        def make(residual):
            def one(i):
                xi, ri = inputs()
                return (lambda: rms_norm(xi, w, 1e-5, ri)) if residual else (lambda: rms_norm(xi, w, 1e-5))
            return one

        self._report_bw(f"rms_norm {t}x{hid} +residual", self.time_sets_ms(make(True), 4 * t * hid * 2),
                        4 * t * hid * 2, self.time_ms(lambda: rms_norm_ref(x, w, 1e-5, r)))
        self._report_bw(f"rms_norm {t}x{hid}", self.time_sets_ms(make(False), 2 * t * hid * 2), 2 * t * hid * 2)

    def _silu(self) -> None:
        torch = self.torch
        from paged_backend.kernels.activation import silu_and_mul
        from paged_backend.kernels.activation_ref import silu_and_mul_ref

        t, hid = self.args.tokens, self.args.hidden
        x = torch.randn((t, 2 * hid), dtype=torch.bfloat16, device=self.dev)
        if not self.args.no_check:
            self.check("silu_and_mul", silu_and_mul(x), silu_and_mul_ref(x), 1e-2)

        def make(i):
            xi = torch.randn((t, 2 * hid), dtype=torch.bfloat16, device=self.dev)
            return lambda: silu_and_mul(xi)

        nbytes = 3 * t * hid * 2
        self._report_bw(f"silu_and_mul {t}x2*{hid}", self.time_sets_ms(make, nbytes), nbytes,
                        self.time_ms(lambda: silu_and_mul_ref(x)))

    def _rotary(self) -> None:
        torch = self.torch
        from paged_backend.kernels.paged_attention import LOG2E
        from paged_backend.kernels.rotary import rotary
        from paged_backend.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_ref

        a = self.args
        t, d = a.tokens, a.head_dim
        h = a.hidden // d
        table = rope_cos_sin_cache(rope_inv_freq(d, 500000.0), 8192).to(self.dev)

        def inputs():
            return (torch.randn((t, h, d), dtype=torch.bfloat16, device=self.dev),
                    torch.randn((t, a.kv_heads, d), dtype=torch.bfloat16, device=self.dev),
                    torch.randint(0, 8192, (t,), device=self.dev))

        q, k, pos = inputs()
        # prefill steps: q also takes the attention kernel's scale (the launcher's pass over q it replaces)
        qs = d**-0.5 * LOG2E
        if not a.no_check:
            self.check("rotary q", rotary(pos, q, k, table)[0], rotary_ref(pos, q, k, table)[0], 1e-2)
            self.check("rotary q scaled", rotary(pos, q, k, table, qs)[0], rotary_ref(pos, q, k, table, qs)[0], 1e-2)

        def make(scale):
            def one(i):
                qi, ki, pi = inputs()
                return lambda: rotary(pi, qi, ki, table, scale)
            return one

        nbytes = 2 * (q.numel() + k.numel()) * 2 + t * (d * 4 + 8)
        self._report_bw(f"rotary {t}x({h}+{a.kv_heads})x{d}", self.time_sets_ms(make(None), nbytes), nbytes,
                        self.time_ms(lambda: rotary_ref(pos, q, k, table)))
        self._report_bw(f"rotary {t}x({h}+{a.kv_heads})x{d}, q scaled", self.time_sets_ms(make(qs), nbytes), nbytes)

        def mul(i):
            qi = torch.randn((t, h, d), dtype=torch.bfloat16, device=self.dev)
            return lambda: torch.mul(qi, qs)

        ms = self.time_sets_ms(mul, 2 * q.numel() * 2)
        self.add(Row("elementwise", f"q x scale {t}x{h}x{d} (torch.mul)", ms, "GB/s", 2 * q.numel() * 2 / (ms * 1e-3) / 1e9,
                     "the attention launcher's pass the fold replaces"))

    def _cache_write(self) -> None:
        torch = self.torch
        from paged_backend.kernels.cache_write import write_kv_cache
        from paged_backend.kernels.cache_write_ref import FP8_DTYPE, write_kv_cache_ref

        a = self.args
        t, d, bs = a.tokens, a.head_dim, a.block_size
        h = a.hidden // d
        key = torch.randn((t, h, d), dtype=torch.bfloat16, device=self.dev)
        val = torch.randn((t, h, d), dtype=torch.bfloat16, device=self.dev)
        slots = torch.randperm(t, device=self.dev)
        s = torch.tensor(0.5, device=self.dev)
        for cdt, name in ((torch.bfloat16, "bf16"), (FP8_DTYPE, "fp8")):
            cache = torch.zeros((2, t // bs, bs, h, d), dtype=cdt, device=self.dev)
            if not a.no_check:
                ref = cache.clone()
                write_kv_cache(key, val, cache, slots, s, s)
                write_kv_cache_ref(key, val, ref, slots, s, s)
                same = torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
                print(f"  check cache_write {name:<40} bit-exact {'ok' if same else 'FAIL'}", flush=True)
                if not same:
                    self.failures.append(f"cache_write {name}")
            nbytes = 2 * key.numel() * 2 + 2 * key.numel() * cache.element_size() + t * 8

            def make(i, cache=cache):
                ki, vi, ci = torch.randn_like(key), torch.randn_like(val), torch.zeros_like(cache)
                si = torch.randperm(t, device=self.dev)
                return lambda: write_kv_cache(ki, vi, ci, si, s, s)

            self._report_bw(f"cache_write {t}x{h}x{d} K+V -> {name}", self.time_sets_ms(make, nbytes), nbytes)

    # -- output ---------------------------------------------------------------------------

    def summary(self) -> None:
        print("\n| group | case | ms | rate | target |")
        print("| --- | --- | ---: | ---: | --- |")
        for r in self.rows:
            if r.group.endswith("-variant"):  # --variants prints its own tables
                continue
            flag = "" if r.ok is None else (" ok" if r.ok else " **below**")
            print(f"| {r.group} | {r.name} | {r.ms:.4f} | {r.value:.1f} {r.metric} | {r.target}{flag} |")
        if self.failures:
            print(f"\nCHECKS FAILED: {', '.join(self.failures)}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``paged-backend bench kernels``; returns 1 when a check fails."""
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    bench = Bench(args)
    groups = args.only or ["ceilings", "decode", "prefill", "elementwise", "int4"]
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    bench.ceilings()
    if args.variants:  # the variant sweep replaces the decode / prefill grids
        from paged_backend.benchmarks.attention_variants import VariantSweep

        VariantSweep(bench, args.budget_s).run([g for g in groups if g in ("decode", "prefill")])
        groups = [g for g in groups if g not in ("decode", "prefill")]
    for g in ("decode", "prefill", "elementwise"):
        if g in groups:
            t0 = time.time()
            getattr(bench, g)()
            print(f"  [{g} took {time.time() - t0:.0f} s]", flush=True)
    bench.summary()
    int4_rc = 0
    if "int4" in groups:  # the int4 table: the int4 GEMM vs bf16 cuBLAS, from `bench quant`'s code
        from paged_backend.benchmarks import quant as bench_quant

        quant_args = ["--only", "int4"] + (["--json", args.json + ".int4.json"] if args.json else [])
        int4_rc = bench_quant.run(bench_quant.build_parser().parse_args(quant_args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "failures": bench.failures,
                       "rows": [asdict(r) for r in bench.rows]}, f, indent=1)
    return 1 if bench.failures or int4_rc else 0


if __name__ == "__main__":
    raise SystemExit(main())
