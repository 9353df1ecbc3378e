"""``bench serve``'s requests: what is sent (random prompts of a length, the tokens asked for),
when (the arrival process), and what the client saw of each.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SampleRequest:
    """One prompt of the data set and the number of tokens to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """What the client saw of one request; times are ``time.perf_counter()`` seconds."""

    prompt_len: int = 0
    success: bool = False
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    ttft: float = 0.0  # seconds from sending to the first text chunk
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text_chunks: int = 0
    generated_text: str = ""
    retried: bool = False  # the first attempt's connection failed before any response (see send_request)


def _len_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    lo = max(1, int(length * (1 - range_ratio)))
    return lo, max(lo, int(length * (1 + range_ratio)))


def sample_random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """Random text prompts of about ``input_len`` tokens (vLLM's random data set).

    Lengths are uniform in ``[len * (1 - r), len * (1 + r)]``. Random ids do not always
    decode to text that encodes back to as many tokens, so the text is re-encoded, topped
    up with more random ids while short, and cut to the target; ``prompt_len`` is the
    final text's token count (special tokens the tokenizer adds included).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    n_special = tokenizer.num_special_tokens_to_add()
    in_lo, in_hi = _len_bounds(max(1, input_len - n_special), range_ratio)
    out_lo, out_hi = _len_bounds(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    out: list[SampleRequest] = []
    for target, n_out in zip(in_lens.tolist(), out_lens.tolist(), strict=True):
        ids = rng.choice(allowed, size=target).tolist()
        text = tokenizer.decode(ids)
        for _ in range(8):
            enc = tokenizer.encode(text, add_special_tokens=False)
            if len(enc) >= target:
                text = tokenizer.decode(enc[:target])
                break
            text = tokenizer.decode(enc + rng.choice(allowed, size=target - len(enc)).tolist())
        out.append(SampleRequest(prompt=text, prompt_len=len(tokenizer.encode(text)), output_len=n_out))
    return out


def sample_from_args(tokenizer: Any, args: argparse.Namespace, seed: int) -> list[SampleRequest]:
    """``sample_random_requests`` with ``bench serve``'s options (``--num-prompts``, ``--random-*``)."""
    return sample_random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, seed)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the start, the first at 0 (vLLM's arrival process).

    Gaps are gamma(shape=burstiness, scale=1 / (rate * burstiness)): mean ``1 / rate``
    for any burstiness, exponential (a Poisson process) at 1, burstier below 1, more
    regular above. An infinite rate sends all requests at once.
    """
    import numpy as np

    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])  # its own stream: the prompts do not shift the arrivals
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


class PromptStream:
    """Fresh random prompts without end: batches of ``batch`` prompts with seeds seed, seed+1, ...

    The next batch is made in a thread while the current one is half used, so the event
    loop (which times the streams) does not stall on the tokenizer.
    """

    def __init__(self, make_batch: Callable[[int], list[SampleRequest]], seed: int) -> None:
        self._make = make_batch
        self._seed = seed
        self._batch = make_batch(seed)
        self._pos = 0
        self._next: asyncio.Future[list[SampleRequest]] | None = None

    async def next(self) -> SampleRequest:
        if self._next is None and self._pos >= len(self._batch) // 2:
            self._seed += 1
            self._next = asyncio.ensure_future(asyncio.to_thread(self._make, self._seed))
        if self._pos >= len(self._batch):
            assert self._next is not None
            self._batch, self._next, self._pos = await self._next, None, 0
        self._pos += 1
        return self._batch[self._pos - 1]
