"""Turns a SchedulerOutput into model inputs, runs the model over the paged KV cache and
returns the logits rows the engine samples from.

Per step it builds (step_inputs.py; attention/backend.py has the index math)::

    input_ids, positions   [T]          the new tokens of every scheduled request, concatenated
    slot_mapping           [T]  int64   block_ids[pos // bs] * bs + pos % bs
    block_tables           [S, maxblk]  int32 (entries past a request's blocks are never read)
    seq_lens, query_start_loc           int32

On CUDA, decode steps and speculative decoding's verification steps (1 + k tokens a request, fewer
for some requests spread over those rows) of up to ``max_cudagraph_capture_size`` requests replay a
captured CUDA graph (cuda_graphs.py) instead of launching the model's kernels one by one.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from paged_backend.attention import AttentionMetadata, get_attention_backend
from paged_backend.attention.kv_cache_spec import KVCacheSpec
from paged_backend.config import EngineConfig, resolve_limits
from paged_backend.core.scheduler import SchedulerOutput
from paged_backend.kernels.fp8_types import FP8_DTYPE
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.ops import get_kernel_ops
from paged_backend.models.parallel import local_heads
from paged_backend.worker.cuda_graphs import DecodeGraphs
from paged_backend.worker.host_kv_tier import HostKVTier
from paged_backend.worker.model_loader import load_model
from paged_backend.worker.runner import ModelOutput
from paged_backend.worker.step_inputs import PendingTokens, StepInputBuilder, StepInputs

if TYPE_CHECKING:
    from paged_backend.distributed import PPStage, TPGroup

logger = logging.getLogger(__name__)


class ModelRunner:
    """The whole model (or one tensor-parallel rank's slice of it) in this process; implements
    ``ModelRunnerProtocol``."""

    takes_pending_tokens = True  # ``execute``'s ``prev`` may hold ``PendingTokens``

    def __init__(self, config: EngineConfig, model_dir, info: ModelInfo, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup | None = None, pp: PPStage | None = None):
        self.config = config
        self.tp = tp  # tensor parallelism: this rank's group (None: the whole model here)
        self.pp = pp  # pipeline parallelism: this rank's stage (None: every layer here)
        self.num_kv_heads = local_heads(info, tp)[1]  # KV heads whose cache this rank holds
        self.info = info
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.attn_backend = get_attention_backend(config.attention_backend, device)
        # memory other engines / programs held before this one loaded (not ours to count)
        self._mem_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        ops = get_kernel_ops(device, "torch" if config.attention_backend == "torch" else "auto")
        # speculative decoding's "mtp": the checkpoint's multi-token-prediction layers propose the drafts
        mtp = config.speculative_config is not None and config.speculative_config.method == "mtp"
        self.model = load_model(model_dir, info, dtype, device, self.attn_backend, config.load_format, ops=ops,
                                quantization=config.quantization, mtp=mtp, tp=tp, pp=pp)
        self.kv_dtype = FP8_DTYPE if config.fp8_kv else dtype
        if config.fp8_kv:
            self._setup_kv_scales()
        # every layer's cache layout (attention/kv_cache_spec.py): per-head K/V, or DeepSeek's latent (whole on
        # every rank)
        if info.mla is not None:
            spec = KVCacheSpec(self.block_size, self.kv_dtype, latent_dim=info.mla.latent_dim)
        else:
            spec = KVCacheSpec(self.block_size, self.kv_dtype, self.num_kv_heads, info.head_dim)
        self.kv_specs = [spec] * (info.num_layers if pp is None else pp.end - pp.start)  # PP: the stage's layers
        if mtp:  # the MTP layers' caches after the decoder's, on the same block ids (in bytes_per_block)
            self.kv_specs = self.kv_specs + [spec] * info.num_mtp_layers
            self.model.model.keep_prenorm = True
        self._mtp_hidden: torch.Tensor | None = None  # the last MTP pass's sampled hidden states (execute_mtp)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        # the host tier (swap_space GiB; pinned on CUDA), its staging buffer and side stream (host_kv_tier.py)
        self.host_tier: HostKVTier | None = None
        self.num_host_blocks = 0
        self.kv_budget_bytes: int | None = None  # the KV budget determine_num_blocks divided (None: CPU default)
        self.limits = resolve_limits(config, info.max_position_embeddings, device)
        max_blocks = -(-self.limits.max_model_len // self.block_size) + 1
        self.inputs = StepInputBuilder(self.limits.max_num_batched_tokens, self.limits.max_num_seqs, max_blocks,
                                       self.block_size, device)
        self._overflow: StepInputBuilder | None = None
        self.graphs: DecodeGraphs | None = None
        self._calibration_done = False
        self._profiled = False  # a profiling prefill ran (it also compiled the prefill-only kernels)
        self.step_counts = {"graph": 0, "eager": 0}  # forward passes by path (bench prints them)
        self.graph_query_lens_extra: tuple[int, ...] = ()  # more uniform step shapes to capture (a draft model's)
        self._keeps_prenorm = mtp  # the MTP layers read the last forward's hidden states before the final norm

    def _setup_kv_scales(self) -> None:
        """FP8 KV: scales from the checkpoint, else from the first batch if asked, else 1.0."""
        attns = [m for m in self.model.modules() if hasattr(m, "calibrate_kv_scales")]
        if self.config.calculate_kv_scales:
            for m in attns:
                m.calibrate_kv_scales = True
        elif all(float(m.k_scale) == 1.0 and float(m.v_scale) == 1.0 for m in attns):
            logger.warning("fp8 KV cache: the checkpoint has no k_scale/v_scale; using 1.0 "
                           "(pass --calculate-kv-scales to compute them from the first batch)")

    def shutdown(self) -> None:
        """Nothing to release: the model and its cache go with the runner."""

    # -- KV cache --------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """One block id's bytes over every layer (the specs' sum)."""
        return sum(spec.bytes_per_block for spec in self.kv_specs)

    def determine_num_blocks(self, shared_bytes_per_block: int = 0) -> int:
        """From the memory budget: explicit bytes, the GPU's free memory, or a share of RAM.

        ``shared_bytes_per_block``: the bytes another cache indexed by the same block ids takes per
        block (a draft model's); a block id then costs this runner's bytes plus those, and the budget
        (``kv_budget_bytes`` once known) is divided by the sum."""
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        per_block = self.bytes_per_block + shared_bytes_per_block
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_gpu_budget()
        else:
            return cpu_default_num_blocks(per_block, self.block_size, self.limits.max_model_len,
                                          self.limits.max_num_seqs)
        self.kv_budget_bytes = budget
        return max(2, budget // per_block)

    def _profile_gpu_budget(self) -> int:
        """gpu_memory_utilization of the card, minus weights and a profiled activation peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.limits.max_num_batched_tokens
        self._dummy_forward(n)
        self._profiled = True
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self._mem_before  # weights + activations
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # this engine may use gpu_memory_utilization of the card, and no more than is free now
        budget = min(int(total * self.config.gpu_memory_utilization) - peak, free - (512 << 20))
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache: weights + activations take {peak / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB at gpu_memory_utilization={self.config.gpu_memory_utilization}"
            )
        return budget

    def _dummy_forward(self, num_tokens: int) -> None:
        """One prefill of num_tokens into a throwaway cache, to measure the activation peak."""
        bs, dev = self.block_size, self.device
        nblk = -(-num_tokens // bs)
        caches = [spec.allocate(nblk + 1, dev) for spec in self.kv_specs]
        pos = torch.arange(num_tokens, device=dev)
        meta = AttentionMetadata(
            slot_mapping=pos + bs,
            block_tables=torch.arange(1, nblk + 1, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            max_query_len=num_tokens, max_seq_len=num_tokens, block_size=bs,
            seq_lens_cpu=[num_tokens], query_lens_cpu=[num_tokens],
        )
        attns = [m for m in self.model.modules() if getattr(m, "calibrate_kv_scales", False)]
        for m in attns:  # a dummy batch must not set the fp8 scales
            m.calibrate_kv_scales = False
        with torch.inference_mode():
            self._profile_pass(torch.zeros(num_tokens, dtype=torch.long, device=dev), pos, caches, meta)
        for m in attns:
            m.calibrate_kv_scales = True
        del caches

    def _profile_pass(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                      meta: AttentionMetadata) -> None:
        """The dummy prefill's model pass and LM head (a pipeline stage runs its part of them)."""
        hidden = self.model(input_ids, positions, caches, meta)
        self.model.compute_logits(hidden[: min(input_ids.shape[0], self.limits.max_num_seqs)])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The cache, then (on CUDA) the decode graphs that read it."""
        self.num_blocks = num_blocks
        self.kv_caches = [spec.allocate(num_blocks, self.device) for spec in self.kv_specs]
        self.allocate_host_cache()
        if self.device.type == "cuda" and not self._profiled:
            self.warm_up_prefill()
        self.warm_up_attention()
        if self._graphs_wanted():
            self.capture_cuda_graphs()

    def warm_up_prefill(self) -> None:
        """One small prefill into a throwaway cache, when no profiling prefill ran (the KV budget was
        given): it compiles the kernel variants only prefill steps launch (the rotary kernel that
        folds the softmax scale into q, int4 GEMM tiles for more than 64 rows), which would
        otherwise compile on the first prompt (a stall of a second or more on that request)."""
        t0 = time.perf_counter()
        self._dummy_forward(min(self.limits.max_num_batched_tokens, 256))
        logger.info("prefill kernels warmed up in %.1f s", time.perf_counter() - t0)

    def warm_up_attention(self) -> None:
        """Compile the attention kernel variants any step can need now, not on the step that first
        needs one (a stall of seconds: a server's first request of a new shape)."""
        latent = bool(self.kv_specs) and self.kv_specs[0].is_latent
        warm = getattr(self.attn_backend, "warm_up_mla" if latent else "warm_up", None)
        if warm is None or not self.kv_caches:
            return
        t0 = time.perf_counter()
        heads = local_heads(self.info, self.tp)[0]
        lim = self.limits
        try:
            if latent:
                n = warm(self.kv_caches[0], self.dtype, heads, self.info.mla.kv_lora_rank,
                         max_model_len=lim.max_model_len)
            else:
                n = warm(self.kv_caches[0], self.dtype, heads, max_num_seqs=lim.max_num_seqs,
                         max_num_batched_tokens=lim.max_num_batched_tokens, max_model_len=lim.max_model_len,
                         max_blocks=self.inputs.max_blocks,
                         sliding_window=getattr(self.model, "sliding_window", None))
        except Exception as exc:  # an optimisation: a failure here must not stop the engine (steps compile then)
            logger.warning("attention kernel warm-up failed (kernels will compile on first use): %s", exc)
            return
        logger.info("attention kernels warmed up for %d step shapes in %.1f s", n, time.perf_counter() - t0)

    def allocate_host_cache(self) -> None:
        """The host tier: ``swap_space`` GiB of blocks (incl. a null block 0, as the device cache), none at 0;
        each host block holds every layer's bytes of one block (``HostKVTier``)."""
        n = int(self.config.swap_space * (1 << 30)) // self.bytes_per_block
        if n < 2:
            return
        self.host_tier = HostKVTier(self.kv_specs, n, self.device, pin_memory=self.device.type == "cuda")
        self.num_host_blocks = n

    @property
    def host_caches(self) -> list[torch.Tensor]:
        """Each layer's host blocks in its spec's shape (views of the tier's memory); [] without a tier."""
        return self.host_tier.caches if self.host_tier is not None else []

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Device -> host (device, host) pairs, then host -> device (host, device) pairs, every layer.
        On CUDA they run on the tier's stream, after the work queued so far (the blocks swapped out
        hold KV of earlier steps); what is queued after waits for the swap out's gathers (the forward
        reuses freed blocks) and the swap in (it reads the swapped-in blocks), not for the swap out's
        copies to the host (``HostKVTier.swap``)."""
        if not swap_out and not swap_in:
            return
        if self.host_tier is None:
            raise RuntimeError("blocks to swap but no host KV tier (swap_space is 0)")
        self.host_tier.swap(self.kv_caches, swap_out, swap_in)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for spec, cache in zip(self.kv_specs, self.kv_caches, strict=True):
            spec.copy_blocks(cache, src, dst)

    # -- one step ----------------------------------------------------------------------

    def _builder_for(self, sched: SchedulerOutput) -> StepInputBuilder:
        """The persistent buffers; a step past their size (forked samples over max_num_seqs) gets
        a larger eager-only set, kept for reuse."""
        n_seqs = len(sched.scheduled)
        n_tok = sum(s.num_new_tokens for s in sched.scheduled)
        n_blk = max((len(s.block_ids) for s in sched.scheduled), default=1)
        for b in (self.inputs, self._overflow):
            if b is not None and b.fits(n_tok, n_seqs, n_blk):
                return b
        lim = self.limits
        self._overflow = StepInputBuilder(max(n_tok, lim.max_num_batched_tokens), max(n_seqs, lim.max_num_seqs),
                                          max(n_blk, self.inputs.max_blocks), self.block_size, self.device)
        return self._overflow

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, prev: tuple[list[str], torch.Tensor | PendingTokens] | None = None
                ) -> ModelOutput:
        """Queue the step's forward pass; the logits come back unsynchronized (device tensors).

        ``prev`` (async scheduling): the step still in flight's sampled request ids and their
        sampled token ids (device), for the tokens scheduled before they were known; ``PendingTokens``
        are asked for once this step's inputs are uploaded, before its forward pass.
        """
        return self._outputs(*self._run(sched, prev))

    @torch.inference_mode()
    def execute_kv_only(self, sched: SchedulerOutput) -> None:
        """The step's forward pass for its KV writes alone (no logits: a draft model observing the target's
        step)."""
        self._run(sched, None)

    def _run(self, sched: SchedulerOutput, prev: tuple[list[str], torch.Tensor | PendingTokens] | None
             ) -> tuple[StepInputs, torch.Tensor]:
        """The step's inputs and hidden states (one row per real token): a graph replay where one was captured
        for the step's shape (``_graph_shape``), else the eager forward."""
        self.swap_blocks(sched.blocks_to_swap_out, sched.blocks_to_swap_in)
        self.copy_blocks(sched.blocks_to_copy)
        builder = self._builder_for(sched)
        scheduled = sched.scheduled
        bucket = q = None
        if self.graphs is not None and builder is self.inputs and scheduled and self._graphs_usable():
            q, bucket = self._graph_shape(scheduled)
        window = getattr(self.model, "sliding_window", None)
        if bucket is not None:
            step = builder.build(sched, pad_to=bucket, max_seq_len_bound=self.limits.max_model_len,
                                 sliding_window=window, prev=prev, pad_query_len=q)
            hidden = self.graphs.replay(bucket, q)
            rows = step.row_index
            if rows is not None:  # a spread step: the real tokens' rows, in step order
                hidden = hidden.index_select(0, rows)
            if self._keeps_prenorm:  # the MTP passes read it after the next replay has overwritten the graph's
                pre = self.graphs.prenorm[q, bucket]
                self.model.model.prenorm = pre.index_select(0, rows) if rows is not None else pre[: step.num_tokens].clone()
            self.step_counts["graph"] += 1
        else:
            self.step_counts["eager"] += 1
            step = builder.build(sched, sliding_window=window, prev=prev)
            hidden = self._forward(step)
        return step, hidden

    def _graph_shape(self, scheduled: list) -> tuple[int | None, int | None]:
        """(q, batch bucket) of the graph a step replays, or (None, None): eager. Every request q new tokens (q a
        captured length), or fewer where the step is still mostly real tokens: a verification in which some
        requests have fewer drafts (or none) spreads each request over q rows (``StepInputBuilder.build``'s
        ``pad_query_len``), at most twice the real tokens (or 128 rows in all), and q - 1 at most a block (the
        filler rows' positions stay within the block table's spare column)."""
        graphs = self.graphs
        assert graphs is not None
        most = total = 0
        for s in scheduled:
            n = s.num_new_tokens
            total += n
            if n > most:
                most = n
        q = graphs.query_len_for(most)
        if q is None:
            return None, None
        if most * len(scheduled) != total or most != q:  # not every request has q new tokens
            if q - 1 > self.block_size or len(scheduled) * q > max(2 * total, 128):
                return None, None
        bucket = graphs.bucket(len(scheduled), q)
        return (q, bucket) if bucket is not None else (None, None)

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The eager forward pass (a pipeline stage's overrides it: activations in and out)."""
        return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)

    def _outputs(self, step: StepInputs, hidden: torch.Tensor) -> ModelOutput:
        """The logits of the step's sampled rows and of its prompt-logprob spans."""
        rows = step.sample_rows
        if len(rows) == step.num_tokens:  # every row samples (decode): no gather
            sel = hidden[: step.num_tokens]
        else:
            sel = hidden[torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)]
        logits = self.model.compute_logits(sel)
        prompt_logits = {
            rid: (start, self.model.compute_logits(hidden[first : first + count]))
            for rid, first, count, start in step.prompt_spans
        }
        return ModelOutput(step.sample_request_ids, logits, prompt_logits)

    # -- multi-token prediction (speculative decoding's "mtp") -----------------------

    def last_hidden_states(self) -> torch.Tensor:
        """The last forward's hidden states before the final norm, one row per token [T, hidden]."""
        hidden = self.model.model.prenorm
        assert hidden is not None, "no forward has run with the MTP layers on"
        return hidden

    def restore_hidden_states(self, hidden: torch.Tensor) -> None:
        """Make ``hidden`` (an earlier ``last_hidden_states``) the last forward's again, for an MTP pass over that
        step after another forward ran (async scheduling)."""
        self.model.model.prenorm = hidden

    @torch.inference_mode()
    def execute_mtp(self, sched: SchedulerOutput, rows: list[int], spec_step: int = 0) -> torch.Tensor:
        """One pass of the MTP layers (models/mtp.py) over ``sched``'s tokens (t_{i+1} at position i), writing
        their caches (``sched.blocks_to_copy`` first); returns the logits of the sampled rows (float32
        [N, vocab]; [N, 0] on tensor-parallel ranks > 0). The previous hidden states, one per token, are
        ``rows`` of the last forward's (``last_hidden_states``) for ``spec_step`` 0, else of the previous
        pass's sampled rows: each rank reads its own, so a pass is plain data (tensor parallelism mirrors it)."""
        self.copy_blocks(sched.blocks_to_copy)
        mtp = self.model.mtp
        source = self.last_hidden_states() if spec_step == 0 else self._mtp_hidden
        assert source is not None, "a lookahead MTP pass before the first"
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        step = self._builder_for(sched).build(sched)
        hidden = mtp(step.input_ids, step.positions, source[index], self.kv_caches[self.info.num_layers:],
                     step.meta, spec_step)
        sampled = step.sample_rows
        if len(sampled) != step.num_tokens:
            hidden = hidden[torch.tensor(sampled, dtype=torch.long).to(self.device, non_blocking=True)]
        self._mtp_hidden = hidden  # the next lookahead pass's rows
        return mtp.compute_logits(hidden, spec_step)

    # -- CUDA graphs ------------------------------------------------------------------

    def _graphs_wanted(self) -> bool:
        from paged_backend.kernels.mla_attention import supported as mla_supported

        cfg = self.config
        return (self.device.type == "cuda" and not cfg.enforce_eager and self.attn_backend.name == "triton"
                and (self.tp is None or self.tp.world_size == 1)
                and (self.info.mla is None  # latent attention: only the kernel (its torch fallback loops on the host)
                     or mla_supported(self.info.mla.kv_lora_rank, self.info.mla.qk_rope_head_dim)))

    def _graphs_usable(self) -> bool:
        """Not while an fp8 KV scale still waits for the first batch (the graphs skip that branch)."""
        if self._calibration_done:
            return True
        self._calibration_done = not any(getattr(m, "calibrate_kv_scales", False) for m in self.model.modules())
        return self._calibration_done

    def graph_query_lens(self) -> tuple[int, ...]:
        """The new tokens per request of the uniform steps graphs are captured for: 1 (decode), and with
        speculative decoding 1 + k (a verification of k drafts; a draft model's runner observes those steps
        too, ``graph_query_lens_extra``)."""
        lens = {1, *self.graph_query_lens_extra}
        spec = self.config.speculative_config
        if spec is not None:
            lens.add(1 + spec.num_speculative_tokens)
        return tuple(sorted(lens))

    def capture_cuda_graphs(self) -> None:
        lim = self.limits
        max_size = min(self.config.max_cudagraph_capture_size, lim.max_num_seqs, lim.max_num_batched_tokens)
        self.graphs = DecodeGraphs(self._graph_forward, self.inputs, max_size, lim.max_model_len,
                                   self.graph_query_lens())
        pending = [m for m in self.model.modules() if getattr(m, "calibrate_kv_scales", False)]
        for m in pending:  # a dummy batch must not set the fp8 scales
            m.calibrate_kv_scales = False
        try:
            self.graphs.capture(getattr(self.model, "sliding_window", None))
        finally:
            for m in pending:
                m.calibrate_kv_scales = True

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                       ) -> torch.Tensor:
        """The captured forward; with MTP layers it also leaves the hidden states before the final norm (what
        ``last_hidden_states`` reads) where the graph keeps them (``graphs.prenorm``, by shape)."""
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if self._keeps_prenorm and self.graphs is not None:
            n = hidden.shape[0]
            self.graphs.prenorm[n // meta.num_seqs, meta.num_seqs] = self.model.model.prenorm
        return hidden


CPU_KV_BUDGET_CAP = 4 << 30


def cpu_default_num_blocks(bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int,
                           available_ram: int | None = None) -> int:
    """The CPU's default KV cache: a quarter of the free RAM, at most 4 GiB, and never more
    blocks than max_num_seqs requests of max_model_len tokens can hold at once (plus the null
    block): a small model with a short context gets a small cache, not 4 GiB of zeros."""
    ram = _available_ram() if available_ram is None else available_ram
    by_memory = min(CPU_KV_BUDGET_CAP, ram // 4) // bytes_per_block
    by_use = max_num_seqs * -(-max_model_len // block_size) + 1
    return max(2, min(by_memory, by_use))


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
