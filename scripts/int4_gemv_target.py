"""A profiler target: the int4 kernel (default config for M rows, M = 1: the GEMV) and bf16 cuBLAS
at one weight shape, a few calls each.

For Nsight Compute on the GPU (docs/BENCHMARKS.md, "Quantized weights")::

    ncu --clock-control none -k regex:_int4 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section LaunchStats \\
        --section Occupancy --section SchedulerStats python scripts/int4_gemv_target.py [K N GROUP [M]]

Random weights in the kernel layout (timing only; correctness is ``bench quant``'s check).
"""

from __future__ import annotations

import sys

import torch

from paged_backend.kernels.int4_gemm import int4_gemm


def main(argv: list[str]) -> None:
    k, n, group, m = (int(a) for a in argv + ["4096", "14336", "128", "1"][len(argv):])
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
    scales = torch.rand(k // group, n, dtype=torch.bfloat16, device=dev) * 0.01
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, device=dev)
    w = torch.randn(k, n, dtype=torch.bfloat16, device=dev)
    for _ in range(4):
        y = int4_gemm(x, qweight, scales, zeros, group)
        y_bf16 = x @ w
    torch.cuda.synchronize()
    print(f"int4 {tuple(y.shape)}, bf16 {tuple(y_bf16.shape)}: {k} x {n}, group {group}")


if __name__ == "__main__":
    main(sys.argv[1:])
