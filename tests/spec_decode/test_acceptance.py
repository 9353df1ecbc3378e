"""The acceptance rules with exact numbers, and rejection sampling's output distribution."""

from __future__ import annotations

import pytest
import torch

from paged_backend.spec_decode.acceptance import accept_prefix, rejection_sample


def test_accept_prefix_stops_at_the_first_mismatch_with_the_targets_token():
    assert accept_prefix([5, 6, 7], [5, 6, 9, 4]) == [5, 6, 9]
    assert accept_prefix([5, 6, 7], [1, 6, 7, 4]) == [1]


def test_accept_prefix_all_kept_adds_the_bonus_token():
    assert accept_prefix([5, 6, 7], [5, 6, 7, 4]) == [5, 6, 7, 4]
    assert accept_prefix([], [3]) == [3]


def test_accept_prefix_needs_one_more_target_token():
    with pytest.raises(ValueError):
        accept_prefix([1, 2], [1, 2])


def _one_hot(i: int, v: int = 4) -> torch.Tensor:
    t = torch.zeros(v)
    t[i] = 1.0
    return t


def test_rejection_sample_certain_cases():
    # p puts all mass on the drafts: every draft kept, then the bonus from p_k
    p = torch.stack([_one_hot(1), _one_hot(2), _one_hot(3)])
    assert rejection_sample([1, 2], p, None) == [1, 2, 3]
    # p_0 has no mass on draft 1: rejected, and the residual is p_0 itself (token 0)
    p = torch.stack([_one_hot(0), _one_hot(2), _one_hot(3)])
    assert rejection_sample([1, 2], p, None) == [0]
    # a draft distribution equal to the target's is always kept
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = rejection_sample([1], p, p[:1], gen)
        assert out == [1, 2]


def test_rejection_sample_residual_excludes_what_q_covers():
    # p = (0.6, 0.4), q = (0, 1) on draft 1: kept with prob 0.4; on rejection the residual
    # max(p - q, 0) = (0.6, 0) gives token 0
    p = torch.tensor([[0.6, 0.4], [1.0, 0.0]])
    q = torch.tensor([[0.0, 1.0]])
    gen = torch.Generator().manual_seed(1)
    outs = [tuple(rejection_sample([1], p, q, gen)) for _ in range(2000)]
    assert set(outs) == {(0,), (1, 0)}
    kept = sum(o == (1, 0) for o in outs) / len(outs)
    assert abs(kept - 0.4) < 0.04


def test_rejection_sample_preserves_the_target_distribution():
    # first emitted token ~ p_0 whatever q is
    torch.manual_seed(0)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(2)
    qgen = torch.Generator().manual_seed(3)
    n = 8000
    counts = torch.zeros(4)
    for _ in range(n):
        draft = int(torch.multinomial(q[0], 1, generator=qgen))
        counts[rejection_sample([draft], p, q, gen)[0]] += 1
    expected = p[0] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001
