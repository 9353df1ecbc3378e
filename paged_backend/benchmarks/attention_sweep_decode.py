"""The decode jobs of ``bench kernels --variants``: at one batch x context cell, every decode
variant for bf16 and then fp8 KV, checked, timed as interleaved CUDA-graph replays, one table each.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

from paged_backend.benchmarks.attention_variants import DECODE_VARIANTS, Variant, selected
from paged_backend.benchmarks.results import rel_err
from paged_backend.benchmarks.timing import GIB, copies_to_touch, time_graphs_round_robin

REF_SEQS = 8  # decode checks run the reference on this many requests of the timed batch


def decode_job(sweep, b: int, c: int, results: dict) -> None:
    """One decode cell: bf16 variants, then fp8 variants (their speed-up is against bf16's default)."""
    for kind in ("bf16", "fp8"):
        if sweep.left() <= 0:
            sweep.say(f"  [budget] skipped decode {kind} {b}x{c}")
            continue
        _decode_kind(sweep, kind, b, c, results)
        sweep.torch.cuda.empty_cache()


class _DecodeCell:
    """The inputs of one (KV dtype, batch, context) cell: a cache holding ``copies`` disjoint
    batches (~1 GB of K/V per replay), their queries and block tables, and the reference output
    of the first ``REF_SEQS`` requests of the first batch."""

    def __init__(self, sweep, kind: str, b: int, c: int) -> None:
        from paged_backend.kernels.paged_attention import device_sms
        from paged_backend.kernels.paged_attention_ref import paged_attention_ref

        torch, dev, a = sweep.torch, sweep.dev, sweep.args
        self.kind, self.b, self.c, self.fp8 = kind, b, c, kind == "fp8"
        self.hkv, self.scale, self.sms = a.kv_heads, a.head_dim**-0.5, device_sms(dev)
        self.elem = 1 if self.fp8 else 2
        nblk = math.ceil(c / a.block_size)
        self.kv_bytes = b * c * a.kv_heads * a.head_dim * 2 * self.elem
        self.copies = copies_to_touch(self.kv_bytes, GIB, 16)
        self.cache = sweep.bench.kv_cache(self.copies * b * nblk + 1, self.fp8)
        g = torch.Generator(device=dev).manual_seed(b * 1000 + c)
        perm = (torch.randperm(self.copies * b * nblk, device=dev, generator=g) + 1).to(torch.int32)
        self.sl = torch.full((b,), c, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.inputs = [(torch.randn((b, a.heads, a.head_dim), dtype=torch.bfloat16, device=dev),
                        perm[i * b * nblk : (i + 1) * b * nblk].view(b, nblk)) for i in range(self.copies)]
        self.io_bytes = 2 * self.inputs[0][0].numel() * 2
        self.ks = torch.tensor(0.5, device=dev) if self.fp8 else sweep.one
        self.vs = torch.tensor(2.0, device=dev) if self.fp8 else sweep.one
        self.n = n = min(b, REF_SEQS)
        q0, bt0 = self.inputs[0]
        self.ref = paged_attention_ref(q0[:n], self.cache, bt0[:n], self.sl[:n], self.qsl[: n + 1], self.scale,
                                       self.ks, self.vs)

    def call(self, x, cfg, ns, compile_only: bool = False):
        from paged_backend.kernels.paged_attention import paged_attention

        return paged_attention(x[0], self.cache, x[1], self.sl, self.qsl, self.scale, self.ks, self.vs,
                               max_query_len=1, max_seq_len=self.c, num_splits=ns, config=cfg,
                               compile_only=compile_only)

    def error(self, cfg, ns) -> float:
        """Relative error of a variant's output on the first batch's reference requests."""
        return rel_err(self.call(self.inputs[0], cfg, ns)[: self.n], self.ref)

    def splits(self, cfg) -> int:
        """The launcher's split count for ``cfg`` at this cell."""
        from paged_backend.kernels.paged_attention import pick_num_splits

        return pick_num_splits(self.b * self.hkv, self.c, cfg.tile_n, self.sms, cfg.programs_per_sm)


def _resolve(sweep, v: Variant, cell: _DecodeCell):
    """(config or None, num_splits or None) of a decode variant at one cell; None if it adds nothing."""
    from paged_backend.kernels.paged_attention import pick_config

    a, c = sweep.args, cell.c
    if v.name == "default":
        return None, None
    cfg = replace(pick_config(1, a.heads // a.kv_heads, a.head_dim, cell.elem, baseline=True), **v.cfg)
    auto = cell.splits(cfg)
    if v.splits.isdigit():  # a fixed count, if every split keeps a KV tile
        return (cfg, int(v.splits)) if int(v.splits) * cfg.tile_n <= c else None
    if v.splits == "x2":
        more = min(2 * auto, max(1, c // (2 * cfg.tile_n)))  # keep >= 2 KV tiles per split
        return (cfg, more) if more > auto else None
    if v.splits == "/2":
        return (cfg, auto // 2) if auto > 1 else None
    return cfg, None


def _decode_kind(sweep, kind: str, b: int, c: int, results: dict) -> None:
    from paged_backend.kernels.paged_attention import pick_config

    a = sweep.args
    cell = _DecodeCell(sweep, kind, b, c)
    variants = []
    for v in selected(DECODE_VARIANTS, a.variant_names):
        if kind in v.kinds:
            r = _resolve(sweep, v, cell)
            if r is not None:
                variants.append((v, *r))
    ok_variants = sweep.checked(variants, lambda it: cell.call(cell.inputs[0], it[1], it[2], compile_only=True),
                                lambda it: cell.error(it[1], it[2]), lambda it: f"{kind} {it[0].name}")
    times = time_graphs_round_robin(
        [[lambda x=x, cfg=cfg, ns=ns: cell.call(x, cfg, ns) for x in cell.inputs] for (_, cfg, ns), _ in ok_variants],
        capture_more=lambda: sweep.left() > 0)
    base = pick_config(1, a.heads // a.kv_heads, a.head_dim, cell.elem)  # what 'default' runs
    sweep.say(f"\n== decode {kind} batch {b} x ctx {c}: KV {cell.kv_bytes / 1e6:.0f} MB, {cell.copies} copies per "
              f"replay, default splits {cell.splits(base)}")
    sweep.say(f"  {'variant':<20} {'splits':>6} {'tile/warps/stages':>17} {'ms':>8} {'GB/s':>6} {'%peak':>6} "
              f"{'vs dflt':>7} {'vs bf16':>7}  check (rel err, before / after timing)")
    best = None
    for ((v, cfg, ns), err), ms in zip(ok_variants, times, strict=True):
        if ms is None:
            continue
        row = _table_row(sweep, cell, v, cfg, base, ns, err, ms, results)
        if row["ok"] and (best is None or ms < best[1]):
            best = (v.name, ms, row["bw"], row["vs_bf16"])
    if best is not None:
        _summarize(sweep, cell, best, results)


def _table_row(sweep, cell: _DecodeCell, v: Variant, cfg, base, ns, err: float, ms: float, results: dict) -> dict:
    """Prints and records one variant's line: its speed against the peak, the default and bf16's
    default, and its check before and after timing (``cfg`` None: the default, ``base``)."""
    a, kind, b, c = sweep.args, cell.kind, cell.b, cell.c
    err2 = cell.error(cfg, ns)
    cfg = cfg or base
    splits = ns or cell.splits(cfg)
    bw = (cell.kv_bytes + cell.io_bytes) / (ms * 1e-3)
    if v.name == "default":
        results[(kind, b, c)] = ms
    default_ms, bf16_default = results.get((kind, b, c)), results.get(("bf16", b, c))
    vs_default = default_ms / ms if default_ms else float("nan")
    vs_bf16 = bf16_default / ms if (cell.fp8 and bf16_default) else float("nan")
    ok = err < 1e-2 and err2 < 1e-2
    if not ok:
        sweep.bench.failures.append(f"decode variant {kind} {v.name} {b}x{c}")
    shape = f"{cfg.tile_n}/{cfg.num_warps}/{cfg.num_stages}"
    sweep.say(f"  {v.name:<20} {splits:>6} {shape:>17} {ms:8.4f} {bw / 1e9:6.0f} "
              f"{100 * bw / a.peak_bw:5.1f}% {vs_default:6.3f}x {vs_bf16:6.2f}x  "
              f"{'ok' if ok else 'FAIL'} {err:.1e} / {err2:.1e}")
    sweep.record("decode-variant", f"{kind} {b}x{c} {v.name}", ms, "GB/s", bw / 1e9, ok, kind=kind, batch=b, ctx=c,
                 variant=v.name, splits=splits, config=asdict(cfg), vs_default=vs_default, vs_bf16=vs_bf16,
                 pct_peak=100 * bw / a.peak_bw, err=err, err_after=err2)
    return {"ok": ok, "bw": bw, "vs_bf16": vs_bf16}


def _summarize(sweep, cell: _DecodeCell, best: tuple, results: dict) -> None:
    """The job's summary line: the best checked variant against the minimums."""
    name, ms, bw, vs_bf16 = best
    kind, b, c = cell.kind, cell.b, cell.c
    results[(f"{kind} best", b, c)] = ms
    if cell.fp8:
        bf16_best = results.get(("bf16 best", b, c))
        vs_best = f", x{bf16_best / ms:.2f} vs the best bf16 variant" if bf16_best else ""
        target = f"x{vs_bf16:.2f} vs bf16 default{vs_best} (>= 1.6 at ctx >= 4k)"
    else:
        target = f"{100 * bw / sweep.args.peak_bw:.1f}% of peak (>= 80% at batch >= 8, ctx >= 4k)"
    sweep.summary_lines.append(f"decode {kind} {b}x{c}: best '{name}' {ms:.4f} ms, {target}")
