"""Truncation masks (vLLM v1 semantics): min-p, top-k, top-p. Removed tokens get -inf.

Per-row parameters are ``[R]`` tensors whose neutral values (min_p = 0, k >= V or
k <= 0, p >= 1) leave a row unchanged, so one call serves a batch of mixed requests.
All functions are out of place and never sync with the host.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with ``prob >= min_p * max_prob``, i.e. ``l - l_max >= log(min_p)``.

    Done in log space: no softmax over the vocabulary, and min_p = 0 keeps everything.
    """
    max_logit = logits.amax(dim=-1, keepdim=True)
    drop = (logits - max_logit) < torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(drop, _NEG_INF)


def _normalized_k(k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """k as int64 in ``[1, V]``; k <= 0 (disabled) and k > V become V."""
    k = k.to(torch.int64)
    return torch.where((k <= 0) | (k > vocab_size), vocab_size, k)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Top-k without a full sort: the k-th largest value per row via ``topk(max_k)``.

    ``max_k`` (a host int, >= every enabled row's k) avoids a device->host read of k.max().
    Ties with the k-th value are kept (as vLLM does). Rows with k disabled are unchanged.
    """
    vocab_size = logits.shape[-1]
    k = _normalized_k(k, vocab_size)
    max_k = max(1, min(max_k, vocab_size))
    top_vals = logits.topk(max_k, dim=-1, sorted=True).values
    kth = top_vals.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))
    kth = torch.where((k >= vocab_size).unsqueeze(1), _NEG_INF, kth)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k, then top-p on the renormalized top-k distribution, with one descending sort.

    Top-p keeps the smallest prefix (by descending prob) whose mass reaches p: token i is
    dropped iff the mass of the tokens ranked before it is already >= p, so the top token
    always stays. Rows with p >= 1 skip top-p (float cumsums can reach 1 before the tail).
    """
    if k is None and p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if k is not None:
        k = _normalized_k(k, vocab_size)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if p is not None:
        mass_before = sorted_logits.softmax(dim=-1).cumsum(dim=-1)[:, :-1]
        drop = (mass_before >= p.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
        drop = torch.cat([torch.zeros_like(drop[:, :1]), drop], dim=1)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
