"""What the engine hands back: one ``RequestOutput`` per request per step (a delta)."""

from __future__ import annotations

from dataclasses import dataclass, field

# token id -> logprob of that token; the sampled token is always included.
LogprobsDict = dict[int, float]


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences of a request.

    In a delta, ``token_ids``/``text``/``logprobs`` hold only what is new since the last
    output; ``cumulative_*`` fields are totals.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    cumulative_logprob: float = 0.0
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
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    prompt_logprobs: list[LogprobsDict | None] | None = None
