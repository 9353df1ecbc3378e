"""The prefill jobs of ``bench kernels --variants``: one causal request of n tokens, every
prefill variant checked against SDPA and timed with ``triton.testing.do_bench`` (best of two
interleaved rounds), one table.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from paged_backend.benchmarks.attention_variants import PREFILL_VARIANTS, selected
from paged_backend.benchmarks.kernels_attention import PrefillCase
from paged_backend.benchmarks.results import rel_err
from paged_backend.benchmarks.timing import do_bench_ms


def prefill_job(sweep, n: int) -> None:
    from paged_backend.kernels.paged_attention import pick_config

    a = sweep.args
    group = a.heads // a.kv_heads
    p = PrefillCase(sweep.bench, n, seed=n)
    ref = p.sdpa()[0].transpose(0, 1)
    rep = min(a.rep, 100)

    def bench_ms(fn) -> float:
        return do_bench_ms(fn, rep, warmup=10)

    t_sdpa = bench_ms(p.sdpa)
    try:
        t_sdpa = min(t_sdpa, bench_ms(lambda: p.sdpa(gqa=True)))
    except Exception:  # older torch: no enable_gqa
        pass
    base = pick_config(n, group, a.head_dim, baseline=True)  # variants override the untuned baseline
    variants = [(vr, None if vr.name == "default" else replace(base, **vr.cfg))
                for vr in selected(PREFILL_VARIANTS, a.variant_names)]
    checked = [(vr, cfg, err, []) for (vr, cfg), err in sweep.checked(
        variants, lambda it: p.ours_unscaled(it[1], compile_only=True), lambda it: rel_err(p.ours_unscaled(it[1]), ref),
        lambda it: f"prefill {it[0].name}")]
    for _ in range(2):  # two interleaved rounds, best median counts
        for _vr, cfg, _err, ts in checked:
            if sweep.left() > 0:
                ts.append(bench_ms(lambda cfg=cfg: p.ours_unscaled(cfg)))
    _report(sweep, p, checked, t_sdpa, ref)


def _report(sweep, p: PrefillCase, checked: list, t_sdpa: float, ref) -> None:
    """The job's table (each variant checked once more after timing) and its summary line."""
    from paged_backend.kernels.paged_attention import pick_config

    a, n = sweep.args, p.n
    sweep.say(f"\n== prefill causal {n} tokens: SDPA {t_sdpa:.4f} ms ({p.tflops(t_sdpa):.0f} "
              f"TFLOP/s, best of MHA-expanded / enable_gqa)")
    sweep.say(f"  {'variant':<32} {'m/tile/warps/stages':>19} {'ms':>8} {'TFLOP/s':>7} {'vs SDPA':>7} "
              f"{'vs dflt':>7}  check (rel err vs SDPA, before / after)")
    default_ms, best = None, None
    for vr, cfg, err, ts in checked:
        if not ts:
            continue
        ms = min(ts)
        default_ms = ms if vr.name == "default" else default_ms
        err2 = rel_err(p.ours_unscaled(cfg), ref)
        ok = err < 1e-2 and err2 < 1e-2
        if not ok:
            sweep.bench.failures.append(f"prefill variant {vr.name} {n}")
        c = cfg or pick_config(n, a.heads // a.kv_heads, a.head_dim)  # the launcher's pick for 'default'
        ratio = t_sdpa / ms
        vs_default = default_ms / ms if default_ms else float("nan")
        sweep.say(f"  {vr.name:<32} {f'{c.block_m}/{c.tile_n}/{c.num_warps}/{c.num_stages}':>19} {ms:8.4f} "
                  f"{p.tflops(ms):7.0f} {ratio:6.2f}x {vs_default:6.3f}x  "
                  f"{'ok' if ok else 'FAIL'} {err:.1e} / {err2:.1e}")
        sweep.record("prefill-variant", f"{n} {vr.name}", ms, "TFLOP/s", p.tflops(ms), ok, tokens=n,
                     variant=vr.name, config=asdict(c), vs_sdpa=ratio, sdpa_ms=t_sdpa, vs_default=vs_default,
                     err=err, err_after=err2)
        if ok and (best is None or ms < best[1]):
            best = (vr.name, ms, ratio)
    if best is not None:
        sweep.summary_lines.append(f"prefill {n}: best '{best[0]}' {best[1]:.4f} ms, x{best[2]:.2f} of SDPA "
                                   f"(>= 0.8)")
