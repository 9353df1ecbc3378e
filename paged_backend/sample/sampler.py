"""The sampler: logits ``[R, V]`` -> one token id per row (+ raw logprobs), vLLM v1 order.

    raw logits --(logprobs, top-N)-------------------------------------------------+
        |                                                                          |
    allowed ids -> logit_bias -> min_tokens / bad_words bans                       |
      -> repetition -> presence/frequency -----------+-- greedy rows: argmax       |
                                                     +-- random rows: / T -> min_p |
                                                          -> top_k -> top_p ->     |
                                                          exponential race         |
                                                                   |               v
                                     ONE device->host transfer: ids, logprobs, top-N

Row-vectorized, device-agnostic, and free of host syncs until the final transfer.
Seeded rows draw only from their own generator, so a seeded request's tokens do not
depend on what else is in the batch; unseeded rows share the sampler's generator.

A batch whose every row is plain greedy (no penalties, logprobs or active min_tokens)
takes ``Sampler.greedy``: one argmax and one transfer, no per-row host metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_backend.sample.logprobs import (
    compute_prompt_logprobs,
    logprob_dict,
    token_logprobs,
    top_logprobs,
)
from paged_backend.sample.masks import apply_min_p, apply_top_k, apply_top_k_top_p
from paged_backend.sample.metadata import (
    BatchPlan,
    RowSpec,
    SamplerOutput,
    SamplingMetadata,
    fast_greedy_from,
    pack_float64,
    seeded_generator,
    split_flat,
    to_device,
)
from paged_backend.sample.penalties import apply_min_tokens, apply_penalties, token_counts

__all__ = ["DeviceSample", "RowSpec", "Sampler", "SamplerOutput", "SamplingMetadata", "compute_prompt_logprobs",
           "fast_greedy_from", "seeded_generator"]


_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


@dataclass
class DeviceSample:
    """A sampler call's results still on the device (before the one host transfer)."""

    plan: BatchPlan
    token_ids: torch.Tensor  # int64 [R]
    sampled_logprobs: torch.Tensor | None  # float32 [R], raw distribution; None: not asked
    top_ids: torch.Tensor | None  # int64 [len(plan.logprob_rows), plan.max_logprobs]
    top_logprobs: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors there are, in ``Sampler.pack``'s order."""
        return [t for t in (self.token_ids, self.sampled_logprobs, self.top_ids, self.top_logprobs) if t is not None]


class Sampler:
    """Samples one token per logits row; stateless apart from the unseeded rows' generators."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        """The unseeded rows' generator on ``device`` (one per device, seeded with ``seed``)."""
        if device not in self._generators:
            self._generators[device] = seeded_generator(self.seed, device)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample a token for each row of ``logits`` ``[R, V]`` (not modified); one host sync."""
        if logits.dim() != 2 or logits.shape[0] != len(meta.params):
            raise ValueError(f"logits {tuple(logits.shape)} vs {len(meta.params)} rows of metadata")
        if logits.shape[0] == 0:
            return SamplerOutput([], [], [])
        return self.to_output(self.sample_tensors(logits, meta))

    @staticmethod
    def greedy(logits: torch.Tensor) -> list[int]:
        """The fast path: each row's argmax, in one device->host copy, nothing else computed.

        Equal to ``__call__``'s token ids when every row is plain greedy (see
        ``fast_greedy_from``); argmax of bf16/fp16 logits equals argmax of their float32 copy.
        """
        if logits.device.type == "cpu" and logits.dtype in _NUMPY_FLOATS:
            # numpy's vectorized argmax is ~10x faster than torch's on the CPU; same first-max ties
            return logits.detach().numpy().argmax(axis=1).tolist()
        return logits.argmax(dim=-1).tolist()

    def sample_tensors(
        self, logits: torch.Tensor, meta: SamplingMetadata, *, sampled_logprobs: bool = True
    ) -> DeviceSample:
        """Everything on the device, no host sync: tokens, their raw logprobs, top-N.

        ``sampled_logprobs=False``: the sampled tokens' logprobs only when a row asks for
        logprobs (the engine reads them for those rows only); otherwise None, and no
        log-sum-exp pass over the logits.
        """
        plan = BatchPlan(meta, logits.shape[1])
        device = logits.device
        raw = logits.float()

        x = self._apply_history(raw, plan, meta, device)
        token_ids = x.argmax(dim=-1) if not plan.all_random else None
        if not plan.all_greedy:
            random_ids = self._sample_random(x, plan, meta, device)
            if token_ids is None:
                token_ids = random_ids
            else:
                is_greedy = plan.row_params(device).greedy > 0
                token_ids = torch.where(is_greedy, token_ids, random_ids)
        return self._logprobs(raw, token_ids, plan, device, sampled_logprobs or bool(plan.logprob_rows))

    def _apply_history(
        self, x: torch.Tensor, plan: BatchPlan, meta: SamplingMetadata, device: torch.device
    ) -> torch.Tensor:
        """allowed_token_ids masks, logit_bias, min_tokens and bad_words bans (-inf: the bias order does not
        matter to them), then repetition / presence / frequency penalties (vLLM's order)."""
        if plan.allowed_rows:
            rows = plan.index_tensor(plan.allowed_rows, device)
            keep = torch.zeros((len(plan.allowed_rows), x.shape[1]), dtype=torch.bool, device=device)
            pairs = plan.index_tensor([c for p in plan.allowed_pairs for c in p], device).view(-1, 2)
            keep[pairs[:, 0], pairs[:, 1]] = True
            x = x.index_put((rows,), x[rows].masked_fill(~keep, float("-inf")))
        if plan.bias_rows:
            rows = plan.index_tensor(plan.bias_rows, device)
            toks = plan.index_tensor(plan.bias_tokens, device)
            vals = to_device(torch.tensor(plan.bias_values, dtype=x.dtype), device)
            x = x.index_put((rows, toks), vals, accumulate=True)
        if plan.banned_rows:
            rows = plan.index_tensor(plan.banned_rows, device)
            toks = plan.index_tensor(plan.banned_tokens, device)
            x = apply_min_tokens(x, rows, toks)
        if plan.any_penalty:
            # only rows with penalties contribute tokens; prompts only for repetition
            out_ids = [o if n else [] for o, n in zip(meta.output_token_ids, plan.needs_penalties, strict=True)]
            prompt_ids = [p if r != 1.0 else [] for p, r in
                          zip(meta.prompt_token_ids, plan.repetition, strict=True)]
            lists = out_ids + prompt_ids if plan.any_repetition else out_ids
            counts = token_counts(lists, plan.vocab_size, device)  # one copy, one scatter
            n = plan.num_rows
            prompt_counts = counts[n:] if plan.any_repetition else None
            rp = plan.row_params(device)
            x = apply_penalties(x, prompt_counts, counts[:n], rp.repetition, rp.frequency, rp.presence)
        return x

    def _sample_random(
        self, x: torch.Tensor, plan: BatchPlan, meta: SamplingMetadata, device: torch.device
    ) -> torch.Tensor:
        """Temperature, min-p, top-k/top-p, then an exponential race (Gumbel-max on probs).

        ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. picks token i with probability
        ``probs[i]``; each seeded row's ``q`` comes from its own generator. Without min-p /
        top-k / top-p, ``argmax(x / T - log q)``: the same race on log-probabilities (they
        differ from ``x / T`` by a per-row constant), no softmax.
        """
        rp = plan.row_params(device)
        x = x / rp.temperature.unsqueeze(1)
        truncated = plan.any_min_p or plan.any_top_k or plan.any_top_p
        if plan.any_min_p:
            x = apply_min_p(x, rp.min_p)
        k = rp.top_k if plan.any_top_k else None
        if plan.any_top_p:
            x = apply_top_k_top_p(x, k, rp.top_p)
        elif k is not None:
            x = apply_top_k(x, k, plan.max_top_k)

        q = torch.empty_like(x)
        if len(plan.seeded_random_rows) < len(plan.random_rows):
            q.exponential_(generator=self._shared_generator(device))
        for i in plan.seeded_random_rows:
            gen = meta.generators[i]
            assert gen is not None
            if gen.device.type != device.type:
                raise ValueError(f"row {i}: generator on {gen.device}, logits on {device}")
            q[i].exponential_(generator=gen)
        # q == 0 would turn a masked token (prob 0) into 0/0 = nan (log: -inf - -inf), which argmax picks
        q = q.clamp_min_(torch.finfo(q.dtype).tiny)
        if not truncated:
            return x.sub_(q.log_()).argmax(dim=-1)  # x is this function's own tensor
        return (x.softmax(dim=-1) / q).argmax(dim=-1)

    def _logprobs(
        self, raw: torch.Tensor, token_ids: torch.Tensor, plan: BatchPlan, device: torch.device, sampled: bool
    ) -> DeviceSample:
        """Raw logprobs of the sampled tokens (``sampled``), and top-N for the rows asking."""
        if not sampled:
            return DeviceSample(plan, token_ids, None, None, None)
        lse = torch.logsumexp(raw, dim=-1)
        sampled_lp = token_logprobs(raw, lse, token_ids)
        top_ids = top_lp = None
        rows = plan.logprob_rows
        if rows and plan.max_logprobs > 0:
            if len(rows) < plan.num_rows:
                idx = plan.index_tensor(rows, device)
                raw, lse = raw.index_select(0, idx), lse.index_select(0, idx)
            top_ids, top_lp = top_logprobs(raw, lse, plan.max_logprobs)
        return DeviceSample(plan, token_ids, sampled_lp, top_ids, top_lp)

    @staticmethod
    def to_output(d: DeviceSample) -> SamplerOutput:
        """ONE device->host transfer (a sync), then per-row Python objects."""
        return Sampler.unpack(d, Sampler.pack(d).tolist())

    @staticmethod
    def pack(d: DeviceSample) -> torch.Tensor:
        """A sample's tensors as one flat float64 tensor on their device, for one transfer."""
        return pack_float64(*d.tensors())

    @staticmethod
    def unpack(d: DeviceSample, flat: list[float]) -> SamplerOutput:
        """``pack``'s values, read back on the host, as per-row Python objects."""
        parts = split_flat(flat, d.tensors())
        ids = [int(t) for t in parts[0]]
        if d.sampled_logprobs is None:
            return SamplerOutput(sampled_token_ids=ids, sampled_logprobs=None, logprobs=[None] * len(ids))
        sampled_lp = parts[1]
        top_ids_h, top_lp_h = (parts[2], parts[3]) if len(parts) == 4 else ([], [])
        plan, num = d.plan, d.plan.max_logprobs
        logprobs: list[dict[int, float] | None] = [None] * plan.num_rows
        for j, (row, k) in enumerate(zip(plan.logprob_rows, plan.num_logprobs, strict=True)):
            span = slice(j * num, (j + 1) * num)
            logprobs[row] = logprob_dict(top_ids_h[span], top_lp_h[span], k, ids[row], sampled_lp[row])
        return SamplerOutput(sampled_token_ids=ids, sampled_logprobs=sampled_lp, logprobs=logprobs)
