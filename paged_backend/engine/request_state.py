"""The engine's per-request state: a user request (``RequestGroup``) and its samples (``SampleState``).

A user request with ``n`` samples is ``n`` scheduler requests; the group holds them and what
the request has reported so far. The per-step loops read only plain attributes here, derived
once from the sampling parameters (they do not change while the request runs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from paged_backend.core.request import Request
from paged_backend.engine.detokenizer import IncrementalDetokenizer
from paged_backend.outputs import LogprobsDict
from paged_backend.sample.grammar import RequestGrammar
from paged_backend.sample.sampler import RowSpec
from paged_backend.sampling_params import RequestOutputKind, SamplingParams

NEVER = sys.maxsize


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready to enter the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    cache_salt: str | None = None
    grammar: Any = None  # the compiled grammar of ``params.structured_outputs`` (sample/grammar.py)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # ``params.bad_words`` tokenized


@dataclass(eq=False)
class SampleState:
    """Engine-side state of one scheduler request (one of the n samples).

    ``spec`` (what the sampler's batch plan reads), ``fast_from`` (output count from which its
    logits row may skip the full sampler), ``stop_ids`` (every token id that could end it),
    ``max_output`` (the output length that ends it: max_tokens or the rest of max_model_len)
    and ``wants_logprobs``.
    """

    request: Request
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    spec: RowSpec
    max_output: int
    fast_from: int = NEVER
    stop_ids: frozenset[int] = frozenset()
    wants_logprobs: bool = False
    grammar: RequestGrammar | None = None  # structured outputs: this sample's matcher
    # DELTA: what is new since the last output; CUMULATIVE / FINAL_ONLY: logprobs and text so far
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[LogprobsDict] = field(default_factory=list)
    text: str = ""
    cumulative_logprob: float = 0.0
    reported_finish: bool = False


@dataclass(eq=False)
class RequestGroup:
    """One user request: its samples and what it has reported."""

    prep: PreparedRequest
    samples: list[SampleState]
    pending_forks: list[SampleState]  # samples 1..n-1 until sample 0's prompt is computed
    prompt_logprobs: list[LogprobsDict | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    prompt_logprobs_sent: bool = False
    first_token_time: float | None = None
    kind: RequestOutputKind = RequestOutputKind.DELTA

    @property
    def finished(self) -> bool:
        if self.pending_forks:
            return False
        samples = self.samples
        if len(samples) == 1:
            return samples[0].request.is_finished
        return all(s.request.is_finished for s in samples)


Row = tuple[RequestGroup, SampleState]  # one sampled logits row of a step
