"""Speculative decoding in the engine: drafts proposed after each step, verified by the next.

``propose`` gives every running request whose tokens are all computed but the last one new
drafts (``request.spec_token_ids``: the n-gram proposer's, a draft model's, engine/draft_model.py, or the
target's multi-token-prediction layers', engine/mtp_proposer.py); the scheduler gives it 1 + k query tokens. ``verify``
samples each of the k + 1 logits rows with the request's own sampler (row j sees the output
followed by drafts 0..j-1: penalties, min_tokens and bad words read that history), keeps the
drafts equal to those samples and the sample after them (``spec_decode/acceptance.py``: this
is rejection sampling for a proposer with a one-hot draft distribution, so the output is
distributed as the target's), and rolls the rejected positions back in the scheduler.
Structured outputs opt out (their grammar accepts one token per step): such requests get no
drafts. Under async scheduling (``launch`` / ``land``) a step's rows are sampled on the device and
verified when the next engine step lands them; a request waits while its step is in flight (the count
of kept drafts decides its next positions), see docs/ARCHITECTURE.md 2.6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged_backend.core.scheduler import Scheduler, SchedulerOutput
from paged_backend.engine.draft_model import DraftModelProposer
from paged_backend.engine.mtp_proposer import MTPProposer
from paged_backend.engine.request_state import Row
from paged_backend.engine.step_sampling import LaunchedStep, StepSampler, one_row_each
from paged_backend.outputs import LogprobsDict
from paged_backend.sample.sampler import SamplerOutput
from paged_backend.spec_decode.acceptance import accept_prefix
from paged_backend.spec_decode.config import SpeculativeConfig
from paged_backend.spec_decode.ngram import NgramProposer

RowLogprob = tuple[float, LogprobsDict | None] | None  # an emitted token's raw logprob and top-N


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: verified draft sequences, draft tokens, accepted tokens (also
    per draft position); and the proposal rounds skipped by ``disable_by_batch_size``."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_disabled_steps: int = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def snapshot(self) -> dict[str, int | list[int]]:
        """The counters under engine.stats()' keys (the adapters' spec_decode metrics: all but the disabled
        steps, which vLLM does not publish)."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_num_disabled_steps": self.num_disabled_steps}

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft sequence (accepted drafts + the target's token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class VerifiedStep:
    """A verification step's tokens as the output processor takes them: one row per emitted token."""

    rows: list[Row]
    token_ids: list[int]
    logprobs: list[RowLogprob] | None


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, scheduler: Scheduler, step_sampler: StepSampler,
                 draft: DraftModelProposer | MTPProposer | None = None) -> None:
        self.config = config
        self.ngram: NgramProposer | None = None
        if draft is None:
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                       config.prompt_lookup_max)
        self.draft = draft
        self.scheduler = scheduler
        self.step_sampler = step_sampler
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def observe(self, sched: SchedulerOutput) -> None:
        """Each step the target computes: a draft model computes it too (its own KV); the MTP proposer keeps
        its plan for ``propose`` (the runner keeps its hidden states)."""
        if self.draft is not None:
            self.draft.observe(sched)

    def propose(self, samples: dict[str, Row], landed: list[SchedulerOutput]) -> None:
        """New drafts for each running request that decodes (all its tokens computed but the last); ``landed``:
        the steps whose tokens were appended since the last call (the MTP pass covers their positions).

        A request whose step is still in flight (async scheduling) has more computed tokens than that, so it
        is left alone until its tokens land. Past ``disable_by_batch_size`` none gets drafts (``_disabled``)."""
        decoding = []
        for req in self.scheduler.running:
            if req.num_computed_tokens != len(req.all_token_ids) - 1 or not req.output_token_ids:
                continue
            row = samples.get(req.request_id)
            if row is None or row[1].grammar is not None:
                continue
            decoding.append(req)
        if decoding and self._disabled():
            self.stats.num_disabled_steps += 1
            for req in decoding:  # the next step decodes them one token each
                req.spec_token_ids = []
            decoding = []  # an MTP pass still runs over the landed positions: its cache covers them
        if isinstance(self.draft, MTPProposer):
            self.draft.propose(decoding, self.scheduler.max_model_len, landed)
            return
        if self.draft is not None:
            self.draft.propose(decoding, self.scheduler.max_model_len)
            return
        assert self.ngram is not None
        propose = self.ngram.propose
        for req in decoding:
            req.spec_token_ids = propose(req.all_token_ids)

    def _disabled(self) -> bool:
        """``disable_by_batch_size``: the scheduler holds more requests (running, waiting, swapped) than that.
        A draft model keeps observing every step meanwhile, so its cache holds the positions decoded without
        drafts when proposals resume."""
        limit = self.config.disable_by_batch_size
        return limit is not None and self.scheduler.num_requests > limit

    def verify(self, sched: SchedulerOutput, rows: list[Row], logits: torch.Tensor,
               index: list[int] | None) -> VerifiedStep:
        """Sample every row, keep the accepted drafts, roll back the rejected positions."""
        logits, spans, histories, fast = self._plan(sched, rows, logits, index)
        step_sampler = self.step_sampler
        if fast:
            return self._accept(rows, spans, step_sampler.sampler.greedy(logits), None)
        result = step_sampler.sampler.to_output(step_sampler.full_sample(rows, logits, histories))
        return self._accept(rows, spans, result.sampled_token_ids, _row_logprobs(result))

    def launch(self, launched: LaunchedStep, index: list[int] | None) -> LaunchedStep:
        """Async scheduling: every row sampled on the device (``StepSampler.queue``); the drafts are verified
        by ``land`` once the ids reach the host, one step later."""
        out = launched.out
        logits, launched.spans, histories, fast = self._plan(launched.sched, launched.rows, out.logits, index)
        self.step_sampler.queue(launched, logits, fast, histories)
        return launched

    def land(self, launched: LaunchedStep) -> VerifiedStep:
        """A launched step's sampled ids (waits for them), its drafts verified and rolled back."""
        assert launched.spans is not None
        sampled, result = self.step_sampler.land_sampled(launched)
        return self._accept(launched.rows, launched.spans, sampled, _row_logprobs(result))

    def _plan(self, sched: SchedulerOutput, rows: list[Row], logits: torch.Tensor, index: list[int] | None
              ) -> tuple[torch.Tensor, list[tuple[int, list[int]]], list[list[int]], bool]:
        """The logits to sample (grammar masks applied, one per row), each request's (first row, drafts), the
        output each row's sampler sees, and whether every row is plain greedy."""
        logits, index = self.step_sampler.constrain(rows, logits, index)  # rows without drafts
        logits = one_row_each(logits, index)
        drafts_of = {s.request_id: s.token_ids[-s.num_draft:] for s in sched.scheduled if s.num_draft}
        spans: list[tuple[int, list[int]]] = []  # (first row, drafts) per request
        histories: list[list[int]] = []  # the output each row's sampler sees
        fast = True
        i = 0
        while i < len(rows):
            sample = rows[i][1]
            req = sample.request
            drafts = drafts_of.get(req.request_id, [])
            out = req.output_token_ids
            histories += [out + drafts[:j] for j in range(len(drafts) + 1)] if drafts else [out]
            if sample.fast_from and len(out) < sample.fast_from:
                fast = False
            spans.append((i, drafts))
            i += len(drafts) + 1
        if len(histories) != len(rows):
            raise RuntimeError(f"{len(rows)} logits rows for {len(histories)} sampled positions")
        return logits, spans, histories, fast

    def _accept(self, rows: list[Row], spans: list[tuple[int, list[int]]], sampled: list[int],
                row_lps: list[RowLogprob] | None) -> VerifiedStep:
        """Each request's emitted tokens: its drafts equal to the samples, then the next sample; the rejected
        positions rolled back. A request that ended while its step was in flight (aborted) emits nothing that
        counts: its verification is not recorded."""
        out_rows: list[Row] = []
        out_ids: list[int] = []
        out_lps: list[RowLogprob] | None = [] if row_lps is not None else None
        for first, drafts in spans:
            k = len(drafts)
            emitted = accept_prefix(drafts, sampled[first:first + k + 1]) if k else [sampled[first]]
            out_rows += [rows[first]] * len(emitted)
            out_ids += emitted
            if out_lps is not None and row_lps is not None:
                out_lps += row_lps[first:first + len(emitted)]
            if k:
                req = rows[first][1].request
                accepted = len(emitted) - 1
                if not req.is_finished:
                    self.stats.record(k, accepted)
                self.scheduler.rollback_drafts(req, k - accepted)
        return VerifiedStep(out_rows, out_ids, out_lps)


def _row_logprobs(result: SamplerOutput | None) -> list[RowLogprob] | None:
    """Each sampled row's (raw logprob, top-N), when some row asked for logprobs."""
    if result is None or result.sampled_logprobs is None:
        return None
    return [(lp, tops) for lp, tops in zip(result.sampled_logprobs, result.logprobs, strict=True)]
