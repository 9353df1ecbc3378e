"""The 8-bit float format of every fp8 path (KV cache, weights, activations): e4m3, which
saturates at +-448. Quantizing divides by a scale, clamps to +-FP8_MAX, rounds to nearest even."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
