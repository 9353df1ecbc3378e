"""What the engine hands back: ``RequestOutput``s, per step (deltas, cumulative) or at the end
(final only), as the request's ``SamplingParams.output_kind`` asks."""

from __future__ import annotations

from dataclasses import dataclass, field

# token id -> logprob of that token; the sampled token is always included.
LogprobsDict = dict[int, float]


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences of a request.

    In a delta (``RequestOutputKind.DELTA``), ``token_ids``/``text``/``logprobs`` hold only
    what is new since the last output; ``cumulative_logprob`` and ``num_output_tokens`` are
    totals. ``cumulative_logprob`` is None unless ``logprobs`` was asked for (as in vLLM):
    the sampler computes no logprobs at all for the other requests.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    cumulative_logprob: float | None = None
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestMetrics:
    """A finished request's engine timings (``time.monotonic()`` seconds), the phases vLLM's
    request histograms report: queued (arrival to first scheduling), prefill (first scheduling
    to first token), decode (first to last token)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float

    @property
    def queue_time(self) -> float:
        return max(0.0, (self.first_scheduled_time or self.last_token_time) - self.arrival_time)

    @property
    def prefill_time(self) -> float:
        if self.first_scheduled_time is None or self.first_token_time is None:
            return 0.0
        return max(0.0, self.first_token_time - self.first_scheduled_time)

    @property
    def decode_time(self) -> float:
        return 0.0 if self.first_token_time is None else max(0.0, self.last_token_time - self.first_token_time)

    @property
    def inference_time(self) -> float:
        start = self.first_scheduled_time
        return 0.0 if start is None else max(0.0, self.last_token_time - start)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    prompt_logprobs: list[LogprobsDict | None] | None = None
    # DELTA outputs: the engine's time (time.monotonic) of each step whose new tokens this
    # output carries (one per step; deltas merged for a slow consumer keep them all), so
    # TTFT / inter-token latency metrics see the steps, not the deliveries. [] otherwise.
    step_times: list[float] = field(default_factory=list)
    metrics: RequestMetrics | None = None  # set on the final output of a request
    # with prompt_logprobs: each prompt token's rank in its position's distribution (1 = most likely); None first
    prompt_logprob_ranks: list[int | None] | None = None


def merge_delta(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold one delta into the accumulated output of its request (texts, ids, logprobs appended).

    ``acc`` is extended in place (amortized linear in the output's length) and returned; with
    ``acc`` None a new output is built, and ``delta`` itself is never changed. Pass an ``acc``
    nobody else holds: a delta of the engine's own, once handed over, is one.
    """
    if acc is None:
        acc = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False, delta.usage,
                            delta.prompt_logprobs, [], prompt_logprob_ranks=delta.prompt_logprob_ranks)
    by_index = {c.index: c for c in acc.outputs}
    added = False
    for c in delta.outputs:
        cur = by_index.get(c.index)
        if cur is None:
            cur = by_index[c.index] = CompletionOutput(index=c.index, logprobs=[] if c.logprobs is not None else None)
            added = True
        cur.text += c.text
        cur.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if cur.logprobs is None:
                cur.logprobs = []
            cur.logprobs.extend(c.logprobs)
        cur.finish_reason, cur.stop_reason = c.finish_reason, c.stop_reason
        cur.cumulative_logprob, cur.num_output_tokens = c.cumulative_logprob, c.num_output_tokens
    if added:
        acc.outputs = [by_index[i] for i in sorted(by_index)]
    acc.finished, acc.usage = delta.finished, delta.usage
    acc.step_times.extend(delta.step_times)
    if delta.metrics is not None:
        acc.metrics = delta.metrics
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs, acc.prompt_logprob_ranks = delta.prompt_logprobs, delta.prompt_logprob_ranks
    return acc
