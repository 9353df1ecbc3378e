"""Beam search as an outer loop over one-token requests, like vLLM v1's ``LLM.beam_search``.

Each round, every live beam of every prompt is one request of ``prompt + beam tokens``
with ``max_tokens=1``; the prefix cache serves the shared full blocks (by reference), so
only the tail is recomputed. The selection rules follow transformers' ``_beam_search``
(``early_stopping=False``) so results equal ``generate(num_beams=k)``:

- keep the top ``2k`` continuations over all beams (scores are sums of log-probs);
- those of the top ``k`` that end in EOS (or reach max length) become finished
  hypotheses scored ``sum / generated_len ** length_penalty``; the best ``k`` finished
  are kept;
- the best ``k`` continuations that did not stop are the next beams;
- stop when ``k`` hypotheses are finished and the best beam, length-normalised at the
  current length, cannot beat the worst of them, or nothing can continue.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from paged_backend.engine.llm_engine import LLMEngine
from paged_backend.outputs import CompletionOutput, RequestOutput, Usage
from paged_backend.sampling_params import RequestOutputKind, SamplingParams

_NEG = -1.0e9


@dataclass
class BeamState:
    """One prompt's beam search: its beams, its finished hypotheses, and the rules between rounds.

    Engine-neutral: ``BeamSearchRunner`` (``LLM``) and ``AsyncEngine.beam_search`` (the adapters) run
    each round's requests (``round_requests``) their own way and hand the logprobs to ``select``.
    """

    prompt: str | list[int]
    prompt_ids: list[int]
    params: SamplingParams
    width: int
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0
    beams: list[tuple[list[int], float]] = field(default_factory=list)  # (tokens, running score)
    finished: list[tuple[float, list[int]]] = field(default_factory=list)  # (normalized score, tokens)
    improvable: bool = True
    done: bool = False
    aborted: bool = False

    @classmethod
    def start(cls, prompt: str | list[int], prompt_ids: list[int], params: SamplingParams,
              eos_token_ids: tuple[int, ...], max_model_len: int) -> BeamState:
        return cls(prompt, list(prompt_ids), params, max(params.beam_width, params.n), tuple(eos_token_ids),
                   max_model_len, beams=[([], 0.0)])

    def round_params(self) -> SamplingParams:
        """The parameters of each beam's one-token request: greedy, the top ``2 * width`` raw logprobs."""
        return self.params.model_copy(update=dict(
            n=1, max_tokens=1, min_tokens=0, temperature=0.0, logprobs=2 * self.width, seed=None,
            use_beam_search=False, stop=[], detokenize=False, ignore_eos=True, prompt_logprobs=None,
            output_kind=RequestOutputKind.DELTA,
        ))

    def round_requests(self) -> list[list[int]]:
        """The prompt of each live beam's request this round (``round_params``), in beam order."""
        return [self.prompt_ids + toks for toks, _ in self.beams]

    def select(self, beam_logprobs: list[dict[int, float]]) -> None:
        """Rank the round's continuations (one logprobs dict per beam, in beam order); see the module."""
        st = self
        k, lp_pen = st.width, st.params.length_penalty
        eos = set() if st.params.ignore_eos else set(st.eos_token_ids)
        eos |= set(st.params.stop_token_ids)
        cur_gen = len(st.beams[0][0])
        max_new = st.params.max_tokens or (st.max_model_len - len(st.prompt_ids))
        # accumulate in float32 like transformers, then rank
        cands = []
        for b, ((_toks, score), lps) in enumerate(zip(st.beams, beam_logprobs, strict=True)):
            for tok, lp in lps.items():
                total = float(torch.tensor(lp, dtype=torch.float32) + torch.tensor(score, dtype=torch.float32))
                cands.append((total, b, tok))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[: 2 * k]
        hits = [(tok in eos) or (cur_gen + 1 >= max_new) for _, _, tok in cands]
        # finished hypotheses: only from the top k, only while improvement is possible
        if st.improvable:
            norm = float(cur_gen + 1) ** lp_pen
            for (score, b, tok), hit in list(zip(cands, hits, strict=True))[:k]:
                if hit:
                    st.finished.append((score / norm, st.beams[b][0] + [tok]))
            st.finished.sort(key=lambda f: -f[0])
            del st.finished[k:]
        running = sorted(
            ((score + (_NEG if hit else 0.0), b, tok) for (score, b, tok), hit in zip(cands, hits, strict=True)),
            key=lambda c: -c[0],
        )[:k]
        new_beams = [(st.beams[b][0] + [tok], score) for score, b, tok in running]
        st.beams = new_beams
        if st.improvable and len(st.finished) >= k:
            best_possible = new_beams[0][1] / (float(cur_gen + 1) ** lp_pen)
            if not best_possible > st.finished[-1][0]:
                st.improvable = False
        if not st.improvable or all(hits):
            st.done = True

    def abort(self) -> None:
        """End the search now (a round's request was aborted): the output holds what there is, as "abort"."""
        self.aborted = self.done = True

    def output(self, request_id: str, tokenizer: Any) -> RequestOutput:
        """The best ``n`` hypotheses as one finished output (texts decoded when there is a tokenizer)."""
        st = self
        n = st.params.n
        hyps = st.finished[:n]
        if st.aborted and len(hyps) < n:  # the running beams, length-normalized, fill the rest
            lp_pen = st.params.length_penalty
            hyps = hyps + [(score / max(1.0, float(len(toks))) ** lp_pen, toks) for toks, score in st.beams
                           if toks][: n - len(hyps)]
        stops = set(st.eos_token_ids) | set(st.params.stop_token_ids)
        outs = []
        for idx, (score, toks) in enumerate(hyps):
            text = tokenizer.decode(toks, skip_special_tokens=st.params.skip_special_tokens) if tokenizer else ""
            stopped = bool(toks) and toks[-1] in stops
            reason = "abort" if st.aborted else "stop" if stopped else "length"
            outs.append(CompletionOutput(index=idx, text=text, token_ids=list(toks), finish_reason=reason,
                                         cumulative_logprob=score, num_output_tokens=len(toks)))
        usage = Usage(len(st.prompt_ids), sum(len(o.token_ids) for o in outs))
        prompt = st.prompt if isinstance(st.prompt, str) else None
        return RequestOutput(request_id, prompt, st.prompt_ids, outs, True, usage)


class BeamSearchRunner:
    """Beam search on an ``LLMEngine`` stepped here (the offline ``LLM``)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def run(self, prompts: list[str | list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        states = []
        for prompt, p in zip(prompts, params, strict=True):
            prep = self.engine.process_input("beam-check", prompt, p)  # validates lengths once
            states.append(BeamState.start(prompt, prep.prompt_token_ids, p, self.engine.eos_token_ids,
                                          self.engine.max_model_len))
        while any(not s.done for s in states):
            self._round([s for s in states if not s.done])
        return [s.output(f"beam-search-{i}", self.engine.tokenizer) for i, s in enumerate(states)]

    def _round(self, states: list[BeamState]) -> None:
        requests: dict[str, tuple[BeamState, int]] = {}
        for st in states:
            one = st.round_params()
            for b, ids in enumerate(st.round_requests()):
                rid = f"beam-{next(self._ids)}"
                self.engine.add_request(rid, ids, one)
                requests[rid] = (st, b)
        logprobs: dict[tuple[int, int], dict[int, float]] = {}
        while len(logprobs) < len(requests):
            for out in self.engine.step():
                if out.request_id in requests and out.finished:
                    st, b = requests[out.request_id]
                    logprobs[(id(st), b)] = out.outputs[0].logprobs[0]
        for st in states:
            st.select([logprobs[(id(st), b)] for b in range(len(st.beams))])
