"""Pure-torch reference of the block-scaled FP8 GEMM (``quant_method: fp8`` with ``weight_block_size``, the
DeepSeek-V3 format; the CPU path of ``quantization/fp8_block.py``)::

    x_q, x_s = quantize_fp8_groups(x, bk)           e4m3 [M, K], float32 [M, ceil(K / bk)] (per token and bk inputs)
    y[m, n]  = sum_k x_q[m, k] x_s[m, k // bk] * w[n, k] w_s[n // bn, k // bk]        (float32), + bias

``w`` is e4m3 [N, K] and ``w_s`` its float32 [ceil(N / bn), ceil(K / bk)] block scales (``weight_scale_inv``).
"""

from __future__ import annotations

import torch

from paged_backend.kernels.fp8_quant_ref import (
    dequantize_fp8_groups_ref,
    expand_block_scales,
    quantize_fp8_groups_ref,
)


def fp8_block_gemm_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_shape: tuple[int, int],
                       bias: torch.Tensor | None = None) -> torch.Tensor:  # [M, N], x's dtype
    bn, bk = block_shape
    n, k = w.shape
    xd = dequantize_fp8_groups_ref(*quantize_fp8_groups_ref(x, bk), bk)
    y = xd @ (w.float() * expand_block_scales(w_scale.float(), n, k, bn, bk)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
