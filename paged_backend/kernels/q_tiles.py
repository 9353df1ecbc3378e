"""Where a program of a ragged prefill grid works: the request and q tile of program ``pid``.

Request i's ``cdiv(q_len_i, BLOCK_Q)`` tiles take programs qsl[i] // BLOCK_Q + i onwards (strictly increasing
in i, and room enough: qsl[i + 1] // BLOCK_Q - qsl[i] // BLOCK_Q + 1 >= cdiv(q_len_i, BLOCK_Q)), so a grid of
``num_tokens // BLOCK_Q + num_seqs`` programs covers every request's rows whatever their lengths; programs
past a request's rows have nothing to do (``q_tile * BLOCK_Q >= q_len``)."""

from __future__ import annotations

import triton
import triton.language as tl


def ragged_grid(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Programs the grid needs for ``num_tokens`` new rows of ``num_seqs`` requests, ``block_q`` rows a tile."""
    return num_tokens // block_q + num_seqs


@triton.jit
def q_tile_of(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """(request, its first row's index in the step, its new rows, the tile) of program ``pid``: the largest i
    with qsl[i] // BLOCK_Q + i <= pid, by binary search over the ``num_seqs`` requests."""
    lo = pid * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start_mid = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start_mid <= pid, mid, lo)
        hi = tl.where(start_mid <= pid, hi, mid - 1)
    q_start = tl.load(qsl_ptr + lo)
    q_len = tl.load(qsl_ptr + lo + 1) - q_start
    return lo, q_start, q_len, pid - (q_start // BLOCK_Q + lo)
