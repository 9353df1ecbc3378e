"""The multi-token-prediction proposer: the target checkpoint's MTP layers (models/mtp.py) draft greedily.

An MTP layer at position i reads the target's hidden state h_i (before its final norm) and the token t_{i+1},
and predicts t_{i+2}; its own KV cache is one more cache layer of the target's runner (same block ids, counted
in the target's ``bytes_per_block``, copied and swapped with the target's layers). So after each step, once
its tokens are known (``propose``):

- one MTP pass covers every position the target computed in the step and kept (prefill chunks, decode steps,
  the accepted part of a verification step): position i with t_{i+1} and the step's h_i; a request decoding
  (all tokens computed but the last, t_P at P) gets its first draft from its row at P - 1;
- then k - 1 one-token passes (lookahead slots allocated as a draft model's are) at P, P + 1, ...: each the
  previous draft with the previous pass's MTP hidden state (vLLM's order), the layers reused in turn.

The MTP KV of position i is thus written once t_{i+1} is known, and a verification step rewrites the lookahead
positions it keeps. A request not scheduled in a step keeps the drafts it had. Drafts are the MTP logits'
argmax: a one-hot draft distribution (``spec_decode/acceptance.py`` keeps the target's distribution).

The passes name hidden-state rows, never tensors: the runner keeps the step's hidden states and each pass's, so
under tensor parallelism every rank runs the same passes (the runner mirrors them) on its own hidden states,
and rank 0 gets the gathered full-vocabulary logits.
"""

from __future__ import annotations

import torch

from paged_backend.config import EngineConfig
from paged_backend.core.request import Request
from paged_backend.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from paged_backend.engine.draft_model import allocate_lookahead, apply_lookahead_copies
from paged_backend.models.model_info import ModelInfo
from paged_backend.sample.sampler import Sampler
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.tensor_parallel import TensorParallelRunner


def check_mtp_config(config: EngineConfig, info: ModelInfo) -> None:
    """Method ``mtp`` needs a checkpoint with MTP layers."""
    if info.num_mtp_layers <= 0:
        raise ValueError(
            f"speculative_config method 'mtp' needs a checkpoint with multi-token-prediction layers "
            f"(num_nextn_predict_layers > 0 in its config.json, a DeepSeek-V3 / GLM-4.5-family model); "
            f"{config.model} ({info.architecture}) has none")


def _span(request_id: str, start: int, token_ids: list[int], block_ids: list[int], samples: bool
          ) -> ScheduledRequest:
    """``token_ids`` at positions ``start``.. on the request's blocks, outside the scheduler's plan (the MTP
    pass over positions the target computed); its last row sampled when ``samples``."""
    s = ScheduledRequest.__new__(ScheduledRequest)
    s.request_id, s.start_pos, s.num_new_tokens, s.block_ids = request_id, start, len(token_ids), block_ids
    s.token_ids, s.samples, s.num_prompt_logits, s.num_draft = token_ids, samples, 0, 0
    return s


class MTPProposer:
    def __init__(self, config: EngineConfig, runner: ModelRunner | TensorParallelRunner, scheduler: Scheduler,
                 keep_hidden: bool = False) -> None:
        """``runner``: the target's, built with its MTP layers (``speculative_config`` method ``mtp``).
        ``keep_hidden`` (async scheduling): each step keeps its own hidden states, since the next step's forward
        replaces the runner's before this step's tokens land (one process: async is refused under TP)."""
        spec = config.speculative_config
        assert spec is not None
        self.runner = runner
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.k = spec.num_speculative_tokens
        self.keep_hidden = keep_hidden
        # the observed steps' plans (by id) whose tokens have not landed, with their hidden states when kept
        self._steps: dict[int, tuple[SchedulerOutput, torch.Tensor | None]] = {}

    def observe(self, sched: SchedulerOutput) -> None:
        """The target's step: its plan, for ``propose`` once its tokens are sampled (synchronous: the runner's
        last forward is this step's until then)."""
        hidden = self.runner.last_hidden_states() if self.keep_hidden else None
        self._steps[id(sched)] = (sched, hidden)

    def propose(self, requests: list[Request], max_model_len: int, landed: list[SchedulerOutput]) -> None:
        """The MTP pass over each landed step's kept positions, then drafts for ``requests`` (decoding) that
        step computed."""
        for sched in landed:
            step = self._steps.pop(id(sched), None)
            if step is not None:
                self._propose_step(step[0], step[1], requests, max_model_len)

    def _propose_step(self, sched: SchedulerOutput, hidden: torch.Tensor | None, requests: list[Request],
                      max_model_len: int) -> None:
        if hidden is not None:  # the step's own hidden states, where execute_mtp reads the last forward's
            self.runner.restore_hidden_states(hidden)
        running = {r.request_id: r for r in self.scheduler.running}
        wanted = {r.request_id for r in requests}
        spans: list[ScheduledRequest] = []
        rows: list[int] = []  # the step's hidden-state rows the pass reads
        drafting: list[Request] = []  # in the order of the pass's sampled rows
        end = 0
        for s in sched.scheduled:
            first, end = end, end + s.num_new_tokens
            req = running.get(s.request_id)
            if req is None:  # finished or aborted in this step
                continue
            start = s.start_pos
            n = min(s.num_new_tokens, req.num_computed_tokens - start)  # a verification's rejected drafts: gone
            if n <= 0:
                continue
            tokens = req.all_token_ids[start + 1 : start + n + 1]
            if len(tokens) != n:
                raise RuntimeError(f"request {req.request_id}: {len(tokens)} next tokens for {n} MTP positions")
            # the step that computed the request's last position drafts (two landed at once: not the earlier)
            samples = req.request_id in wanted and start + n == req.num_computed_tokens
            spans.append(_span(req.request_id, start, tokens, self.kv.get_block_ids(req.request_id), samples))
            rows += range(first, first + n)
            req.spec_token_ids = []
            if samples:
                drafting.append(req)
        if not spans:
            return
        logits = self.runner.execute_mtp(SchedulerOutput(spans), rows, 0)
        if drafting:
            self._draft(drafting, logits, max_model_len)

    def _draft(self, drafting: list[Request], logits: torch.Tensor, max_model_len: int) -> None:
        """First drafts from the pass's sampled rows, then the one-token passes for the rest."""
        kv = self.kv
        entries: list[tuple[Request, int, int]] = []  # (request, drafts wanted, its row of the last pass's)
        for row, (req, tok) in enumerate(zip(drafting, Sampler.greedy(logits), strict=True)):
            k = min(self.k, req.max_tokens - len(req.output_token_ids) - 1, max_model_len - len(req.all_token_ids) - 1)
            if k <= 0:
                continue
            req.spec_token_ids = [tok]
            # the passes write positions P .. P + k - 2: without room, the first draft alone
            if k > 1 and allocate_lookahead(kv, req, k - 1):
                entries.append((req, k, row))
        apply_lookahead_copies(kv, self.runner)  # every cache layer, the MTP layers' included
        for j in range(1, max((k for _, k, _ in entries), default=0)):
            entries = [e for e in entries if e[1] > j]
            sched = SchedulerOutput([ScheduledRequest.lookahead(
                req.request_id, len(req.all_token_ids) - 2 + j, req.spec_token_ids[-1], kv.req_block_ids[req.request_id])
                for req, _, _ in entries])
            logits = self.runner.execute_mtp(sched, [row for _, _, row in entries], j)
            for req, tok in zip((e[0] for e in entries), Sampler.greedy(logits), strict=True):
                req.spec_token_ids.append(tok)
            entries = [(req, k, i) for i, (req, k, _) in enumerate(entries)]
