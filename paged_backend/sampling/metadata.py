"""Hand-off types between the engine and the sampler, and the per-batch parameter plan.

``SamplingMetadata`` is what the engine passes (one entry per logits row);
``BatchPlan`` turns it, on the host, into flags (which stages run at all) and into
per-row parameter tensors copied to the device without a host sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.request import Request


@dataclass
class SamplingMetadata:
    """Per-row inputs of one sampler call; every list has one entry per logits row."""

    params: list[SamplingParams]
    # per row: the request's own generator (seeded requests, on the logits' device); None = unseeded
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]  # repetition penalty covers prompt + output (HF / vLLM)
    output_token_ids: list[list[int]]  # presence/frequency penalties and min_tokens
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.params)
        lens = (len(self.generators), len(self.prompt_token_ids), len(self.output_token_ids))
        if any(m != n for m in lens):
            raise ValueError(f"SamplingMetadata lists differ in length: params={n}, others={lens}")

    @classmethod
    def build(
        cls,
        requests: Sequence[Request],
        generators: Mapping[str, torch.Generator] | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> SamplingMetadata:
        """Rows from requests; ``generators`` by request id; EOS ids default to the first request's."""
        gens = generators or {}
        if eos_token_ids is None:
            eos_token_ids = tuple(requests[0].eos_token_ids) if requests else ()
        return cls(
            params=[r.sampling_params for r in requests],
            generators=[gens.get(r.request_id) for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            eos_token_ids=eos_token_ids,
        )


@dataclass
class SamplerOutput:
    """Host-side results, one entry per logits row."""

    sampled_token_ids: list[int]
    sampled_logprobs: list[float]  # raw-distribution logprob of the sampled token
    # top-N raw logprobs (descending) then the sampled token if not among them; None if not asked
    logprobs: list[dict[int, float] | None]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a freshly built CPU tensor to ``device`` without blocking the host (pinned on CUDA)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[list[float]]:
    """Flatten tensors into float64 and read them back in ONE device->host transfer.

    float64 holds token ids (< 2**53) and float32 logprobs exactly.
    """
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()])
        start += t.numel()
    return out


def seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator of a seeded request (must live on the logits' device)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class BatchPlan:
    """Host-side view of a batch: which stages any row needs, and each row's parameters.

    Disabled settings are encoded as no-ops (top_k = V, top_p = 1, min_p = 0, penalties
    neutral, temperature 1 for greedy rows) so the device stages run row-vectorized.
    """

    def __init__(self, meta: SamplingMetadata, vocab_size: int) -> None:
        self.num_rows = len(meta.params)
        self.vocab_size = v = vocab_size
        self.greedy = [p.greedy for p in meta.params]
        self.all_greedy = all(self.greedy)
        self.all_random = not any(self.greedy)
        self.random_rows = [i for i, g in enumerate(self.greedy) if not g]

        self.temperature = [1.0 if p.greedy else p.temperature for p in meta.params]
        self.top_k = [min(p.effective_top_k, v) or v for p in meta.params]  # 0 (disabled) -> V
        self.top_p = [p.top_p for p in meta.params]
        self.min_p = [p.min_p for p in meta.params]
        rnd = self.random_rows
        self.any_top_k = any(self.top_k[i] < v for i in rnd)
        self.any_top_p = any(self.top_p[i] < 1.0 for i in rnd)
        self.any_min_p = any(self.min_p[i] > 0.0 for i in rnd)
        self.max_top_k = max((self.top_k[i] for i in rnd if self.top_k[i] < v), default=v)

        self.repetition = [p.repetition_penalty for p in meta.params]
        self.frequency = [p.frequency_penalty for p in meta.params]
        self.presence = [p.presence_penalty for p in meta.params]
        self.any_penalty = any(p.needs_penalties for p in meta.params)
        self.any_repetition = any(r != 1.0 for r in self.repetition)

        # min_tokens: (row, token) pairs to ban this step
        self.banned_rows: list[int] = []
        self.banned_tokens: list[int] = []
        for i, (p, out) in enumerate(zip(meta.params, meta.output_token_ids, strict=True)):
            if len(out) >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops.update(meta.eos_token_ids)
            for t in sorted(stops):
                if 0 <= t < v:
                    self.banned_rows.append(i)
                    self.banned_tokens.append(t)

        self.logprob_rows = [i for i, p in enumerate(meta.params) if p.logprobs is not None]
        self.num_logprobs = [meta.params[i].logprobs or 0 for i in self.logprob_rows]
        self.max_logprobs = min(max(self.num_logprobs, default=0), v)

        self.seeded_random_rows = [i for i in rnd if meta.generators[i] is not None]
        self._row_params: RowParams | None = None

    def row_params(self, device: torch.device) -> RowParams:
        """All per-row parameters on ``device``, in one host->device copy (cached)."""
        if self._row_params is None or self._row_params.device != device:
            cols = [self.temperature, self.top_p, self.min_p, self.repetition, self.frequency,
                    self.presence, self.top_k, self.greedy]
            packed = to_device(torch.tensor(cols, dtype=torch.float32).T.contiguous(), device)
            self._row_params = RowParams(device, *packed.unbind(1))
        return self._row_params

    def index_tensor(self, values: list[int], device: torch.device) -> torch.Tensor:
        """int64 indices on ``device``."""
        return to_device(torch.tensor(values, dtype=torch.int64), device)


@dataclass
class RowParams:
    """Per-row parameters on the device, each ``[R]`` (views of one packed float32 tensor).

    top_k (<= V) and the greedy flag are stored as float32, exact for any vocabulary < 2**24.
    """

    device: torch.device
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor
