"""Logprobs of the RAW model distribution (vLLM v1's default ``raw_logprobs``).

``log_softmax(l)[t] = l[t] - logsumexp(l)``: we compute the per-row logsumexp and gather,
so no ``[R, V]`` logprob tensor is materialized; top-N comes from ``topk`` on the logits.
"""

from __future__ import annotations

import torch

from paged_backend.sample.metadata import to_device, to_host


def token_logprobs(logits: torch.Tensor, lse: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Raw logprob of ``token_ids[r]`` in row r: float32 ``[R]``."""
    return logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - lse


def top_logprobs(
    logits: torch.Tensor, lse: torch.Tensor, num: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num`` most likely tokens of each row, descending: (ids ``[R, num]``, logprobs)."""
    vals, ids = logits.topk(num, dim=-1, sorted=True)
    return ids, vals - lse.unsqueeze(1)


def logprob_dict(
    top_ids: list[float], top_lps: list[float], num: int, token: int, token_lp: float
) -> dict[int, float]:
    """Host-side: top-``num`` (descending) then ``token`` if it is not among them."""
    d = {int(top_ids[j]): top_lps[j] for j in range(num)}
    d.setdefault(token, token_lp)
    return d


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], num: int
) -> list[dict[int, float]]:
    """Prompt logprobs: row i scores ``next_token_ids[i]`` (+ its top-``num``) under ``logits[i]``.

    ``logits`` is ``[P, V]``; only the first ``len(next_token_ids)`` rows are used (the last
    prompt position has no next prompt token). One device->host transfer.
    """
    return prompt_logprobs_and_ranks(logits, next_token_ids, num)[0]


def prompt_logprobs_and_ranks(
    logits: torch.Tensor, next_token_ids: list[int], num: int
) -> tuple[list[dict[int, float]], list[int]]:
    """``compute_prompt_logprobs`` and each prompt token's rank in its row (vLLM's: how many tokens have a
    logprob at least as high, so 1 is the most likely). One device->host transfer."""
    n = len(next_token_ids)
    if n > logits.shape[0]:
        raise ValueError(f"{n} next tokens for {logits.shape[0]} logits rows")
    if n == 0:
        return [], []
    x = logits[:n].float()
    lse = torch.logsumexp(x, dim=-1)
    targets = to_device(torch.tensor(next_token_ids, dtype=torch.int64), x.device)
    tok_lp = token_logprobs(x, lse, targets)
    ranks = (x >= x.gather(1, targets.unsqueeze(1))).sum(dim=-1)
    num = min(num, x.shape[1])
    top_ids, top_lp = top_logprobs(x, lse, num)
    tok_lp_h, top_ids_h, top_lp_h, ranks_h = to_host(tok_lp, top_ids, top_lp, ranks)
    dicts = [
        logprob_dict(top_ids_h[i * num : (i + 1) * num], top_lp_h[i * num : (i + 1) * num], num,
                     next_token_ids[i], tok_lp_h[i])
        for i in range(n)
    ]
    return dicts, [int(r) for r in ranks_h]
