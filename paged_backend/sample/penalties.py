"""Logit penalties that depend on a request's history: min_tokens, repetition, presence, frequency.

All are out of place (the caller's logits are never modified) and row-vectorized.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from paged_backend.sample.metadata import to_device


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list: float32 ``[R, V]``.

    The flat ``row * V + token`` indices are built with numpy (``torch.tensor`` on a long
    Python list is ~10x slower), copied once to the device, then scatter-added.
    """
    rows = len(token_ids)
    counts = torch.zeros(rows * vocab_size, dtype=torch.float32, device=device)
    lens = np.fromiter(map(len, token_ids), dtype=np.int64, count=rows)
    total = int(lens.sum())
    if total:
        flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=total)
        if flat.min() < 0 or flat.max() >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}): got {flat.min()}..{flat.max()}")
        flat += np.repeat(np.arange(rows, dtype=np.int64) * vocab_size, lens)
        linear = to_device(torch.from_numpy(flat), device)
        counts.scatter_add_(0, linear, torch.ones_like(linear, dtype=torch.float32))
    return counts.view(rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor | None,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM / HF / OpenAI penalties; per-row ``[R]`` parameters, counts ``[R, V]``.

    repetition (HF): over tokens seen in prompt + output, ``l > 0 ? l / r : l * r``;
    then OpenAI: ``l -= frequency * count + presence * (count > 0)`` over output tokens.
    """
    seen_out = output_counts > 0
    seen = seen_out if prompt_counts is None else seen_out | (prompt_counts > 0)
    rep = torch.where(seen, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * seen_out


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Ban ``tokens[j]`` in row ``rows[j]`` (EOS / stop ids before min_tokens): set to -inf."""
    neg_inf = torch.full(rows.shape, float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((rows, tokens), neg_inf)
