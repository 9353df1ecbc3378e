"""``q_tiles``: in the ragged grid every tile of every request is taken by exactly one program, whatever the
requests' lengths (decode rows, empty requests, long chunks), and the grid is sized by tokens, not by the
longest request times the requests."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from paged_backend.kernels.q_tiles import q_tile_of, ragged_grid


@triton.jit
def _where_kernel(qsl_ptr, out_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    pid = tl.program_id(0)
    seq, q_start, q_len, tile = q_tile_of(qsl_ptr, num_seqs, pid, BLOCK_Q)
    tl.store(out_ptr + pid * 3, seq)
    tl.store(out_ptr + pid * 3 + 1, tile)
    tl.store(out_ptr + pid * 3 + 2, (tile * BLOCK_Q < q_len).to(tl.int32))


@pytest.mark.parametrize("block_q", [1, 4, 16])
def test_every_tile_is_taken_once(block_q: int) -> None:
    rng = random.Random(block_q)
    for lens in ([1] * 40 + [512], [0, 3, 0, 17, 1, 1, 64, 5], [rng.choice([0, 1, 1, 2, 9, 33]) for _ in range(30)]):
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        n = ragged_grid(int(qsl[-1]), len(lens), block_q)
        out = torch.full((n, 3), -1, dtype=torch.int32)
        _where_kernel[(n,)](qsl, out, len(lens), BLOCK_Q=block_q)
        taken = sorted((int(s), int(t)) for s, t, ok in out.tolist() if ok)
        want = [(i, t) for i, q in enumerate(lens) for t in range(triton.cdiv(q, block_q))]
        assert taken == want
    assert ragged_grid(40 * 1 + 512, 41, 4) == 40 // 4 + 512 // 4 + 41  # not 41 x 128 programs
