"""The synchronous engine core: add requests, step, abort.

One ``step()`` = schedule -> run the model -> sample -> append tokens, check stops,
detokenize -> free finished requests -> return ``RequestOutput``s. ``LLM`` and
``AsyncEngine`` drive it; nothing else touches the scheduler or the KV cache. Its parts:
``InputProcessor`` (prompts to requests), ``Scheduler`` (core/), the model runner
(worker/), ``StepSampler`` (logits to ids), ``ParallelSampling`` (n > 1 forks) and
``OutputProcessor`` (ids to outputs; the registry of live requests).

The step is host-bound on a fast GPU, so its per-request work is kept to plain attribute
reads: parameters are digested once per request (``SampleState``), a batch of plain greedy
rows skips the sampler's per-row metadata, and stop checks run only for a token that
could stop its request.
"""

from __future__ import annotations

import logging
import time

import torch

from paged_backend.config import EngineConfig, resolve_limits
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import RequestStatus
from paged_backend.core.scheduler import Scheduler
from paged_backend.core.swap import SwapSpace
from paged_backend.engine.draft_model import DraftModelProposer, load_draft_runner
from paged_backend.engine.input_processor import InputProcessor, load_tokenizer, max_token_bytes, sample_id
from paged_backend.engine.mtp_proposer import MTPProposer, check_mtp_config
from paged_backend.engine.output_processor import OutputProcessor
from paged_backend.engine.parallel_sampling import ParallelSampling
from paged_backend.engine.pipeline_steps import PipelinedSteps
from paged_backend.engine.request_state import PreparedRequest, Row
from paged_backend.engine.spec_decoding import SpecDecoder, VerifiedStep
from paged_backend.engine.stats import EngineStats
from paged_backend.engine.step_sampling import LaunchedStep, StepSampler
from paged_backend.errors import InvalidRequestError
from paged_backend.models.default_model import resolve_model_path
from paged_backend.models.model_info import ModelInfo
from paged_backend.outputs import RequestOutput
from paged_backend.sample.sampler import Sampler
from paged_backend.sampling_params import SamplingParams
from paged_backend.worker.model_loader import resolve_dtype
from paged_backend.worker.pipeline_parallel import create_model_runner
from paged_backend.worker.step_inputs import PendingTokens

__all__ = ["LLMEngine", "PreparedRequest", "max_token_bytes"]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model_path(config.model)
        self.model_dir = model_dir
        self.info = ModelInfo.from_dir(model_dir)
        self.device = _resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.info, self.device)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            config.tokenizer or model_dir, required=config.load_format != "dummy")
        limits = resolve_limits(config, self.info.max_position_embeddings, self.device)
        self.max_model_len = limits.max_model_len
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.eos_token_ids = tuple(self.info.eos_token_ids)
        self.async_scheduling = _async_scheduling(config, self.device)
        if config.speculative_config is not None and config.speculative_config.method == "mtp":
            check_mtp_config(config, self.info)  # before loading: the checkpoint's MTP layers propose

        self.runner = create_model_runner(config, model_dir, self.info, self.device, self.dtype)
        spec = config.speculative_config
        # a draft model's cache shares the target's block ids: loaded first, its bytes count per block
        draft_runner = (load_draft_runner(config, self.info, self.device, self.dtype, self.max_model_len)
                        if spec is not None and spec.method == "draft_model" else None)
        draft_bytes = draft_runner.bytes_per_block if draft_runner is not None else 0
        num_blocks = self.runner.determine_num_blocks(draft_bytes)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # the host tier (swap_space GiB): swap preemption's blocks, same block size
        num_host = self.runner.num_host_blocks
        self.swap = SwapSpace(num_host, config.block_size, config.preemption_mode) if num_host else None
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            swap=self.swap,
            # speculative decoding under async scheduling: a request waits while its tokens are in flight
            skip_in_flight=config.pipeline_parallel_size > 1 or (self.async_scheduling and spec is not None),
        )
        self.stats = EngineStats(interval=0 if config.disable_log_stats else config.log_stats_interval)
        self.inputs = InputProcessor(self.tokenizer, self.info.vocab_size, self.eos_token_ids, self.max_model_len,
                                     self.kv, config.block_size, self.device)
        self.sampler = Sampler(seed=config.seed)
        self.step_sampler = StepSampler(self.sampler, self.eos_token_ids, self.async_scheduling, self.max_num_seqs)
        self.spec = None
        if spec is not None:
            draft = None
            if draft_runner is not None:
                draft = DraftModelProposer(config, draft_runner, self.runner, self.kv)
            elif spec.method == "mtp":  # its cache is a layer of the target's (in bytes_per_block)
                draft = MTPProposer(config, self.runner, self.scheduler, keep_hidden=self.async_scheduling)
            self.spec = SpecDecoder(spec, self.scheduler, self.step_sampler, draft)
        if self.spec is not None:
            self.stats.spec = self.spec.stats
        self.parallel = ParallelSampling(self.kv, self.scheduler)
        self.outputs = OutputProcessor(self.scheduler, self.stats, self.eos_token_ids, self.max_model_len)
        self.groups, self.samples = self.outputs.groups, self.outputs.samples  # the live requests
        self._inflight: LaunchedStep | None = None  # async: the step whose sampled ids are still on the device
        # async with structured outputs: the step whose sampling waits for its masks, queued in the next step
        # by the runner after that step's inputs are built (``PendingTokens``), so that the fill overlaps them
        self._unsampled: tuple[LaunchedStep, list[int] | None] | None = None
        self._defers_sampling = self.async_scheduling and getattr(self.runner, "takes_pending_tokens", False)
        pp = config.pipeline_parallel_size  # pipeline parallelism: micro-batches in flight (pipeline_steps.py)
        self.pipeline = PipelinedSteps(self, pp) if pp > 1 else None
        _log_engine(self)
        _log_kv_cache(num_blocks, config.block_size, self.runner, self.max_model_len, draft_bytes)

    # -- input ---------------------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        return self.inputs.kv_capacity_tokens

    @property
    def max_prompt_bytes(self) -> int:
        """A text longer than this (UTF-8 bytes) has more than max_model_len tokens."""
        return self.inputs.max_prompt_bytes

    @property
    def num_async_steps(self) -> int:
        """Steps sampled on the device and processed one step later."""
        return self.step_sampler.num_async_steps

    def process_input(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Tokenize and validate; raises InvalidRequestError. Touches no engine state."""
        prep = self.inputs.process(request_id, prompt, params, arrival_time=arrival_time, cache_salt=cache_salt)
        self._check_id_free(request_id, prep.params.n)
        return prep

    def check_text_size(self, num_bytes: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text whose size alone proves it exceeds the context."""
        self.inputs.check_text_size(num_bytes, param)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        **kwargs,
    ) -> None:
        self.add_prepared(self.process_input(request_id, prompt, params, **kwargs))

    sample_id = staticmethod(sample_id)

    def _check_id_free(self, request_id: str, n: int) -> None:
        """Neither the request id nor any of its samples' ids may be taken, by a request or by a
        sample of another one (``a#0`` alone and ``a`` with n = 2 would share a scheduler id)."""
        ids = {request_id} | {sample_id(request_id, n, i) for i in range(n)}
        if any(i in self.groups or i in self.samples for i in ids):
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")

    def add_prepared(self, prep: PreparedRequest) -> None:
        self._check_id_free(prep.request_id, prep.params.n)
        group = self.inputs.make_group(prep)
        self.outputs.add(group)
        self.parallel.add(group)
        self.scheduler.add_request(group.samples[0].request)
        self.stats.on_request_added(len(prep.prompt_token_ids))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a user request (all its samples); its blocks are freed now.

        Returns its final delta (finish_reason "abort"), or None if it was not running."""
        group = self.outputs.pop(request_id)
        if group is None:
            return None
        self.parallel.drop(group)
        for s in group.samples:
            self.scheduler.finish(s.request, RequestStatus.FINISHED_ABORTED)
        self.stats.on_request_finished(aborted=True)
        return self.outputs.make_output(group)

    # -- the loop ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def step(self) -> list[RequestOutput]:
        """One engine step; with async scheduling, the outputs of the step before it.

        Async (``_inflight``): step t+1 is scheduled and its forward queued before step t's
        sampled ids reach the host; only then does the host wait for them and process them,
        while the device computes step t+1. A request that stops at step t has a row in
        step t+1 whose token is dropped; one that reaches max_tokens is not scheduled again.
        With speculative decoding a request whose step is in flight waits instead (``_speculative_step``).
        """
        if self.pipeline is not None:
            return self.pipeline.step()
        sched = self.scheduler.schedule(self._max_seqs())
        if sched.preempted:
            self.stats.on_preemptions(len(sched.preempted))
        prev, self._inflight = self._inflight, None
        unsampled, self._unsampled = self._unsampled, None
        if unsampled is not None and sched.is_empty:
            prev, unsampled = self._launch_sampling(*unsampled), None
        if sched.is_empty:
            if prev is None:
                return []
            results = self._land(prev)
            if self.spec is not None:  # its requests' next drafts
                self.spec.propose(self.samples, [prev.sched])
            return results
        if unsampled is not None:  # sampled by the runner once this step's inputs are built
            prev = unsampled[0]
            pending = PendingTokens(lambda: self._launch_sampling(*unsampled).tokens)
            out = self.runner.execute(sched, (prev.out.sample_request_ids, pending))
        elif prev is None or self.spec is not None:  # speculative: nothing scheduled is in flight
            out = self.runner.execute(sched)
        else:
            out = self.runner.execute(sched, (prev.out.sample_request_ids, prev.tokens))
        # the rows before finishing ``prev``: a request it stops still has a row here (dropped later)
        if self.parallel.forking:
            rows, index, forking = self.parallel.rows(out.sample_request_ids, self.samples)
        else:
            samples = self.samples
            rows, index, forking = [samples[rid] for rid in out.sample_request_ids], None, []
        launched = LaunchedStep(sched, out, rows, forking)
        if self.spec is not None:
            return self._speculative_step(launched, index, prev)
        results = self._finish(prev, upcoming=(rows, out.logits)) if prev is not None else []
        if self._defers_sampling and self.step_sampler.defer(launched):
            self._unsampled = (launched, index)
            return results
        launched = self._launch_sampling(launched, index)
        if launched.tokens is not None:
            self._inflight = launched
        else:
            results += self._finish(launched)
        return results

    def _max_seqs(self) -> int | None:
        """Speculative decoding under async scheduling: half the live requests a step (rounded up), so that
        two steps' requests take turns, one's host work (verification, outputs, drafts, scheduling) beside the
        other's forward, as pipeline parallelism's micro-batches do; otherwise no cap."""
        if self.spec is None or not self.async_scheduling:
            return None
        return max(1, -(-self.scheduler.num_requests // 2))

    def _speculative_step(self, launched: LaunchedStep, index: list[int] | None,
                          prev: LaunchedStep | None) -> list[RequestOutput]:
        """A step with speculative decoding: drafts verified, the next ones proposed.

        Synchronous: verified at once. Async: the step's rows are sampled on the device and verified when the
        next step lands them (its requests wait meanwhile: the scheduler skips requests in flight), while
        ``prev``, the step launched before, is verified and processed now and its requests get their drafts."""
        spec = self.spec
        assert spec is not None
        sched = launched.sched
        spec.observe(sched)
        queued = self.async_scheduling and not launched.forking  # forks are made on the host at once
        if queued:
            self._inflight = spec.launch(launched, index)  # on the device before prev's host work
        results = self._land(prev) if prev is not None else []
        landed = [prev.sched] if prev is not None else []
        if not queued:
            if sched.num_draft_tokens:
                results += self._finish(launched, spec.verify(sched, launched.rows, launched.out.logits, index))
            else:
                results += self._finish(self._launch_sampling(launched, index))
            landed.append(sched)
        spec.propose(self.samples, landed)
        return results

    def _land(self, prev: LaunchedStep) -> list[RequestOutput]:
        """The outputs of the step in flight, once its ids land (speculative: its drafts verified)."""
        if prev.spans is None:
            return self._finish(prev)
        assert self.spec is not None
        return self._finish(prev, self.spec.land(prev))

    def _launch_sampling(self, launched: LaunchedStep, index: list[int] | None) -> LaunchedStep:
        return self.step_sampler.launch(launched, index)

    def _finish(self, launched: LaunchedStep, verified: VerifiedStep | None = None,
                upcoming: tuple[list[Row], torch.Tensor] | None = None) -> list[RequestOutput]:
        """Append a sampled step's tokens: stop checks, detokenization, outputs, frees.
        ``verified``: a speculative step's emitted tokens (rows repeat per token); ``upcoming``: the queued
        step's rows and logits, whose grammar masks are filled meanwhile (structured outputs)."""
        if verified is None:
            rows, token_ids, logprobs = launched.rows, self.step_sampler.land(launched), None
            if upcoming is not None:
                self.step_sampler.prepare(*upcoming, rows, token_ids)
        else:
            rows, token_ids, logprobs = verified.rows, verified.token_ids, verified.logprobs
        if launched.out.prompt_logits:
            self.outputs.collect_prompt_logprobs(launched.out.prompt_logits)
        if launched.forking:  # before the parent can finish and free its blocks
            self.parallel.fork(launched.forking)
        return self.outputs.process(rows, token_ids, time.monotonic(), launched.sched.num_tokens, logprobs)

    # -- introspection -------------------------------------------------------------------

    def get_stats(self) -> dict:
        return self.stats.snapshot(self.scheduler, self.kv)

    def model_info(self) -> dict:
        return {
            "name": self.config.name,
            "model_dir": str(self.model_dir),
            "architecture": self.info.architecture,
            "max_model_len": self.max_model_len,
            "vocab_size": self.info.vocab_size,
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_cache_dtype": str(self.runner.kv_dtype).replace("torch.", ""),
            "device": str(self.device),
            "block_size": self.config.block_size,
            "num_gpu_blocks": self.runner.num_blocks - 1,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "eos_token_ids": list(self.eos_token_ids),
        }

    def shutdown(self) -> None:
        """Releases the model runner's processes (tensor-parallel workers); idempotent."""
        self.runner.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def _async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """vLLM's default on one GPU; no gain where the host runs the model."""
    if config.async_scheduling is None:
        # speculative decoding: off unless asked for; its requests take turns in half-size steps (2.6), a
        # trade whose gain depends on how host-bound the steps are
        return (device.type == "cuda" and config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1
                and config.speculative_config is None)
    if config.async_scheduling and config.tensor_parallel_size > 1:
        raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1")
    return config.async_scheduling


def _log_engine(engine: LLMEngine) -> None:
    """The start-up line a server log shows (as vLLM's engine logs its config)."""
    cfg, runner = engine.config, engine.runner
    backend = getattr(getattr(runner, "attn_backend", None), "name", cfg.attention_backend)
    graphs = getattr(runner, "graphs", None)
    logger.info(
        "Engine: model=%s (%s), dtype=%s, device=%s, max_model_len=%d, max_num_seqs=%d, "
        "max_num_batched_tokens=%d, attention backend=%s, CUDA graphs=%s, async scheduling=%s, "
        "prefix caching=%s, tensor_parallel_size=%d, pipeline_parallel_size=%d", cfg.name, engine.info.architecture,
        str(engine.dtype).replace("torch.", ""), engine.device, engine.max_model_len, engine.max_num_seqs,
        engine.max_num_batched_tokens, backend,
        f"on ({graphs.describe()})" if graphs is not None and graphs.graphs else "off",
        "on" if engine.async_scheduling else "off", "on" if cfg.enable_prefix_caching else "off",
        cfg.tensor_parallel_size, cfg.pipeline_parallel_size,
    )


def _log_kv_cache(num_blocks: int, block_size: int, runner, max_model_len: int, draft_bytes: int = 0) -> None:
    capacity = (num_blocks - 1) * block_size
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%s, %.2f GiB%s); max concurrency at "
        "max_model_len %d: %.2fx", num_blocks - 1, block_size, capacity,
        str(runner.kv_dtype).replace("torch.", ""), num_blocks * (runner.bytes_per_block + draft_bytes) / 2**30,
        " with the draft model's" if draft_bytes else "", max_model_len, capacity / max_model_len,
    )
