"""The draft-model proposer: a smaller checkpoint with the target's vocabulary drafts greedily.

Its KV cache has the target's block ids (same block tables, its own tensors): it is loaded before
the target sizes its cache (``load_draft_runner``), so the budget is divided by the target's plus
the draft's bytes per block id, and it allocates the target's block count. It runs every step the target runs (``observe``),
so its cache holds every computed position, prefix hits and recomputes included; after a step,
``propose`` allocates the lookahead slots of each decoding request and runs k one-token passes, each
reading the previous pass's argmax on the device (the host reads the drafts once, after the last pass).
Its proposals are its argmax: a deterministic proposal is a one-hot draft distribution, so the
engine's acceptance (``spec_decode/acceptance.py``) keeps the target's distribution.
"""

from __future__ import annotations

import torch

from paged_backend.config import EngineConfig
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request
from paged_backend.core.scheduler import ScheduledRequest, SchedulerOutput
from paged_backend.models.default_model import resolve_model_path
from paged_backend.models.model_info import ModelInfo
from paged_backend.worker.model_runner import ModelRunner


def load_draft_runner(config: EngineConfig, target_info: ModelInfo, device: torch.device, dtype: torch.dtype,
                      max_model_len: int) -> ModelRunner:
    """The draft checkpoint's runner, its cache not allocated yet (``bytes_per_block`` is known)."""
    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative_config method 'draft_model' is not supported with tensor_parallel_size > 1")
    model_dir = resolve_model_path(spec.model)
    info = ModelInfo.from_dir(model_dir)
    if info.vocab_size != target_info.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({info.vocab_size}) differs from the target's "
                         f"({target_info.vocab_size})")
    # the target's context: a draft whose positions stop short is refused here (resolve_limits)
    draft_config = config.model_copy(update={"model": str(model_dir), "quantization": None,
                                             "speculative_config": None, "max_model_len": max_model_len})
    return ModelRunner(draft_config, model_dir, info, device, dtype)


def allocate_lookahead(kv: KVCacheManager, req: Request, n: int) -> bool:
    """Slots for ``n`` lookahead positions from ``req.num_computed_tokens`` (the last known token's, then the
    drafts'), written by the proposer's passes but not by the target until a verification step computes them.

    Refused (no room, or) when the last known token ends a block: the allocation would enter that block in the
    prefix cache (its tokens are all known) while the target's KV of its last slot is not written yet, and a
    request that hits it before the verification runs (this one preempted meanwhile, say) would read that
    slot unwritten."""
    if kv.enable_caching and (req.num_computed_tokens + 1) % kv.block_size == 0:
        return False
    return kv.allocate_slots(req, n) is not None


def apply_lookahead_copies(kv: KVCacheManager, target: ModelRunner, draft: ModelRunner | None = None) -> None:
    """The copies that lookahead allocations queued, run now, before the passes write: the cached blocks they
    evicted written back to the host tier first (a block is reused at once, by a copy-on-write below or a
    pass; left for the next step's plan, its write-back would copy what was written since), then the
    copy-on-write of shared last blocks, in every cache (the draft model's too)."""
    write_backs, loads = kv.take_pending_swaps()
    assert not loads, "a lookahead allocation loads no prefix hit"
    if write_backs:
        target.swap_blocks(write_backs, [])
    copies = kv.take_pending_copies()
    if copies:
        target.copy_blocks(copies)
        if draft is not None:
            draft.copy_blocks(copies)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, runner: ModelRunner, target: ModelRunner, kv: KVCacheManager) -> None:
        """``runner``: the draft's (``load_draft_runner``); ``target``: its cache already allocated."""
        spec = config.speculative_config
        assert spec is not None
        self.runner = runner
        self.k = spec.num_speculative_tokens
        # its CUDA graphs: the target's verification steps (1 + k tokens a request, observed) beside decode steps
        runner.graph_query_lens_extra = (1 + self.k,)
        self.runner.allocate_kv_cache(target.num_blocks)
        self.target = target
        self.kv = kv

    def observe(self, sched: SchedulerOutput) -> None:
        """The target's step through the draft model: its KV for the same slots (no logits)."""
        self.runner.execute_kv_only(sched)

    def propose(self, requests: list[Request], max_model_len: int) -> None:
        """Drafts for these decoding requests (all tokens computed but the last), k passes batched."""
        kv = self.kv
        entries: list[tuple[Request, int]] = []
        for req in requests:
            k = min(self.k, req.max_tokens - len(req.output_token_ids) - 1, max_model_len - len(req.all_token_ids) - 1)
            req.spec_token_ids = []
            if k > 0 and allocate_lookahead(kv, req, k):  # the passes write positions p .. p + k - 1
                entries.append((req, k))
        apply_lookahead_copies(kv, self.target, self.runner)
        # pass j's input is pass j - 1's argmax, copied on the device (a placeholder token, as async scheduling's):
        # the host waits once, for all the passes' drafts
        passes: list[tuple[list[Request], torch.Tensor]] = []
        prev: tuple[list[str], torch.Tensor] | None = None
        for j in range(max((k for _, k in entries), default=0)):
            live = [req for req, k in entries if k > j]
            sched = SchedulerOutput([ScheduledRequest.lookahead(
                req.request_id, len(req.all_token_ids) - 1 + j, -1 if j else req.all_token_ids[-1],
                kv.req_block_ids[req.request_id]) for req in live])
            out = self.runner.execute(sched, prev)
            drafts = out.logits.argmax(dim=-1)
            passes.append((live, drafts))
            prev = (out.sample_request_ids, drafts)
        if not passes:
            return
        tokens = iter(torch.cat([d for _, d in passes]).tolist())
        for live, _ in passes:
            for req in live:
                req.spec_token_ids.append(next(tokens))
