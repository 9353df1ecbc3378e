"""``paged-backend bench peer``: vLLM's kernels beside ours, same cells, same process, same timing (CUDA).

The minimums the kernels are held to (docs/BENCHMARKS.md, "Kernels" and "Quantized weights")
are ratios against the copy bandwidth, SDPA and cuBLAS. This puts the kernels vLLM runs for the
same jobs on this GPU next to ours, measured the same way, so a minimum our kernel misses can
be read against what the best-known kernel reaches::

    decode   paged attention, one query token per request (32 q / 8 KV heads, head_dim 128, block
             size 16, the grid of ``bench kernels``): ours and FlashAttention-3 as vLLM's FLASH_ATTN
             backend calls it under CUDA graphs (AOT scheduler metadata, at most 32 splits); bf16
             and fp8 KV (for an fp8 cache vLLM quantizes q to e4m3 first: that op is not timed)
    prefill  one causal request of 2k / 8k tokens: ours (q pre-scaled as the engine's rotary
             kernel writes it), FA3 varlen on contiguous K/V, and SDPA
    int4     W4A16 GEMM, group 128, M x (K x N) as ``bench quant``: ours, Machete (vLLM's kernel
             for GPTQ / compressed-tensors W4A16 on Hopper) and GPTQ-Marlin (both symmetric uint4b8,
             what sym GPTQ checkpoints hold), and bf16 cuBLAS
    moe      the routed experts of one MoE layer, bf16, E experts top-k, expert intermediate N,
             hidden H (``--moe-shapes E x N x H x k``; Qwen3-30B-A3B's and DeepSeek-V2-Lite's by
             default) at M tokens: ours (``fused_moe``, this device's tuned table where one
             exists) and vLLM's ``fused_experts`` (its Triton kernel with its own tables), on the
             same softmax top-k routing; the weight bandwidth counts the experts the batch touches
    mla      latent-attention decode (``peer_mla.py``): ours beside vLLM's FlashMLA, FA3-MLA and
             Triton-MLA kernels
    fp8      the block-scaled FP8 linear (``peer_fp8.py``): ours beside vLLM's Triton and CUTLASS ones

Every kernel is checked against a torch reference before it is timed (attention:
``paged_attention_ref``, for fp8 on the e4m3-rounded q FA3 gets; int4: x times the kernel's
own dequantized weight), then timed as CUDA-graph replays of back-to-back calls over rotating
inputs (disjoint block tables, input or weight copies: L2 cannot serve a rerun, no host launch
time). Needs vLLM importable in the same environment: ``pip install vllm==0.26.*`` (built for
torch 2.11 / cu130), or a directory holding its unpacked wheels on ``PYTHONPATH``
(``scripts/bench_peer.sh`` can unpack a tarball of them).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from paged_backend.benchmarks import peer_fp8, peer_mla
from paged_backend.benchmarks.kernel_bench import Bench, add_attention_grid_args
from paged_backend.benchmarks.results import Row, parse_ints, run_header
from paged_backend.benchmarks.timing import GIB, copies_to_touch

GROUPS = ("decode", "prefill", "int4", "moe", "mla", "fp8")
PEER_TOL = 2e-2  # relative error against the reference
PEER_TOL_FP8 = 5e-2  # FA3 with fp8 KV also rounds P to e4m3 for the PV product (~2.4e-2 measured)


def build_parser(prog: str = "paged-backend bench peer") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", nargs="+", choices=GROUPS, default=None)
    add_attention_grid_args(p)
    p.add_argument("--m", default="1,16,64,256", help="int4: activation rows")
    p.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096", help="int4: K x N")
    p.add_argument("--moe-shapes", default="128x768x2048x8,64x1408x2048x6",
                   help="moe: E x N x H x top-k (experts, expert intermediate, hidden, experts per token)")
    p.add_argument("--moe-m", default="1,16,64,256,4096", help="moe: tokens per call")
    p.add_argument("--replays", type=int, default=20)
    peer_mla.add_arguments(p)
    peer_fp8.add_arguments(p)


def add_peer_parser(sub) -> None:
    """Registers ``bench peer`` on the ``paged-backend bench`` subparsers."""
    p = sub.add_parser("peer", help="vLLM's attention, int4 and MoE kernels beside ours (CUDA, vLLM importable)")
    add_arguments(p)
    p.set_defaults(func=lambda args: run(args))


class PeerBench(Bench):
    """``Bench``'s inputs, checks and graph timing, with vLLM's kernels timed beside ours."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.pairs: list[tuple[str, float, float, str]] = []  # (cell, ours ms, peer ms, peer name)

    def pair(self, cell: str, ours: float, peer: float, peer_name: str) -> None:
        """Records ours beside the peer's best (ms each) for the closing table."""
        self.pairs.append((cell, ours, peer, peer_name))
        print(f"    {cell}: ours {ours * 1e3:.1f} us, {peer_name} {peer * 1e3:.1f} us "
              f"(ours {peer / ours:.2f}x the peer's speed)", flush=True)

    # -- decode ---------------------------------------------------------------------------

    def decode(self) -> None:
        torch = self.torch
        a = self.args
        batches, contexts = parse_ints(a.batches), parse_ints(a.contexts)
        max_blocks = max(b * math.ceil(c / a.block_size) for b in batches for c in contexts)
        for kind in ("bf16", "fp8"):
            cache = self.kv_cache(max_blocks + 1, kind == "fp8")
            g = torch.Generator(device=self.dev).manual_seed(0)
            perm = torch.randperm(max_blocks, device=self.dev, generator=g) + 1
            for b in batches:
                for c in contexts:
                    self._decode_pair(kind, b, c, cache, perm)
            del cache
            torch.cuda.empty_cache()

    def _decode_pair(self, kind: str, b: int, c: int, cache, perm) -> None:
        torch = self.torch
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        from paged_backend.kernels.paged_attention import paged_attention
        from paged_backend.kernels.paged_attention_ref import paged_attention_ref

        a = self.args
        fp8 = kind == "fp8"
        scale = a.head_dim**-0.5
        one = torch.ones((), device=self.dev)
        kv_bytes = b * c * a.kv_heads * a.head_dim * 2 * cache.element_size()
        copies = max(1, min(copies_to_touch(kv_bytes, GIB, 16), len(perm) // (b * math.ceil(c / a.block_size))))
        inputs = [self.decode_inputs(b, c, perm, i) for i in range(copies)]
        io_bytes = 2 * inputs[0][0].numel() * inputs[0][0].element_size()
        kc, vc = cache[0], cache[1]
        descale = one.reshape(1, 1).expand(b, a.kv_heads) if fp8 else None
        # vLLM under CUDA graphs: scheduler metadata made ahead, splits capped at 32
        meta = get_scheduler_metadata(b, 1, c, a.heads, a.kv_heads, a.head_dim, inputs[0][2],
                                      qkv_dtype=cache.dtype, cu_seqlens_q=inputs[0][3], page_size=a.block_size,
                                      causal=True, num_splits=32)
        peer_q = [x[0].to(cache.dtype) if fp8 else x[0] for x in inputs]  # fp8 KV: q as e4m3 (scale 1)
        outs = [torch.empty_like(x[0]) for x in inputs]

        def fa3(i: int):
            q, bt, sl, qsl = inputs[i]
            return flash_attn_varlen_func(peer_q[i], kc, vc, 1, qsl, c, seqused_k=sl, softmax_scale=scale,
                                          causal=True, block_table=bt, out=outs[i], scheduler_metadata=meta,
                                          num_splits=32, q_descale=descale, k_descale=descale,
                                          v_descale=descale, fa_version=3)

        def ours(i: int):
            q, bt, sl, qsl = inputs[i]
            return paged_attention(q, cache, bt, sl, qsl, scale, one, one, max_query_len=1, max_seq_len=c)

        cell = f"decode {kind} batch {b} ctx {c}"
        q, bt, sl, qsl = inputs[0]
        n = min(b, 8)  # the references on the first requests only (the long cells are slow in torch)
        ref = paged_attention_ref(q[:n], cache, bt[:n], sl[:n], qsl[: n + 1], scale, one, one)
        ref_peer = paged_attention_ref(peer_q[0][:n].to(q.dtype), cache, bt[:n], sl[:n], qsl[: n + 1], scale, one, one)
        ok_ours = self.check(f"{cell} ours", ours(0)[:n], ref, 1e-2)
        ok_peer = self.check(f"{cell} FA3", fa3(0)[:n], ref_peer, PEER_TOL_FP8 if fp8 else PEER_TOL)
        if not (ok_ours and ok_peer):
            return
        t_ours = self.time_graph_ms([lambda i=i: ours(i) for i in range(copies)], a.replays)
        t_peer = self.time_graph_ms([lambda i=i: fa3(i) for i in range(copies)], a.replays)
        for who, ms in (("ours", t_ours), ("vLLM FA3", t_peer)):
            bw = (kv_bytes + io_bytes) / (ms * 1e-3)
            self.add(Row("decode", f"{kind} batch {b:>3} ctx {c:>5} {who}", ms, "GB/s", bw / 1e9,
                         f"{100 * bw / a.peak_bw:5.1f}% of {a.peak_bw / 1e12:.1f} TB/s"))
        self.pair(cell, t_ours, t_peer, "vLLM FA3")

    # -- prefill --------------------------------------------------------------------------

    def prefill(self) -> None:
        for n in parse_ints(self.args.prefill_lens):
            self._prefill_pair(n)
            self.torch.cuda.empty_cache()

    def _prefill_pair(self, n: int) -> None:
        torch = self.torch
        import torch.nn.functional as F
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        from paged_backend.kernels.paged_attention import paged_attention, query_prescale

        a = self.args
        h, hkv, d = a.heads, a.kv_heads, a.head_dim
        scale = d**-0.5
        one = torch.ones((), device=self.dev)
        q, k, v, cache, bt, sl, cu = self.prefill_inputs(n)
        factor = query_prescale(q, cache, scale, n, n)
        q_eng = q if factor is None else torch.mul(q, factor)
        ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                             enable_gqa=True)[0].transpose(0, 1)

        def ours(qi, ci):
            return paged_attention(qi, ci, bt, sl, cu, scale, one, one, max_query_len=n, max_seq_len=n,
                                   q_scaled=factor is not None)

        def fa3(qi, ki, vi):
            return flash_attn_varlen_func(qi, ki, vi, n, cu, n, cu_seqlens_k=cu, softmax_scale=scale, causal=True,
                                          fa_version=3)

        def sdpa(qi, ki, vi):  # [1, H, N, D] contiguous; K/V with H heads (MHA) or Hkv (GQA-native)
            return F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                  enable_gqa=ki.shape[1] != qi.shape[1])

        cell = f"prefill {n}"
        if not (self.check(f"{cell} ours vs SDPA", ours(q_eng, cache), ref, 1e-2)
                and self.check(f"{cell} FA3 vs SDPA", fa3(q, k, v), ref, 1e-2)):
            return
        per_call = 2 * (q.numel() * 2 + k.numel() * 2)
        # importing vLLM turns torch's cuDNN attention off (vllm/platforms/cuda.py); SDPA is timed
        # with torch's own defaults, as ``bench kernels`` times it
        cudnn_was = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(True)
        qt, kt, vt = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
        km, vm = (x.repeat_interleave(h // hkv, dim=1) for x in (kt, vt))
        t = {
            "ours": self.time_sets_ms(lambda i: (lambda qi=q_eng.clone(), ci=cache.clone(): ours(qi, ci)), per_call),
            "vLLM FA3": self.time_sets_ms(
                lambda i: (lambda qi=q.clone(), ki=k.clone(), vi=v.clone(): fa3(qi, ki, vi)), per_call),
            # SDPA: the faster of K/V expanded to every head and GQA-native, as bench kernels takes it
            "SDPA": min(self.time_sets_ms(lambda i, kx=kx, vx=vx: (
                lambda qi=qt.clone(), ki=kx.clone(), vi=vx.clone(): sdpa(qi, ki, vi)), per_call)
                for kx, vx in ((km, vm), (kt, vt))),
        }
        torch.backends.cuda.enable_cudnn_sdp(cudnn_was)
        flops = 4 * h * d * n * (n + 1) / 2
        for who, ms in t.items():
            self.add(Row("prefill", f"causal {n} tokens {who}", ms, "TFLOP/s", flops / (ms * 1e-3) / 1e12,
                         f"x{t['SDPA'] / ms:.2f} of SDPA"))
        self.pair(cell, t["ours"], t["vLLM FA3"], "vLLM FA3")

    # -- int4 -----------------------------------------------------------------------------

    def int4(self) -> None:
        for shape in self.args.shapes.split(","):
            k, n = (int(v) for v in shape.lower().split("x"))
            self._int4_shape(k, n, parse_ints(self.args.m))
            self.torch.cuda.empty_cache()

    def _int4_shape(self, k: int, n: int, ms: list[int]) -> None:
        torch = self.torch
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            pack_quantized_values_into_int32,
            quantize_weights,
        )
        from vllm.scalar_type import scalar_types

        from paged_backend.benchmarks.quant_weights import copies_for, make_int4
        from paged_backend.kernels.int4_gemm import int4_gemm
        from paged_backend.kernels.int4_gemm_ref import dequantize_int4_ref

        gs, wt = 128, scalar_types.uint4b8
        gen = torch.Generator(device=self.dev).manual_seed(k + n)
        w = (torch.randn(k, n, generator=gen, device=self.dev) / math.sqrt(k)).to(torch.bfloat16)  # [K, N]
        copies = copies_for(k * n // 2)
        dense = [w.t().contiguous() for _ in range(copies_for(k * n * 2))]  # [N, K] for x @ W^T
        ours_w = [make_int4(k, n, gs, False, seed=k + n + i, dev=self.dev) for i in range(copies)]
        ours_ref = dequantize_int4_ref(ours_w[0].qweight, ours_w[0].scales, ours_w[0].zeros, gs, torch.bfloat16)
        # Machete: GPTQ-style nibbles packed along K, prepacked for its kernel; scales [K/128, N]
        m_ref, m_q, m_s, _ = quantize_weights(w, wt, gs, zero_points=False)
        packed = pack_quantized_values_into_int32(m_q, wt, packed_dim=0).t().contiguous().t()
        mach = ops.machete_prepack_B(packed, torch.bfloat16, wt, torch.bfloat16)
        mach_w = [(mach, m_s)] + [(mach.clone(), m_s.clone()) for _ in range(copies - 1)]
        # GPTQ-Marlin (no act-order): its own repacked nibbles and permuted scales
        g_ref, g_q, g_s, g_idx, g_sort, _ = marlin_quantize(w, wt, gs, False)
        marl_w = [(g_q, g_s)] + [(g_q.clone(), g_s.clone()) for _ in range(copies - 1)]
        wk = marlin_make_workspace_new(self.dev)

        def calls(x, m: int) -> dict:
            """Each kernel's calls on the rotating weight copies, and its reference."""
            return {
                "bf16 cuBLAS": ([lambda wd=wd: torch.matmul(x, wd.t()) for wd in dense], None),
                "ours": ([lambda q=q: int4_gemm(x, q.qweight, q.scales, q.zeros, gs, check=False) for q in ours_w],
                         ours_ref),
                "vLLM Machete": ([lambda q=q, s=s: ops.machete_mm(a=x, b_q=q, b_type=wt, b_group_scales=s,
                                                                 b_group_size=gs) for q, s in mach_w], m_ref),
                "vLLM Marlin": ([lambda q=q, s=s: ops.marlin_gemm(x, None, q, None, s, None, None, None, g_idx, g_sort,
                                                                 wk, wt, m, n, k, is_k_full=True,
                                                                 use_fp32_reduce=True) for q, s in marl_w], g_ref),
            }

        for m in ms:
            self._int4_cell(k, n, m, calls)

    def _int4_cell(self, k: int, n: int, m: int, calls) -> None:
        torch = self.torch
        gen = torch.Generator(device=self.dev).manual_seed(m)
        x = torch.randn(m, k, generator=gen, device=self.dev).to(torch.bfloat16)
        cell = f"int4 {k}x{n} M={m}"
        times = {}
        for who, (fns, w_ref) in calls(x, m).items():
            if w_ref is not None and not self.check(f"{cell} {who}", fns[0](), x.float() @ w_ref.float(), PEER_TOL):
                continue
            times[who] = self.time_graph_ms(fns, self.args.replays)
        base = times["bf16 cuBLAS"]
        for who, ms in times.items():
            self.add(Row("int4", f"{k}x{n} M={m:<3} {who}", ms, "x bf16", base / ms))
        peers = [(t, who) for who, t in times.items() if who.startswith("vLLM")]
        if peers and "ours" in times:
            self.pair(cell, times["ours"], *min(peers))

    # -- moe ------------------------------------------------------------------------------

    def moe(self) -> None:
        for shape in self.args.moe_shapes.split(","):
            e, n, h, k = (int(v) for v in shape.lower().split("x"))
            self._moe_shape(e, n, h, k)
            self.torch.cuda.empty_cache()

    def _moe_shape(self, e: int, n: int, h: int, k: int) -> None:
        torch = self.torch
        from vllm.model_executor.layers.fused_moe import fused_experts

        from paged_backend.benchmarks.moe_tune import moe_weights, routing_sets
        from paged_backend.kernels.fused_moe import fused_moe, table_for
        from paged_backend.kernels.fused_moe_ref import fused_moe_ref

        w13, w2, _ = moe_weights(e, n, h, torch.bfloat16, e * n)
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        print(f"  moe E {e} N {n} H {h} top-{k}: ours {'tuned' if table_for(w13, e, n) else 'untuned'}", flush=True)
        for m in parse_ints(self.args.moe_m):
            # rotating routings: each copy touches other experts, so a replay cannot run from L2
            copies = copies_to_touch(min(m * k, e) * expert_bytes, GIB, 8, 2)
            sets = [(x, tw, ids, ids.to(torch.int32).contiguous())  # vLLM's router gives int32 ids
                    for x, tw, ids in routing_sets(m, e, k, h, torch.bfloat16, e * n, copies)]
            x, tw, ids, ids32 = sets[0]
            cell = f"moe E={e} N={n} k={k} M={m}"
            ref = fused_moe_ref(x, w13, w2, tw, ids)
            if not (self.check(f"{cell} ours", fused_moe(x, w13, w2, tw, ids), ref, PEER_TOL)
                    and self.check(f"{cell} vLLM", fused_experts(x, w13, w2, tw, ids32), ref, PEER_TOL)):
                continue
            t = {
                "ours": self.time_graph_ms([lambda s=s: fused_moe(s[0], w13, w2, s[1], s[2], check=False)
                                            for s in sets], self.args.replays),
                "vLLM fused_experts": self.time_graph_ms([lambda s=s: fused_experts(s[0], w13, w2, s[1], s[3])
                                                          for s in sets], self.args.replays),
            }
            touched = sum(int(torch.unique(s[2]).numel()) for s in sets) / len(sets)
            for who, ms in t.items():
                self.add(Row("moe", f"E={e} N={n} k={k} M={m:<4} {who}", ms, "TB/s",
                             touched * expert_bytes / (ms * 1e-3) / 1e12, f"{touched:.0f} experts touched"))
            self.pair(cell, t["ours"], t["vLLM fused_experts"], "vLLM fused_experts")

    # -- mla ------------------------------------------------------------------------------

    def mla(self) -> None:
        peer_mla.run(self)

    def fp8(self) -> None:
        peer_fp8.run(self)

    # -- report ---------------------------------------------------------------------------

    def report(self) -> None:
        print("\n| cell | ours (us) | best vLLM kernel (us) | which | ours vs vLLM (speed) |")
        print("| --- | ---: | ---: | --- | ---: |")
        for cell, ours, peer, name in self.pairs:
            print(f"| {cell} | {ours * 1e3:.1f} | {peer * 1e3:.1f} | {name} | {peer / ours:.2f}x |")
        self.summary()


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench peer needs a CUDA device", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"bench peer needs vLLM importable ({e}): pip install vllm==0.26.* into this environment, "
              f"or put a directory with its wheels unpacked on PYTHONPATH", file=sys.stderr)
        return 2
    bench = PeerBench(args)
    print(run_header(torch.cuda.get_device_name(), before_date=(f"vllm {vllm.__version__}",)), flush=True)
    for g in args.only or GROUPS:
        t0 = time.time()
        getattr(bench, g)()
        print(f"  [{g} took {time.time() - t0:.0f} s]", flush=True)
    bench.report()
    return 1 if bench.failures else 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
