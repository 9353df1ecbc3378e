"""``bench kernels``' attention groups: the decode grid (batch x context, bf16 and fp8 KV, with
``--sweep`` split counts and tile configs) and causal prefill against SDPA.
"""

from __future__ import annotations

import math

from paged_backend.benchmarks.kernel_bench import Bench
from paged_backend.benchmarks.results import Row, parse_ints
from paged_backend.benchmarks.timing import GIB, copies_to_touch

SWEEP_SPLITS = {(1, 32768), (8, 4096), (8, 32768)}  # decode cells where --sweep times split counts
SWEEP_TILES = {(64, 4096)}  # ... and tile configs
SWEEP_PREFILL = {8192}
PREFILL_SWEEP_CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
                         (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4), (256, 64, 8, 2)]


# -- decode -------------------------------------------------------------------------------


def decode(bench: Bench) -> None:
    """The decode grid, bf16 then fp8 KV (fp8 speed-ups are against bf16's times)."""
    torch = bench.torch
    a = bench.args
    batches, contexts = parse_ints(a.batches), parse_ints(a.contexts)
    max_blocks = max(b * math.ceil(c / a.block_size) for b in batches for c in contexts)
    results: dict[tuple[str, int, int], float] = {}
    for kind in ("bf16", "fp8"):
        cache = bench.kv_cache(max_blocks + 1, kind == "fp8")
        g = torch.Generator(device=bench.dev).manual_seed(0)
        perm = torch.randperm(max_blocks, device=bench.dev, generator=g) + 1
        if not a.no_check:
            _decode_checks(bench, kind, cache, perm, batches, contexts, max_blocks)
        for b in batches:
            for c in contexts:
                _decode_cell(bench, kind, b, c, cache, perm, results)
        del cache
        torch.cuda.empty_cache()


def _decode_checks(bench: Bench, kind: str, cache, perm, batches, contexts, max_blocks: int) -> None:
    from paged_backend.kernels.paged_attention import paged_attention
    from paged_backend.kernels.paged_attention_ref import paged_attention_ref

    a = bench.args
    one = bench.torch.ones((), device=bench.dev)
    cells = [(b, c) for b, c in ((8, 4096), (1, 32768), (3, 1000))
             if b * math.ceil(c / a.block_size) <= max_blocks] or [(batches[-1], contexts[-1])]
    for b, c in cells:
        q, bt, sl, qsl = bench.decode_inputs(b, c, perm)
        out = paged_attention(q, cache, bt, sl, qsl, a.head_dim**-0.5, one, one, max_query_len=1, max_seq_len=c)
        ref = paged_attention_ref(q, cache, bt, sl, qsl, a.head_dim**-0.5, one, one)
        bench.check(f"decode {kind} batch {b} ctx {c}", out, ref, 1e-2)


def _decode_cell(bench: Bench, kind: str, b: int, c: int, cache, perm, results: dict) -> None:
    from paged_backend.kernels.paged_attention import paged_attention

    a = bench.args
    fp8 = kind == "fp8"
    one = bench.torch.ones((), device=bench.dev)
    kv_bytes = b * c * a.kv_heads * a.head_dim * 2 * cache.element_size()
    # rotate over disjoint copies until ~1 GB is touched per graph replay (L2 is 50 MB)
    copies = max(1, min(copies_to_touch(kv_bytes, GIB, 16), len(perm) // (b * math.ceil(c / a.block_size))))
    inputs = [bench.decode_inputs(b, c, perm, i) for i in range(copies)]
    io_bytes = 2 * inputs[0][0].numel() * inputs[0][0].element_size()

    def run(ns=None, cfg=None):
        return bench.time_graph_ms([
            lambda x=x: paged_attention(x[0], cache, x[1], x[2], x[3], a.head_dim**-0.5, one, one, max_query_len=1,
                                        max_seq_len=c, num_splits=ns, config=cfg)
            for x in inputs])

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
    bench.add(Row("decode", f"{kind} batch {b:>3} ctx {c:>5}", ms, "GB/s", bw / 1e9,
                  f"{100 * bw / a.peak_bw:5.1f}% {target}{l2}", ok,
                  {"batch": b, "ctx": c, "kv": kind, "copies": copies}))
    if a.sweep:
        _decode_sweep(bench, b, c, cache.element_size(), ms, run)


def _decode_sweep(bench: Bench, b: int, c: int, kv_elem: int, auto_ms: float, run) -> None:
    """``--sweep`` at one decode cell: split counts, then tile / warp / stage configs."""
    from paged_backend.kernels.paged_attention import AttentionConfig, pick_config

    a = bench.args
    best = (auto_ms, "auto")
    for ns in (1, 2, 4, 8, 16, 32, 64) if (b, c) in SWEEP_SPLITS else ():
        if ns <= max(1, c // 256):
            t = run(ns)
            print(f"    splits={ns}: {t:.4f} ms", flush=True)
            best = min(best, (t, f"splits={ns}"))
    base = pick_config(1, a.heads // a.kv_heads, a.head_dim, kv_elem)
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
        print(f"    sweep best: {best[1]} {best[0]:.4f} ms (auto {auto_ms:.4f})", flush=True)


# -- prefill ------------------------------------------------------------------------------


def prefill(bench: Bench) -> None:
    for n in parse_ints(bench.args.prefill_lens):
        _prefill_one(bench, n)
        bench.torch.cuda.empty_cache()


class PrefillCase:
    """One causal request of ``n`` tokens (pages shuffled by ``seed``): our kernel's calls (q as
    the engine hands it, and unscaled) and SDPA's on contiguous [1, H, N, D] tensors (K/V expanded
    to all heads, or GQA-native)."""

    def __init__(self, bench: Bench, n: int, seed: int = 1) -> None:
        torch = bench.torch
        from paged_backend.kernels.paged_attention import query_prescale

        a = bench.args
        self.n, self.scale = n, a.head_dim**-0.5
        self.one = torch.ones((), device=bench.dev)
        self.q, k, v, self.cache, self.bt, self.sl, self.qsl = bench.prefill_inputs(n, seed)
        g = a.heads // a.kv_heads
        self.qc = self.q.transpose(0, 1)[None].contiguous()
        self.kc = k.transpose(0, 1)[None].repeat_interleave(g, dim=1).contiguous()
        self.vc = v.transpose(0, 1)[None].repeat_interleave(g, dim=1).contiguous()
        self.kg = k.transpose(0, 1)[None].contiguous()
        self.vg = v.transpose(0, 1)[None].contiguous()
        # the engine's layers hand prefill attention q with the scale folded in by the rotary kernel
        self.factor = query_prescale(self.q, self.cache, self.scale, n, n)
        self.q_eng = self.q if self.factor is None else torch.mul(self.q, self.factor)
        self.flops = 4 * a.heads * a.head_dim * n * (n + 1) / 2  # causal: QK^T and PV over the lower triangle

    def ours(self, cfg=None, q=None, cache=None):
        from paged_backend.kernels.paged_attention import paged_attention

        return paged_attention(self.q_eng if q is None else q, self.cache if cache is None else cache, self.bt,
                               self.sl, self.qsl, self.scale, self.one, self.one, max_query_len=self.n,
                               max_seq_len=self.n, config=cfg, q_scaled=self.factor is not None)

    def ours_unscaled(self, cfg=None, compile_only: bool = False):
        """Our kernel on q as it is (the launcher folds the scale in where the config says so)."""
        from paged_backend.kernels.paged_attention import paged_attention

        return paged_attention(self.q, self.cache, self.bt, self.sl, self.qsl, self.scale, self.one, self.one,
                               max_query_len=self.n, max_seq_len=self.n, config=cfg, compile_only=compile_only)

    def sdpa(self, gqa: bool = False, q=None, k=None, v=None):
        import torch.nn.functional as F

        k = k if k is not None else (self.kg if gqa else self.kc)
        v = v if v is not None else (self.vg if gqa else self.vc)
        kw = {"enable_gqa": True} if gqa else {}
        return F.scaled_dot_product_attention(self.qc if q is None else q, k, v, is_causal=True, scale=self.scale,
                                              **kw)

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12


def _prefill_one(bench: Bench, n: int) -> None:
    p = PrefillCase(bench, n)
    if not bench.args.no_check:
        ref = p.sdpa()[0].transpose(0, 1)
        bench.check(f"prefill {n} vs SDPA", p.ours(), ref, 1e-2)
        bench.check(f"prefill {n} q unscaled vs SDPA", p.ours_unscaled(), ref, 1e-2)
    t_sdpa = bench.time_ms(p.sdpa)
    try:
        t_gqa = bench.time_ms(lambda: p.sdpa(gqa=True))
    except Exception:  # older torch: no enable_gqa
        t_gqa = float("inf")
    t_ref = min(t_sdpa, t_gqa)
    bench.add(Row("prefill", f"SDPA causal {n} tokens (best of MHA/GQA)", t_ref, "TFLOP/s", p.tflops(t_ref),
                  extra={"mha_ms": t_sdpa, "gqa_ms": t_gqa}))
    ms = bench.time_ms(p.ours)
    bench.add(Row("prefill", f"paged causal {n} tokens", ms, "TFLOP/s", p.tflops(ms),
                  f"x{t_ref / ms:.2f} of SDPA (do_bench)", None, {"tokens": n, "q_scaled": p.factor is not None}))
    ms_u = bench.time_ms(p.ours_unscaled)
    bench.add(Row("prefill", f"paged causal {n} tokens, q unscaled", ms_u, "TFLOP/s", p.tflops(ms_u),
                  f"x{t_ref / ms_u:.2f} of SDPA (launcher folds the scale)", None, {"tokens": n}))
    _prefill_graphs(bench, p, gqa=t_gqa < t_sdpa)
    if bench.args.sweep and n in SWEEP_PREFILL:
        _prefill_sweep(bench, p, ms)


def _prefill_graphs(bench: Bench, p: PrefillCase, gqa: bool) -> None:
    """The verdict: SDPA's faster form and ours as CUDA-graph replays over rotating copies of
    their inputs, no host launch time in either (do_bench's runs wait on a slow launch: our 2k
    call read 0.10-0.17 ms there across runs, 0.097 ms here)."""
    kx, vx = (p.kg, p.vg) if gqa else (p.kc, p.vc)
    per_call = (p.qc.numel() + 2 * kx.numel() + p.qc.numel()) * 2

    def sdpa_set(i):
        qi, ki, vi = p.qc.clone(), kx.clone(), vx.clone()
        return lambda: p.sdpa(gqa, qi, ki, vi)

    def ours_set(i):
        qi, ci = p.q_eng.clone(), p.cache.clone()
        return lambda: p.ours(q=qi, cache=ci)

    g_ref, g_ours = bench.time_sets_ms(sdpa_set, per_call), bench.time_sets_ms(ours_set, per_call)
    bench.add(Row("prefill", f"SDPA causal {p.n} tokens, graph", g_ref, "TFLOP/s", p.tflops(g_ref),
                  "CUDA-graph replays, rotating inputs"))
    bench.add(Row("prefill", f"paged causal {p.n} tokens, graph", g_ours, "TFLOP/s", p.tflops(g_ours),
                  f"x{g_ref / g_ours:.2f} of SDPA (>= 0.8)", g_ref / g_ours >= 0.8, {"tokens": p.n}))


def _prefill_sweep(bench: Bench, p: PrefillCase, auto_ms: float) -> None:
    """``--sweep``: prefill tile / warp / stage configs (do_bench)."""
    from paged_backend.kernels.paged_attention import AttentionConfig

    best = (auto_ms, "auto")
    for bm, tn, nw, st in PREFILL_SWEEP_CONFIGS:
        cfg = AttentionConfig(bm, tn, nw, st)
        try:
            t = bench.time_ms(lambda cfg=cfg: p.ours(cfg))
        except Exception as e:
            print(f"    {cfg}: {type(e).__name__}", flush=True)
            continue
        print(f"    {cfg}: {t:.4f} ms ({p.tflops(t):.0f} TFLOP/s)", flush=True)
        best = min(best, (t, str(cfg)))
    print(f"    sweep best: {best[1]} {best[0]:.4f} ms (auto {auto_ms:.4f})", flush=True)
