"""Sampled tokens to ``RequestOutput``s: append, check stops, detokenize, report, forget.

It owns the registry of live requests (``groups`` by user request id, ``samples`` by
scheduler id). Stop checks run only for a token that could stop its request; the output
of each request is of the kind its ``output_kind`` asks (deltas by default; FINAL_ONLY
builds nothing until the request finishes).
"""

from __future__ import annotations

import time
from itertools import repeat

import torch

from paged_backend.core.request import RequestStatus
from paged_backend.core.scheduler import Scheduler
from paged_backend.engine.request_state import RequestGroup, Row, SampleState
from paged_backend.engine.stats import EngineStats
from paged_backend.outputs import CompletionOutput, LogprobsDict, RequestMetrics, RequestOutput, Usage
from paged_backend.sample.logprobs import prompt_logprobs_and_ranks
from paged_backend.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, stats: EngineStats, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}
        self.samples: dict[str, Row] = {}

    def add(self, group: RequestGroup) -> None:
        self.groups[group.prep.request_id] = group
        for s in group.samples:
            self.samples[s.request.request_id] = (group, s)

    def pop(self, request_id: str) -> RequestGroup | None:
        """Forgets a user request and its samples (the caller frees their blocks)."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            for s in group.samples:
                self.samples.pop(s.request.request_id, None)
        return group

    def process(self, rows: list[Row], token_ids: list[int], now: float, num_tokens: int,
                logprobs: list[tuple[float, LogprobsDict | None] | None] | None = None) -> list[RequestOutput]:
        """Append one step's tokens; the outputs of the requests that report this step.

        A request may have several rows in a row (accepted draft tokens): a token after one that
        stops it is dropped. ``logprobs``: each row's (logprob, top-N), recorded with its token
        (speculative steps; other steps record them when sampling)."""
        delta_kind, final_kind = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
        touched: dict[str, RequestGroup] = {}  # groups that report this step (DELTA, CUMULATIVE)
        ended: dict[str, RequestGroup] = {}  # groups with a sample that finished this step
        if len(rows) != len(token_ids) or (logprobs is not None and len(logprobs) != len(rows)):
            raise ValueError(f"{len(rows)} rows, {len(token_ids)} tokens")
        lps = repeat(None) if logprobs is None else logprobs
        for (group, sample), tok, lp in zip(rows, token_ids, lps, strict=False):  # lengths checked above
            req = sample.request
            if req.is_finished:  # stopped or aborted while this step was in flight: dropped
                continue
            out_ids = req.output_token_ids
            out_ids.append(tok)
            req.all_token_ids.append(tok)
            if lp is not None and sample.wants_logprobs:
                sample.cumulative_logprob += lp[0]
                sample.new_logprobs.append(lp[1])
            kind = group.kind
            if kind is delta_kind:
                sample.new_token_ids.append(tok)
            # check_stop only when the token could end the request (it also feeds the detokenizer)
            if tok in sample.stop_ids or len(out_ids) >= sample.max_output or sample.detok is not None:
                self.check_stop(sample, tok)
                if req.is_finished:
                    ended[group.prep.request_id] = group
            if group.first_token_time is None:
                group.first_token_time = now
            if kind is not final_kind:
                touched[group.prep.request_id] = group

        self.stats.on_step(num_tokens, len(rows), self.scheduler, self.scheduler.kv)
        results = [self.make_output(group, now) for group in touched.values()]
        for rid, group in ended.items():
            if not group.finished:
                continue
            if group.kind is final_kind:
                results.append(self.make_output(group))
            self.pop(rid)
            self.stats.on_request_finished(aborted=False)
        return results

    def check_stop(self, sample: SampleState, tok: int) -> None:
        req = sample.request
        params = req.sampling_params
        stop_str = sample.detok.update(tok) if sample.detok is not None else None
        status = None
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and tok in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif tok in params.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
            elif stop_str is not None:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(req, status)

    def collect_prompt_logprobs(self, prompt_logits: dict[str, tuple[int, torch.Tensor]]) -> None:
        for rid, (start, logits) in prompt_logits.items():
            group, sample = self.samples[rid]
            prompt = sample.request.prompt_token_ids
            # entries exist for positions 0 .. have-1; a recompute after preemption repeats some
            have = len(group.prompt_logprobs)
            skip = max(0, have - (start + 1))
            if skip < logits.shape[0]:
                targets = prompt[start + 1 + skip : start + 1 + logits.shape[0]]
                dicts, ranks = prompt_logprobs_and_ranks(logits[skip:], targets, group.prep.params.prompt_logprobs)
                group.prompt_logprobs.extend(dicts)
                group.prompt_logprob_ranks.extend(ranks)

    def make_output(self, group: RequestGroup, step_time: float | None = None) -> RequestOutput:
        """The group's output of its kind: DELTA holds what is new since the last one (and resets
        it), CUMULATIVE and FINAL_ONLY hold everything so far. ``step_time``: when the step
        that produced a DELTA's new tokens was processed (its ``step_times``)."""
        delta = group.kind is RequestOutputKind.DELTA
        outs = [c for c in (_completion(s, delta) for s in group.samples) if c is not None]
        prompt_lp = prompt_ranks = None
        if group.prompt_logprobs is not None and (not delta or not group.prompt_logprobs_sent):
            prompt_lp, prompt_ranks = group.prompt_logprobs, group.prompt_logprob_ranks
            group.prompt_logprobs_sent = True
        lead = group.samples[0].request
        usage = Usage(
            prompt_tokens=lead.num_prompt_tokens,
            completion_tokens=sum(len(s.request.output_token_ids) for s in group.samples),
            cached_tokens=max(0, lead.num_cached_tokens),
        )
        times = [step_time] if delta and step_time is not None and any(c.token_ids for c in outs) else []
        finished = group.finished
        metrics = None
        if finished:
            metrics = RequestMetrics(group.prep.arrival_time, lead.first_scheduled_time, group.first_token_time,
                                     step_time if step_time is not None else time.monotonic())
        return RequestOutput(group.prep.request_id, group.prep.prompt, group.prep.prompt_token_ids,
                             outs, finished, usage, prompt_lp, times, metrics, prompt_logprob_ranks=prompt_ranks)


def _completion(s: SampleState, delta: bool) -> CompletionOutput | None:
    """One sample's part of its request's output; None when it has nothing to report."""
    req = s.request
    finished = req.is_finished
    if delta:
        if not s.new_token_ids and (s.reported_finish or not finished):
            return None
        token_ids, logprobs = s.new_token_ids, s.new_logprobs
        text = s.detok.delta(finished) if s.detok is not None else ""
        s.new_token_ids, s.new_logprobs = [], []
    else:
        if not req.output_token_ids and not finished:
            return None
        token_ids, logprobs = list(req.output_token_ids), list(s.new_logprobs)
        if s.detok is not None:
            s.text += s.detok.delta(finished)
        text = s.text
    s.reported_finish = finished
    return CompletionOutput(
        index=req.sample_index,
        text=text,
        token_ids=token_ids,
        logprobs=logprobs if s.wants_logprobs else None,
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason,
        cumulative_logprob=s.cumulative_logprob if s.wants_logprobs else None,
        num_output_tokens=len(req.output_token_ids),
    )
