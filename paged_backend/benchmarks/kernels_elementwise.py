"""``bench kernels``' bandwidth-bound groups: the ceilings (device copy, bf16 GEMM) and the
elementwise kernels (RMSNorm, SiLU-and-mul, rotary, cache write) against the copy bandwidth.
"""

from __future__ import annotations

from paged_backend.benchmarks.kernel_bench import Bench
from paged_backend.benchmarks.results import Row
from paged_backend.benchmarks.timing import GIB

# -- ceilings -----------------------------------------------------------------------------


def ceilings(bench: Bench) -> None:
    """Device copy bandwidth (what the elementwise kernels are judged against) and a bf16 GEMM."""
    _copy(bench)
    _gemm(bench)


def _copy(bench: Bench) -> None:
    torch = bench.torch
    n = GIB
    src = torch.randn(n, dtype=torch.bfloat16, device=bench.dev)
    dst = torch.empty_like(src)
    ms = bench.time_ms(lambda: dst.copy_(src))
    bench.copy_bw = 2 * n * 2 / (ms * 1e-3)
    bench.add(Row("ceilings", "device copy 2 GiB (read + write)", ms, "GB/s", bench.copy_bw / 1e9))


def _gemm(bench: Bench) -> None:
    torch = bench.torch
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=bench.dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=bench.dev)
    ms = bench.time_ms(lambda: a @ b)
    bench.add(Row("ceilings", "bf16 GEMM 8192^3", ms, "TFLOP/s", 2 * 8192**3 / (ms * 1e-3) / 1e12))


# -- elementwise --------------------------------------------------------------------------


def elementwise(bench: Bench) -> None:
    _rms_norm(bench)
    _silu(bench)
    _rotary(bench)
    _cache_write(bench)


def _report_bw(bench: Bench, name: str, ms: float, nbytes: float, ref_ms: float | None = None) -> None:
    bw = nbytes / (ms * 1e-3)
    extra = f" torch ref {ref_ms:.3f} ms" if ref_ms is not None else ""
    bench.add(Row("elementwise", name, ms, "GB/s", bw / 1e9,
                  f"{100 * bw / bench.copy_bw:5.1f}% of copy (>= 70%){extra}", bw >= 0.7 * bench.copy_bw))


def _rms_norm(bench: Bench) -> None:
    torch = bench.torch
    from paged_backend.kernels.rms_norm import rms_norm
    from paged_backend.kernels.rms_norm_ref import rms_norm_ref

    t, hid = bench.args.tokens, bench.args.hidden

    def inputs():
        return (torch.randn((t, hid), dtype=torch.bfloat16, device=bench.dev),
                torch.randn((t, hid), dtype=torch.bfloat16, device=bench.dev))

    w = torch.randn((hid,), dtype=torch.bfloat16, device=bench.dev)
    x, r = inputs()
    if not bench.args.no_check:
        bench.check("rms_norm+residual", rms_norm(x, w, 1e-5, r)[0], rms_norm_ref(x, w, 1e-5, r)[0], 1e-2)

    def make(residual):
        def one(i):
            xi, ri = inputs()
            return (lambda: rms_norm(xi, w, 1e-5, ri)) if residual else (lambda: rms_norm(xi, w, 1e-5))
        return one

    _report_bw(bench, f"rms_norm {t}x{hid} +residual", bench.time_sets_ms(make(True), 4 * t * hid * 2),
               4 * t * hid * 2, bench.time_ms(lambda: rms_norm_ref(x, w, 1e-5, r)))
    _report_bw(bench, f"rms_norm {t}x{hid}", bench.time_sets_ms(make(False), 2 * t * hid * 2), 2 * t * hid * 2)


def _silu(bench: Bench) -> None:
    torch = bench.torch
    from paged_backend.kernels.activation import silu_and_mul
    from paged_backend.kernels.activation_ref import silu_and_mul_ref

    t, hid = bench.args.tokens, bench.args.hidden
    x = torch.randn((t, 2 * hid), dtype=torch.bfloat16, device=bench.dev)
    if not bench.args.no_check:
        bench.check("silu_and_mul", silu_and_mul(x), silu_and_mul_ref(x), 1e-2)

    def make(i):
        xi = torch.randn((t, 2 * hid), dtype=torch.bfloat16, device=bench.dev)
        return lambda: silu_and_mul(xi)

    nbytes = 3 * t * hid * 2
    _report_bw(bench, f"silu_and_mul {t}x2*{hid}", bench.time_sets_ms(make, nbytes), nbytes,
               bench.time_ms(lambda: silu_and_mul_ref(x)))


def _rotary(bench: Bench) -> None:
    torch = bench.torch
    from paged_backend.kernels.paged_attention import LOG2E
    from paged_backend.kernels.rotary import rotary
    from paged_backend.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_ref

    a = bench.args
    t, d = a.tokens, a.head_dim
    h = a.hidden // d
    table = rope_cos_sin_cache(rope_inv_freq(d, 500000.0), 8192).to(bench.dev)

    def inputs():
        return (torch.randn((t, h, d), dtype=torch.bfloat16, device=bench.dev),
                torch.randn((t, a.kv_heads, d), dtype=torch.bfloat16, device=bench.dev),
                torch.randint(0, 8192, (t,), device=bench.dev))

    q, k, pos = inputs()
    # prefill steps: q also takes the attention kernel's scale (the launcher's pass over q it replaces)
    qs = d**-0.5 * LOG2E
    if not a.no_check:
        bench.check("rotary q", rotary(pos, q, k, table)[0], rotary_ref(pos, q, k, table)[0], 1e-2)
        bench.check("rotary q scaled", rotary(pos, q, k, table, qs)[0], rotary_ref(pos, q, k, table, qs)[0], 1e-2)

    def make(scale):
        def one(i):
            qi, ki, pi = inputs()
            return lambda: rotary(pi, qi, ki, table, scale)
        return one

    nbytes = 2 * (q.numel() + k.numel()) * 2 + t * (d * 4 + 8)
    name = f"rotary {t}x({h}+{a.kv_heads})x{d}"
    _report_bw(bench, name, bench.time_sets_ms(make(None), nbytes), nbytes,
               bench.time_ms(lambda: rotary_ref(pos, q, k, table)))
    _report_bw(bench, f"{name}, q scaled", bench.time_sets_ms(make(qs), nbytes), nbytes)

    def mul(i):
        qi = torch.randn((t, h, d), dtype=torch.bfloat16, device=bench.dev)
        return lambda: torch.mul(qi, qs)

    ms = bench.time_sets_ms(mul, 2 * q.numel() * 2)
    bench.add(Row("elementwise", f"q x scale {t}x{h}x{d} (torch.mul)", ms, "GB/s",
                  2 * q.numel() * 2 / (ms * 1e-3) / 1e9, "the attention launcher's pass the fold replaces"))


def _cache_write(bench: Bench) -> None:
    torch = bench.torch
    from paged_backend.kernels.cache_write import write_kv_cache
    from paged_backend.kernels.cache_write_ref import FP8_DTYPE, write_kv_cache_ref

    a = bench.args
    t, d, bs = a.tokens, a.head_dim, a.block_size
    h = a.hidden // d
    key = torch.randn((t, h, d), dtype=torch.bfloat16, device=bench.dev)
    val = torch.randn((t, h, d), dtype=torch.bfloat16, device=bench.dev)
    slots = torch.randperm(t, device=bench.dev)
    s = torch.tensor(0.5, device=bench.dev)
    for cdt, name in ((torch.bfloat16, "bf16"), (FP8_DTYPE, "fp8")):
        cache = torch.zeros((2, t // bs, bs, h, d), dtype=cdt, device=bench.dev)
        if not a.no_check:
            ref = cache.clone()
            write_kv_cache(key, val, cache, slots, s, s)
            write_kv_cache_ref(key, val, ref, slots, s, s)
            same = torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
            print(f"  check cache_write {name:<40} bit-exact {'ok' if same else 'FAIL'}", flush=True)
            if not same:
                bench.failures.append(f"cache_write {name}")
        nbytes = 2 * key.numel() * 2 + 2 * key.numel() * cache.element_size() + t * 8

        def make(i, cache=cache):
            ki, vi, ci = torch.randn_like(key), torch.randn_like(val), torch.zeros_like(cache)
            si = torch.randperm(t, device=bench.dev)
            return lambda: write_kv_cache(ki, vi, ci, si, s, s)

        _report_bw(bench, f"cache_write {t}x{h}x{d} K+V -> {name}", bench.time_sets_ms(make, nbytes), nbytes)
