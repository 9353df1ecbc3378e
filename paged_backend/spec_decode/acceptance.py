"""Which draft tokens a verification step keeps, and the token that follows them.

A request with drafts ``d_0 .. d_{k-1}`` has k + 1 target distributions ``p_0 .. p_k`` (``p_j``
conditioned on the tokens before plus ``d_0 .. d_{j-1}``).

``rejection_sample`` is the general rule (Leviathan et al., Chen et al.): draft ``x = d_j``,
proposed with probability ``q_j(x)``, is kept with probability ``min(1, p_j(x) / q_j(x))``; at
the first rejection the emitted token is drawn from ``normalize(max(p_j - q_j, 0))`` and the
step ends; when every draft is kept a bonus token is drawn from ``p_k``. The emitted tokens
are distributed exactly as tokens sampled from the target one at a time.

``accept_prefix`` is the same rule for drafts with a one-hot ``q`` (the n-gram proposer):
then ``min(1, p(x) / q(x)) = p(x)`` and ``normalize(max(p - q, 0))`` is ``p`` with ``x`` removed,
so a token ``t_j`` sampled from ``p_j`` decides it: keep ``x`` iff ``t_j == x`` (probability
``p_j(x)``), else emit ``t_j`` (distributed as ``p_j`` given ``t_j != x``). The engine therefore
samples every position with its ordinary sampler (greedy rows: argmax, the same rule) and keeps
the longest prefix of drafts equal to those samples, plus the sample after it.
"""

from __future__ import annotations

import torch


def accept_prefix(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """The tokens a step emits: the drafts equal to the target's token at their position, then the
    target's token at the first mismatch, or the bonus token ``target_ids[k]`` when all match."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(draft_ids)} drafts need {len(draft_ids) + 1} target tokens, got {len(target_ids)}")
    for j, d in enumerate(draft_ids):
        if target_ids[j] != d:
            return target_ids[: j + 1]
    return list(target_ids)


def rejection_sample(draft_ids: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """The emitted tokens for drafts proposed from ``draft_probs`` [k, V] (None: one-hot on each
    draft), verified against ``target_probs`` [k + 1, V]; draws from ``generator``."""
    k = len(draft_ids)
    if target_probs.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        raise ValueError(f"{k} drafts: target {tuple(target_probs.shape)}, "
                         f"draft {None if draft_probs is None else tuple(draft_probs.shape)}")
    p = target_probs.double()
    if draft_probs is None:
        q = torch.zeros_like(p[:k])
        q[torch.arange(k), torch.tensor(draft_ids, dtype=torch.long)] = 1.0
    else:
        q = draft_probs.double()
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=p.device).tolist() if k else []
    out: list[int] = []
    for j, x in enumerate(draft_ids):
        px, qx = float(p[j, x]), float(q[j, x])
        if qx > 0 and u[j] < min(1.0, px / qx):
            out.append(x)
            continue
        residual = (p[j] - q[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: a rejection has probability 0; p itself is safe
            residual = p[j]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out
