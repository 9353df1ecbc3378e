"""A step's logits to token ids: on the host at once, or left on the device (async scheduling).

``launch`` samples a step's rows. Async: the sampling is queued on the device and its ids
(or ``Sampler.pack`` of the full sampler's results) are copied to pinned host memory behind
an event; ``land`` waits for that event when the engine processes the step, one step later.
A batch of plain greedy rows skips the sampler's per-row metadata (``Sampler.greedy``).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from paged_backend.core.scheduler import SchedulerOutput
from paged_backend.engine.request_state import RequestGroup, Row
from paged_backend.sample.grammar import (
    RequestGrammar,
    StagedMasks,
    apply_grammars,
    apply_masks,
    fill_masks_ahead,
)
from paged_backend.sample.sampler import DeviceSample, Sampler, SamplerOutput, SamplingMetadata
from paged_backend.worker.runner import ModelOutput


@dataclass(eq=False)
class LaunchedStep:
    """A step whose forward pass is queued, with how its rows get their tokens.

    Sampled on the host (``token_ids``), or still on the device (``tokens``), copied behind
    ``event`` to ``landing`` (pinned host memory): the ids, or ``Sampler.pack`` of
    ``device_sample`` when the full sampler ran.
    """

    sched: SchedulerOutput
    out: ModelOutput
    rows: list[Row]
    forking: list[RequestGroup]
    token_ids: list[int] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    device_sample: DeviceSample | None = None
    landing: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    # speculative decoding under async scheduling: (first row, drafts) per request, verified when the ids land
    spans: list[tuple[int, list[int]]] | None = None


class StepSampler:
    def __init__(self, sampler: Sampler, eos_token_ids: tuple[int, ...], async_scheduling: bool,
                 max_num_seqs: int) -> None:
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.async_scheduling = async_scheduling
        self.max_num_seqs = max_num_seqs
        # pinned landing buffers of sampled ids (int64) and of full-sampler results (float64)
        self._landing: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self.num_async_steps = 0  # steps sampled on the device and processed one step later
        # structured outputs under async scheduling: the queued step's rows and their masks being filled
        self._ahead: tuple[list[Row], Future[StagedMasks | None]] | None = None
        self.num_masks_ahead = 0  # steps whose masks were filled while the step before was processed
        self.num_deferred = 0  # of those, steps sampled in the next step, once its inputs were built (``defer``)

    def launch(self, launched: LaunchedStep, index: list[int] | None) -> LaunchedStep:
        """Sample the step's rows (``index``: their logits rows when forks repeat some). Async:
        queued on the device; otherwise (async off, or samples still to fork) at once, on the host."""
        rows = launched.rows
        logits, index = self.constrain(rows, launched.out.logits, index)
        # every row plain greedy by now: argmax only (the per-row checks below are all it costs)
        fast = True
        for _, sample in rows:
            if sample.fast_from and len(sample.request.output_token_ids) < sample.fast_from:
                fast = False
                break
        if not self.async_scheduling or launched.forking or not rows:
            logits = one_row_each(logits, index)
            launched.token_ids = self.sampler.greedy(logits) if fast else self._sample(rows, logits)
            return launched
        self.queue(launched, logits, fast)
        return launched

    def defer(self, launched: LaunchedStep) -> bool:
        """Async: whether ``launched``'s sampling waits for the next step (its masks are being filled: the
        next step queues it after building its inputs, so the fill overlaps that work); its requests' tokens
        count as in flight from now on."""
        ahead = self._ahead
        if ahead is None or ahead[0] is not launched.rows or launched.forking or not launched.rows:
            return False
        for _, sample in launched.rows:
            sample.request.num_pending = 1
        self.num_deferred += 1
        return True

    def queue(self, launched: LaunchedStep, logits: torch.Tensor, fast: bool,
              histories: list[list[int]] | None = None) -> None:
        """Async: sample ``launched``'s rows (one per row of ``logits``) on the device and copy the result to
        pinned host memory behind an event; every sampled request has a token in flight until ``land``.
        ``histories``: each row's output so far when not its request's (speculative decoding's draft rows)."""
        rows = launched.rows
        if fast:
            tokens = src = logits.argmax(dim=-1)
        else:
            # the full sampler's results in one buffer: a blocking read in land() would wait
            # for the step queued after this one
            ds = launched.device_sample = self.full_sample(rows, logits, histories)
            tokens, src = ds.token_ids, self.sampler.pack(ds)
        launched.landing = self._landing_buffer(src)
        launched.landing.copy_(src, non_blocking=True)
        if tokens.device.type == "cuda":
            launched.event = torch.cuda.Event()
            launched.event.record()
        launched.tokens = tokens
        self.num_async_steps += 1
        for _, sample in rows:
            sample.request.num_pending = 1

    def constrain(self, rows: list[Row], logits: torch.Tensor, index: list[int] | None
                  ) -> tuple[torch.Tensor, list[int] | None]:
        """Structured outputs: the grammars' masks, in place, on the constrained rows' own logits
        (the logits and index to sample from); filled ahead by ``prepare`` when it ran for these rows."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead_rows, future = ahead
            staged = future.result()  # the matchers are the mask thread's until then
            if ahead_rows is rows:
                self.num_masks_ahead += 1
                if staged is None:
                    return logits, index
                logits = one_row_each(logits, index)
                apply_masks(logits, staged)
                return logits, None
        constrained = [(i, s.grammar, s.request.output_token_ids) for i, (_, s) in enumerate(rows)
                       if s.grammar is not None and not s.request.is_finished] if RequestGrammar.live else ()
        if not constrained:
            return logits, index
        logits = one_row_each(logits, index)
        apply_grammars(logits, constrained)
        return logits, None

    def prepare(self, rows: list[Row], logits: torch.Tensor, landed: list[Row], token_ids: list[int]) -> None:
        """Async scheduling: ``rows`` (the queued step's, over ``logits``) get their masks filled on the mask
        thread now that ``landed``'s sampled ``token_ids`` are on the host, while the engine processes them."""
        if not RequestGrammar.live:
            return
        new = {id(s): t for (_, s), t in zip(landed, token_ids, strict=True) if s.grammar is not None}
        pending = []
        for i, (_, s) in enumerate(rows):
            g = s.grammar
            if g is None or s.request.is_finished:
                continue
            tokens = list(s.request.output_token_ids[g.accepted:])
            if id(s) in new:  # not in output_token_ids until the engine processes the landed step
                tokens.append(new[id(s)])
            pending.append((i, g, tokens))
        if pending:
            self._ahead = (rows, fill_masks_ahead(pending, logits.shape[1], logits.device))

    def land(self, launched: LaunchedStep) -> list[int]:
        """The step's sampled ids on the host (async: waits for them now)."""
        if launched.tokens is None:
            return launched.token_ids
        token_ids, sampled = self.land_sampled(launched)
        return token_ids if sampled is None else record_logprobs(launched.rows, sampled)

    def land_sampled(self, launched: LaunchedStep) -> tuple[list[int], SamplerOutput | None]:
        """A queued step's sampled ids, and the full sampler's results when it ran (logprobs not recorded yet);
        waits for them now."""
        if launched.event is not None:
            launched.event.synchronize()
        assert launched.landing is not None
        host = launched.landing.tolist()
        ds = launched.device_sample
        for _, sample in launched.rows:
            sample.request.num_pending = 0
        if ds is None:
            return host, None
        sampled = self.sampler.unpack(ds, host)
        return sampled.sampled_token_ids, sampled

    def _landing_buffer(self, src: torch.Tensor) -> torch.Tensor:
        """A host slice of ``src``'s size and dtype, pinned on CUDA, reused step after step. Two buffers a dtype,
        used in turn: a step is queued before the one queued before it lands (speculative decoding under async
        scheduling), and each step's results are read in land() before the step after the next is queued."""
        n = src.shape[0]
        key = (src.dtype, self.num_async_steps % 2)
        buf = self._landing.get(key)
        if buf is None or buf.shape[0] < n:
            buf = self._landing[key] = torch.empty(max(n, 2 * self.max_num_seqs), dtype=src.dtype,
                                                   pin_memory=src.device.type == "cuda")
        return buf[:n]

    def full_sample(self, rows: list[Row], logits: torch.Tensor,
                       histories: list[list[int]] | None = None) -> DeviceSample:
        """The full sampler, left on the device; ``histories``: each row's output so far, when it is
        not its request's (a draft token's row sees the drafts before it)."""
        meta = SamplingMetadata(
            params=[s.request.sampling_params for _, s in rows],
            generators=[s.generator for _, s in rows],
            prompt_token_ids=[s.request.prompt_token_ids for _, s in rows],
            output_token_ids=histories if histories is not None else [s.request.output_token_ids for _, s in rows],
            eos_token_ids=self.eos_token_ids,
            specs=[s.spec for _, s in rows],
        )
        return self.sampler.sample_tensors(logits, meta, sampled_logprobs=False)

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> list[int]:
        """The full sampler, on the host at once; records the logprobs of the rows that asked."""
        return record_logprobs(rows, self.sampler.to_output(self.full_sample(rows, logits)))


def one_row_each(logits: torch.Tensor, index: list[int] | None) -> torch.Tensor:
    """The logits with one row per step row (``index``: the logits row of each, when forks repeat some): the
    masks are then applied in place on each row's own copy."""
    return logits if index is None else logits[torch.tensor(index, device=logits.device)]


def record_logprobs(rows: list[Row], sampled: SamplerOutput) -> list[int]:
    """Adds each row's sampled logprobs to its sample (the rows that asked); returns the ids."""
    if sampled.sampled_logprobs is None:  # no row asked for logprobs
        return sampled.sampled_token_ids
    for (_, sample), lp, tops in zip(rows, sampled.sampled_logprobs, sampled.logprobs, strict=True):
        if sample.wants_logprobs and not sample.request.is_finished:
            sample.cumulative_logprob += lp
            sample.new_logprobs.append(tops)
    return sampled.sampled_token_ids
