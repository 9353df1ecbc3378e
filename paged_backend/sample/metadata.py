"""Hand-off types between the engine and the sampler, and the per-batch parameter plan.

``SamplingMetadata`` is what the engine passes (one entry per logits row);
``BatchPlan`` turns it, on the host, into flags (which stages run at all) and into
per-row parameter tensors copied to the device without a host sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.core.request import Request


class RowSpec(NamedTuple):
    """One request's sampling parameters as the batch plan reads them, derived once.

    A tuple, so that a batch's columns come out of ``zip(*specs)`` in C instead of a
    Python loop of property calls per row and parameter. The engine keeps one per request
    (its parameters do not change while it runs); ``RowSpec.of`` derives it.
    """

    greedy: bool
    temperature: float  # 1.0 for greedy rows (they skip the temperature stage)
    top_k: int  # 0 = disabled
    top_p: float
    min_p: float
    repetition: float
    frequency: float
    presence: float
    needs_penalties: bool
    logprobs: int | None
    min_tokens: int
    min_tokens_bans: tuple[int, ...]  # stop / EOS ids banned while output < min_tokens, sorted
    logit_bias: tuple[tuple[int, float], ...]  # (token, bias) pairs added to the logits
    allowed: tuple[int, ...] | None  # the only token ids that may be sampled; None: all
    # bad_words as token sequences: the last token of one is banned while the output ends with the rest
    bad_words: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, p: SamplingParams, eos_token_ids: tuple[int, ...],
           bad_words: tuple[tuple[int, ...], ...] = ()) -> RowSpec:
        """``bad_words``: ``p.bad_words`` tokenized (``bad_words_token_ids``); the sampler has no tokenizer."""
        bans: set[int] = set()
        if p.min_tokens > 0:
            bans.update(p.stop_token_ids)
            if not p.ignore_eos:
                bans.update(eos_token_ids)
        greedy = p.greedy
        return cls(greedy, 1.0 if greedy else p.temperature, p.effective_top_k, p.top_p, p.min_p,
                   p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.needs_penalties,
                   p.logprobs, p.min_tokens, tuple(sorted(bans)), tuple(sorted((p.logit_bias or {}).items())),
                   None if p.allowed_token_ids is None else tuple(sorted(set(p.allowed_token_ids))), bad_words)


@dataclass
class SamplingMetadata:
    """Per-row inputs of one sampler call; every list has one entry per logits row."""

    params: list[SamplingParams]
    # per row: the request's own generator (seeded requests, on the logits' device); None = unseeded
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]  # repetition penalty covers prompt + output (HF / vLLM)
    output_token_ids: list[list[int]]  # presence/frequency penalties and min_tokens
    eos_token_ids: tuple[int, ...]
    # per row: RowSpec.of(params[i], eos_token_ids), when the caller keeps them; None: derived here
    specs: list[RowSpec] | None = None

    def __post_init__(self) -> None:
        n = len(self.params)
        lens = (len(self.generators), len(self.prompt_token_ids), len(self.output_token_ids))
        if self.specs is not None:
            lens += (len(self.specs),)
        if any(m != n for m in lens):
            raise ValueError(f"SamplingMetadata lists differ in length: params={n}, others={lens}")

    def row_specs(self) -> list[RowSpec]:
        if self.specs is None:
            self.specs = [RowSpec.of(p, self.eos_token_ids) for p in self.params]
        return self.specs

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
    # raw-distribution logprob of the sampled token; None when not asked (``sample_tensors``)
    sampled_logprobs: list[float] | None
    # top-N raw logprobs (descending) then the sampled token if not among them; None if not asked
    logprobs: list[dict[int, float] | None]


def fast_greedy_from(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> int | None:
    """From how many output tokens on a request's row may skip the sampler's stages; None: never.

    Such a row's token is the argmax of its raw logits, exactly what the full sampler picks:
    greedy, no penalties, logit bias, allowed-token mask or bad words (they change the logits) and no logprobs
    (nothing else to compute).
    ``min_tokens`` bans stop / EOS ids only while the output is shorter, and only if there are
    any (``ignore_eos`` without ``stop_token_ids`` bans nothing).
    """
    if (not params.greedy or params.needs_penalties or params.logprobs is not None or params.biases_logits
            or params.bad_words):
        return None
    bans = bool(params.stop_token_ids) or (not params.ignore_eos and bool(eos_token_ids))
    return params.min_tokens if bans else 0


def bad_word_bans(words: tuple[tuple[int, ...], ...], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens ``bad_words`` ban next (vLLM's rule): the last token of each word whose other tokens end
    the output so far (a one-token word always); only the output counts, never the prompt."""
    out = []
    n = len(output_token_ids)
    for word in words:
        k = len(word) - 1
        if k > n:
            continue
        if k == 0 or list(output_token_ids[n - k:]) == list(word[:k]):
            out.append(word[-1])
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a freshly built CPU tensor to ``device`` without blocking the host (pinned on CUDA)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def pack_float64(*tensors: torch.Tensor) -> torch.Tensor:
    """The tensors flattened into one float64 tensor on their device, for ONE transfer.

    float64 holds token ids (< 2**53) and float32 logprobs exactly.
    """
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])


def split_flat(flat: list[float], tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """``pack_float64(*tensors)``'s values, read back as a list, cut into one list per tensor."""
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()])
        start += t.numel()
    return out


def to_host(*tensors: torch.Tensor) -> list[list[float]]:
    """Flatten tensors into float64 and read them back in ONE device->host transfer."""
    if not tensors:
        return []
    return split_flat(pack_float64(*tensors).tolist(), tensors)


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
        specs = meta.row_specs()
        self.num_rows = n = len(specs)
        self.vocab_size = v = vocab_size
        (greedy, temperature, top_k, top_p, min_p, repetition, frequency, presence, needs_penalties,
         logprobs, min_tokens, bans, biases, allowed, bad_words) = (zip(*specs, strict=True) if n else
                                                                    ((),) * len(RowSpec._fields))
        self.greedy = greedy
        self.all_greedy = all(greedy)
        self.all_random = not any(greedy)
        self.random_rows = [i for i, g in enumerate(greedy) if not g]

        self.temperature = temperature
        self.top_k = [min(k, v) or v for k in top_k]  # 0 (disabled) -> V
        self.top_p = top_p
        self.min_p = min_p
        rnd = self.random_rows
        tk = self.top_k
        self.any_top_k = any(tk[i] < v for i in rnd)
        self.any_top_p = any(top_p[i] < 1.0 for i in rnd)
        self.any_min_p = any(min_p[i] > 0.0 for i in rnd)
        self.max_top_k = max((tk[i] for i in rnd if tk[i] < v), default=v)

        self.repetition = repetition
        self.frequency = frequency
        self.presence = presence
        self.needs_penalties = needs_penalties
        self.any_penalty = any(needs_penalties)
        self.any_repetition = any(r != 1.0 for r in repetition)

        # min_tokens and bad_words: (row, token) pairs to ban this step
        self.banned_rows: list[int] = []
        self.banned_tokens: list[int] = []
        outs = meta.output_token_ids
        if any(bans):
            for i, (m, row_bans) in enumerate(zip(min_tokens, bans, strict=True)):
                if row_bans and len(outs[i]) < m:
                    for t in row_bans:
                        if 0 <= t < v:
                            self.banned_rows.append(i)
                            self.banned_tokens.append(t)
        if any(bad_words):
            for i, words in enumerate(bad_words):
                for t in bad_word_bans(words, outs[i]):
                    if 0 <= t < v:
                        self.banned_rows.append(i)
                        self.banned_tokens.append(t)

        # logit_bias: (row, token, bias) triples; allowed_token_ids: (row, token) pairs kept in masked rows
        self.bias_rows: list[int] = []
        self.bias_tokens: list[int] = []
        self.bias_values: list[float] = []
        for i, pairs in enumerate(biases):
            for t, b in pairs:
                if t < v:
                    self.bias_rows.append(i)
                    self.bias_tokens.append(t)
                    self.bias_values.append(b)
        self.allowed_rows = [i for i, a in enumerate(allowed) if a is not None]
        self.allowed_pairs = [(j, t) for j, i in enumerate(self.allowed_rows) for t in allowed[i] if t < v]

        self.logprob_rows = [i for i, lp in enumerate(logprobs) if lp is not None]
        self.num_logprobs = [logprobs[i] or 0 for i in self.logprob_rows]
        self.max_logprobs = min(max(self.num_logprobs, default=0), v)

        gens = meta.generators
        self.seeded_random_rows = [i for i in rnd if gens[i] is not None]
        self._row_params: RowParams | None = None

    def row_params(self, device: torch.device) -> RowParams:
        """All per-row parameters on ``device``, in one host->device copy (cached)."""
        if self._row_params is None or self._row_params.device != device:
            cols = [self.temperature, self.top_p, self.min_p, self.repetition, self.frequency,
                    self.presence, self.top_k, self.greedy]
            # numpy packs Python floats ~3x faster than torch.tensor
            packed = to_device(torch.from_numpy(np.array(cols, dtype=np.float32).T.copy()), device)
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
