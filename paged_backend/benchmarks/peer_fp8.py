"""``bench peer --only fp8``: the block-scaled FP8 linear (DeepSeek-V3's format), ours beside vLLM's.

Each cell is one linear op on bf16 activations, M x (N x K) with 128 x 128 weight blocks: the per-token-group
activation quantization plus the GEMM, at DeepSeek-V3's shapes by default (``--fp8-shapes``; the fused
q_a + kv_a projection, q_b, o_proj, the dense MLP's gate|up and down):

    ours         ``fp8_block_gemm`` (the fused-MoE kernel's block-FP8 path over one expert)
    Triton       vLLM's ``w8a8_triton_block_scaled_mm`` after its ``per_token_group_quant_fp8``
    CUTLASS      vLLM's ``cutlass_scaled_mm`` with block scales (its Hopper block-FP8 kernel; activation
                 scales column-major, as that kernel takes them)

Every op is checked against ``fp8_block_gemm_ref``, then timed as CUDA-graph replays over rotating
weights (L2 cannot serve a rerun). TFLOP/s counts 2 M N K; small M is bound by the weight bytes.
"""

from __future__ import annotations

from paged_backend.benchmarks.kernel_bench import PeerCells
from paged_backend.benchmarks.results import Row, parse_ints
from paged_backend.benchmarks.timing import GIB, copies_to_touch

BLOCK = (128, 128)
TOL = 2e-2


def add_arguments(p) -> None:
    p.add_argument("--fp8-shapes", default="2112x7168,24576x1536,7168x16384,36864x7168,7168x18432",
                   help="fp8: N x K of the block-FP8 linears (DeepSeek-V3's)")
    p.add_argument("--fp8-m", default="1,16,64,256,4096", help="fp8: activation rows")


def run(bench: PeerCells) -> None:
    for shape in bench.args.fp8_shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        _shape(bench, n, k)
        bench.torch.cuda.empty_cache()


def _shape(bench: PeerCells, n: int, k: int) -> None:
    torch = bench.torch
    from paged_backend.kernels.fp8_block_gemm import fp8_block_gemm
    from paged_backend.kernels.fp8_block_gemm_ref import fp8_block_gemm_ref
    from paged_backend.kernels.fp8_quant_ref import FP8_DTYPE

    copies = copies_to_touch(n * k, GIB, 8, 2)
    ws = [((torch.randn(n, k, device=bench.dev) * 0.05).to(FP8_DTYPE),
           torch.rand(-(-n // 128), -(-k // 128), device=bench.dev) * 0.01 + 1e-3) for _ in range(copies)]
    for m in parse_ints(bench.args.fp8_m):
        x = torch.randn(m, k, device=bench.dev, dtype=torch.bfloat16)
        cell = f"fp8 block {m} x ({n} x {k})"
        ref = fp8_block_gemm_ref(x.float(), *ws[0], BLOCK)
        calls = {"ours": lambda w, x=x: fp8_block_gemm(x, w[0], w[1], BLOCK)}
        calls.update(_peers(torch, x))
        times = {}
        for who, fn in calls.items():
            try:
                ok = bench.check(f"{cell} {who}", fn(ws[0]).float(), ref, TOL)
            except Exception as exc:  # a peer this vLLM build lacks: reported, not timed
                print(f"    {cell} {who}: not run ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
                continue
            if ok:
                times[who] = bench.time_graph_ms([lambda w=w, fn=fn: fn(w) for w in ws], bench.args.replays)
        for who, ms in times.items():
            bench.add(Row("fp8", f"M={m:<5} {n}x{k} {who}", ms, "TFLOP/s", 2 * m * n * k / (ms * 1e-3) / 1e12,
                          f"weights {n * k / (ms * 1e-3) / 1e9:7.1f} GB/s"))
        if "ours" in times and len(times) > 1:
            best = min((w for w in times if w != "ours"), key=times.get)
            bench.pair(cell, times["ours"], times[best], f"vLLM {best}")


def _peers(torch, x) -> dict:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        per_token_group_quant_fp8,
        w8a8_triton_block_scaled_mm,
    )

    def triton_op(w):
        xq, xs = per_token_group_quant_fp8(x, 128, use_ue8m0=False)  # the checkpoint's fp32 scales
        return w8a8_triton_block_scaled_mm(xq, w[0], xs, w[1], list(BLOCK), torch.bfloat16)

    def cutlass_op(w):
        xq, xs = per_token_group_quant_fp8(x, 128, column_major_scales=True, use_ue8m0=False)
        return ops.cutlass_scaled_mm(xq, w[0].t(), out_dtype=torch.bfloat16, scale_a=xs, scale_b=w[1].t())

    return {"Triton": triton_op, "CUTLASS": cutlass_op}
