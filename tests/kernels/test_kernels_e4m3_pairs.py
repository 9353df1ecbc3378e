"""``e4m3_pairs`` against torch's e4m3 -> fp16 conversion for every int16 word whose two bytes are numbers: the
interpreter's bit moves on the CPU, the hardware's paired conversion compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from paged_backend.kernels._launch import interpreting
from paged_backend.kernels.e4m3_pairs import e4m3_pairs
from paged_backend.kernels.fp8_types import FP8_DTYPE


@triton.jit
def _pairs_kernel(w_ptr, lo_ptr, hi_ptr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo, hi = e4m3_pairs(tl.load(w_ptr + offs), ASM)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


def _check_every_word(device: str) -> None:
    words = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).to(device)
    lo = torch.full(words.shape, float("nan"), dtype=torch.float16, device=device)
    hi = lo.clone()
    _pairs_kernel[(words.numel() // 4096,)](words, lo, hi, ASM=device == "cuda" and not interpreting(), BLOCK=4096)
    pairs = words.cpu().view(FP8_DTYPE).view(-1, 2).to(torch.float16)  # little-endian: low byte first
    numbers = ~pairs.isnan().any(dim=1)  # the cache never holds NaN (writes clamp to +-448)
    assert int(numbers.sum()) == 254 * 254
    bits = lambda x: x.view(torch.int16)  # noqa: E731  (bit for bit: -0 is not +0)
    assert torch.equal(bits(lo.cpu()[numbers]), bits(pairs[numbers, 0]))
    assert torch.equal(bits(hi.cpu()[numbers]), bits(pairs[numbers, 1]))


def test_pairs_convert_every_word_exactly_in_the_interpreter():
    _check_every_word("cpu")


@pytest.mark.cuda
def test_pairs_convert_every_word_exactly_on_the_gpu():
    _check_every_word("cuda")
