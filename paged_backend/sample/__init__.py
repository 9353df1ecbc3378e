"""Sampling building blocks: batch metadata, penalties, top-k/top-p/min-p masks, logprobs.

The engine uses :class:`paged_backend.sample.sampler.Sampler`; these modules are its pure,
separately tested parts. Every function takes and returns device tensors, never syncs.
"""

from paged_backend.sample.logprobs import compute_prompt_logprobs
from paged_backend.sample.masks import apply_min_p, apply_top_k, apply_top_k_top_p
from paged_backend.sample.metadata import SamplerOutput, SamplingMetadata
from paged_backend.sample.penalties import apply_min_tokens, apply_penalties, token_counts

__all__ = [
    "SamplerOutput",
    "SamplingMetadata",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_top_k",
    "apply_top_k_top_p",
    "compute_prompt_logprobs",
    "token_counts",
]
