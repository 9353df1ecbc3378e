"""The n-gram (prompt lookup) proposer: drafts copied from earlier in the request's own tokens.

No model and no torch: for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the
last n tokens of prompt + output are looked for earlier in that sequence; at the first
(longest) n that occurs, the tokens that followed its earliest occurrence are the drafts.
"""

from __future__ import annotations


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"bad n-gram bounds: min {prompt_lookup_min}, max {prompt_lookup_max}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to ``min(k, max_drafts)`` draft tokens to follow ``token_ids``; [] when no n-gram recurs."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        total = len(token_ids)
        if k <= 0 or total < self.min_n + 1:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = token_ids[total - n:]
            first = suffix[0]
            # an occurrence starting at i < total - n: its continuation starts at i + n
            i = -1
            while True:
                try:
                    i = token_ids.index(first, i + 1, total - n)
                except ValueError:
                    break
                if token_ids[i:i + n] == suffix:
                    return token_ids[i + n:i + n + k]
        return []
