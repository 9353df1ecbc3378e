"""The synchronous engine core: add requests, step, abort.

One ``step()`` = schedule -> run the model -> sample -> append tokens, check stops,
detokenize -> free finished requests -> return ``RequestOutput``s, of the kind each
request's ``output_kind`` asks (deltas by default; ``LLM.generate`` asks FINAL_ONLY, so
no output is built until a request finishes). ``LLM`` and ``AsyncEngine`` drive it;
nothing else touches the scheduler or the KV cache.

The step is host-bound on a fast GPU, so its per-request work is kept to plain attribute
reads: parameters are digested once per request (``_Sample``), a batch of plain greedy
rows skips the sampler's per-row metadata (``Sampler.greedy``), and stop checks run only
for a token that could stop its request.

A user request with ``n > 1`` becomes ``n`` internal requests: sample 0 computes the
prompt; when its prompt is done, ``n`` tokens are sampled from the same logits and the
other samples fork its blocks (shared by reference, copy-on-write on the partial block).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

import torch

from paged_backend.config import EngineConfig, resolve_limits
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.scheduler import Scheduler, SchedulerOutput
from paged_backend.engine.detokenizer import IncrementalDetokenizer
from paged_backend.engine.stats import EngineStats
from paged_backend.errors import InvalidRequestError
from paged_backend.models.default_model import resolve_model_path
from paged_backend.models.model_info import ModelInfo
from paged_backend.outputs import CompletionOutput, LogprobsDict, RequestOutput, Usage
from paged_backend.sample.sampler import (
    DeviceSample,
    RowSpec,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    fast_greedy_from,
)
from paged_backend.sampling_params import RequestOutputKind, SamplingParams
from paged_backend.worker.model_loader import resolve_dtype
from paged_backend.worker.model_runner import ModelOutput
from paged_backend.worker.tensor_parallel import create_model_runner

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready to enter the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    cache_salt: str | None = None


_NEVER = sys.maxsize


@dataclass(eq=False)
class _Sample:
    """Engine-side state of one internal request (one of the n samples).

    The per-step loop reads only plain attributes, derived once from the parameters (they
    do not change while the request runs): ``spec`` (what the sampler's batch plan reads),
    ``fast_from`` (output count from which its logits row may skip the full sampler),
    ``stop_ids`` (every token id that could end it), ``max_output`` (the output length that
    ends it: max_tokens or the rest of max_model_len) and ``wants_logprobs``.
    """

    request: Request
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    spec: RowSpec
    max_output: int
    fast_from: int = _NEVER
    stop_ids: frozenset[int] = frozenset()
    wants_logprobs: bool = False
    # DELTA: what is new since the last output; CUMULATIVE / FINAL_ONLY: logprobs and text so far
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[LogprobsDict] = field(default_factory=list)
    text: str = ""
    cumulative_logprob: float = 0.0
    reported_finish: bool = False


@dataclass(eq=False)
class _Launched:
    """A step whose forward pass is queued, with how its rows get their tokens.

    Sampled on the host (``token_ids``), or still on the device (``tokens``), copied behind
    ``event`` to ``landing`` (pinned host memory): the ids, or ``Sampler.pack`` of
    ``device_sample`` when the full sampler ran.
    """

    sched: SchedulerOutput
    out: ModelOutput
    rows: list[tuple[_Group, _Sample]]
    forking: list[_Group]
    token_ids: list[int] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    device_sample: DeviceSample | None = None
    landing: torch.Tensor | None = None
    event: torch.cuda.Event | None = None


@dataclass(eq=False)
class _Group:
    """One user request: its samples and what it has reported."""

    prep: PreparedRequest
    samples: list[_Sample]
    pending_forks: list[_Sample]
    prompt_logprobs: list[LogprobsDict | None] | None = None
    prompt_logprobs_sent: bool = False
    first_token_time: float | None = None
    kind: RequestOutputKind = RequestOutputKind.DELTA

    @property
    def finished(self) -> bool:
        if self.pending_forks:
            return False
        samples = self.samples
        if len(samples) == 1:
            return samples[0].request.is_finished
        return all(s.request.is_finished for s in samples)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model_path(config.model)
        self.model_dir = model_dir
        self.info = ModelInfo.from_dir(model_dir)
        self.device = _resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.info, self.device)
        self.tokenizer = _load_tokenizer(config.tokenizer or model_dir, required=config.load_format != "dummy")
        limits = resolve_limits(config, self.info.max_position_embeddings, self.device)
        self.max_model_len = limits.max_model_len
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.eos_token_ids = tuple(self.info.eos_token_ids)
        # a text longer than this (UTF-8 bytes) has more than max_model_len tokens: refused untokenized
        self.max_prompt_bytes = self.max_model_len * max_token_bytes(self.tokenizer) if self.tokenizer else 0

        self.runner = create_model_runner(config, model_dir, self.info, self.device, self.dtype)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.sampler = Sampler(seed=config.seed)
        self.groups: dict[str, _Group] = {}
        self.samples: dict[str, tuple[_Group, _Sample]] = {}
        self._forking: set[str] = set()  # n > 1 requests whose samples have not forked yet
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:  # vLLM's default on one GPU; no gain where the host runs the model
            self.async_scheduling = self.device.type == "cuda" and config.tensor_parallel_size == 1
        elif self.async_scheduling and config.tensor_parallel_size > 1:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1")
        self._inflight: _Launched | None = None  # async: the step whose sampled ids are still on the device
        # pinned landing buffers of those ids (int64) and of full-sampler results (float64)
        self._landing: dict[torch.dtype, torch.Tensor] = {}
        self.num_async_steps = 0  # steps sampled on the device and processed one step later
        self.stats = EngineStats(interval=0 if config.disable_log_stats else config.log_stats_interval)
        capacity = (num_blocks - 1) * config.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%s, %.2f GiB); max concurrency at "
            "max_model_len %d: %.2fx", num_blocks - 1, config.block_size, capacity,
            str(self.runner.kv_dtype).replace("torch.", ""),
            num_blocks * self.runner.bytes_per_block / 2**30, self.max_model_len,
            capacity / self.max_model_len,
        )

    # -- input ---------------------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.block_pool.num_total_usable * self.config.block_size

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
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("This model has no tokenizer: send token ids.", param="prompt")
            if not prompt:
                raise InvalidRequestError("The prompt must not be empty.", param="prompt")
            self.check_text_size(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif prompt is None:
            raise InvalidRequestError("A prompt (text or token ids) is required.", param="prompt")
        else:
            text, ids = None, list(prompt)
            # set(map(type, ...)) runs in C; the exact check only when some id is not a plain int
            if set(map(type, ids)) - {int} and any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise InvalidRequestError("Prompt token ids must be integers.", param="prompt")
        if not ids:
            raise InvalidRequestError("The prompt must not be empty.", param="prompt")
        vocab = self.info.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if t < 0 or t >= vocab)
            raise InvalidRequestError(
                f"Token id {bad} is out of vocabulary (vocab size {vocab}).", param="prompt")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidRequestError(
                f"stop_token_ids contains {bad_stop[0]}, outside the vocabulary (size {vocab}).",
                param="stop_token_ids")
        n_prompt = len(ids)
        if params.max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"prompt has {n_prompt} tokens, which leaves no room for a completion. Please reduce "
                    "the length of the prompt.", param="prompt", code="context_length_exceeded")
        else:
            max_tokens = params.max_tokens
            if n_prompt + max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} "
                    "in the completion). Please reduce the length of the messages or completion.",
                    param="max_tokens" if n_prompt < self.max_model_len else "prompt",
                    code="context_length_exceeded")
        if not self.kv.can_fit(n_prompt + max_tokens):
            raise InvalidRequestError(
                f"The request needs {n_prompt + max_tokens} tokens of KV cache but the whole cache holds "
                f"{self.kv_capacity_tokens}; it could never run.", param="max_tokens")
        self._check_id_free(request_id, params.n)
        return PreparedRequest(request_id, text, ids, params, max_tokens,
                               time.monotonic() if arrival_time is None else arrival_time, cache_salt)

    def check_text_size(self, num_bytes: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text whose size alone proves it exceeds the context."""
        if self.max_prompt_bytes and num_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"is {num_bytes} bytes long, more than {self.max_model_len} tokens of this tokenizer can hold "
                f"({self.max_prompt_bytes} bytes). Please reduce the length of the prompt.", param=param,
                code="context_length_exceeded")

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        **kwargs,
    ) -> None:
        self.add_prepared(self.process_input(request_id, prompt, params, **kwargs))

    @staticmethod
    def sample_id(request_id: str, n: int, index: int) -> str:
        """The scheduler's id of sample ``index`` of a request of ``n`` samples."""
        return request_id if n == 1 else f"{request_id}#{index}"

    def _check_id_free(self, request_id: str, n: int) -> None:
        """Neither the request id nor any of its samples' ids may be taken, by a request or by a
        sample of another one (``a#0`` alone and ``a`` with n = 2 would share a scheduler id)."""
        ids = {request_id} | {self.sample_id(request_id, n, i) for i in range(n)}
        if any(i in self.groups or i in self.samples for i in ids):
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")

    def add_prepared(self, prep: PreparedRequest) -> None:
        self._check_id_free(prep.request_id, prep.params.n)
        samples = [self._new_sample(prep, i) for i in range(prep.params.n)]
        group = _Group(prep, samples, pending_forks=samples[1:], kind=prep.params.output_kind)
        if prep.params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self.groups[prep.request_id] = group
        if group.pending_forks:
            self._forking.add(prep.request_id)
        for s in samples:
            self.samples[s.request.request_id] = (group, s)
        self.scheduler.add_request(samples[0].request)
        self.stats.on_request_added(len(prep.prompt_token_ids))

    def _new_sample(self, prep: PreparedRequest, index: int) -> _Sample:
        params = prep.params
        rid = self.sample_id(prep.request_id, params.n, index)
        req = Request(rid, prep.prompt_token_ids, params, max_tokens=prep.max_tokens,
                      arrival_time=prep.arrival_time, cache_salt=prep.cache_salt,
                      eos_token_ids=self.eos_token_ids)
        req.sample_index = index
        req.parent_id = prep.request_id
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed + index)
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        fast_from = fast_greedy_from(params, self.eos_token_ids)
        max_output = min(prep.max_tokens, self.max_model_len - len(prep.prompt_token_ids))
        return _Sample(req, gen, detok, RowSpec.of(params, self.eos_token_ids), max_output,
                       fast_from=_NEVER if fast_from is None else fast_from,
                       stop_ids=frozenset(stop_ids), wants_logprobs=params.logprobs is not None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a user request (all its samples); its blocks are freed now.

        Returns its final delta (finish_reason "abort"), or None if it was not running."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        group.pending_forks = []
        self._forking.discard(request_id)
        for s in group.samples:
            self.scheduler.finish(s.request, RequestStatus.FINISHED_ABORTED)
            self.samples.pop(s.request.request_id, None)
        self.stats.on_request_finished(aborted=True)
        return self._make_output(group)

    # -- the loop ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def step(self) -> list[RequestOutput]:
        """One engine step; with async scheduling, the outputs of the step before it.

        Async (``_inflight``): step t+1 is scheduled and its forward queued before step t's
        sampled ids reach the host; only then does the host wait for them and process them,
        while the device computes step t+1. A request that stops at step t has a row in
        step t+1 whose token is dropped; one that reaches max_tokens is not scheduled again.
        """
        sched = self.scheduler.schedule()
        if sched.preempted:
            self.stats.on_preemptions(len(sched.preempted))
        prev, self._inflight = self._inflight, None
        if sched.is_empty:
            return self._finish(prev) if prev is not None else []
        if prev is None:
            out = self.runner.execute(sched)
        else:
            out = self.runner.execute(sched, (prev.out.sample_request_ids, prev.tokens))
        # the rows before finishing ``prev``: a request it stops still has a row here (dropped later)
        if self._forking:
            rows, index, forking = self._rows_with_forks(out.sample_request_ids)
        else:
            samples = self.samples
            rows, index, forking = [samples[rid] for rid in out.sample_request_ids], None, []
        results = self._finish(prev) if prev is not None else []
        launched = self._launch_sampling(_Launched(sched, out, rows, forking), index)
        if launched.tokens is not None:
            self._inflight = launched
        else:
            results += self._finish(launched)
        return results

    def _launch_sampling(self, launched: _Launched, index: list[int] | None) -> _Launched:
        """Sample the step's rows (``index``: their logits rows when forks repeat some). Async:
        queued on the device, ids copied to pinned host memory behind an event; otherwise
        (async off, or samples still to fork) at once, on the host."""
        logits, rows = launched.out.logits, launched.rows
        # every row plain greedy by now: argmax only (the per-row checks below are all it costs)
        fast = True
        for _, sample in rows:
            if sample.fast_from and len(sample.request.output_token_ids) < sample.fast_from:
                fast = False
                break
        if not self.async_scheduling or launched.forking or not rows:
            if index is not None:
                logits = logits[torch.tensor(index, device=logits.device)]
            launched.token_ids = self.sampler.greedy(logits) if fast else self._sample(rows, logits)
            return launched
        if fast:
            tokens = src = logits.argmax(dim=-1)
        else:
            # the full sampler's results in one buffer: a blocking read in _finish would wait
            # for the step queued after this one
            ds = launched.device_sample = self._sampling_metadata_sample(rows, logits)
            tokens, src = ds.token_ids, self.sampler.pack(ds)
        launched.landing = self._landing_buffer(src)
        launched.landing.copy_(src, non_blocking=True)
        if tokens.device.type == "cuda":
            launched.event = torch.cuda.Event()
            launched.event.record()
        launched.tokens = tokens
        self.num_async_steps += 1
        for _, sample in rows:
            sample.request.num_pending = 1
        return launched

    def _landing_buffer(self, src: torch.Tensor) -> torch.Tensor:
        """A host slice of ``src``'s size and dtype, pinned on CUDA, reused step after step (one
        step's results are read in _finish before the next step's land)."""
        n = src.shape[0]
        buf = self._landing.get(src.dtype)
        if buf is None or buf.shape[0] < n:
            buf = self._landing[src.dtype] = torch.empty(max(n, 2 * self.max_num_seqs), dtype=src.dtype,
                                                         pin_memory=src.device.type == "cuda")
        return buf[:n]

    def _finish(self, launched: _Launched) -> list[RequestOutput]:
        """Append a sampled step's tokens: stop checks, detokenization, outputs, frees."""
        out, rows = launched.out, launched.rows
        if launched.tokens is not None:  # async: wait for this step's ids now
            if launched.event is not None:
                launched.event.synchronize()
            assert launched.landing is not None
            host = launched.landing.tolist()
            ds = launched.device_sample
            token_ids = host if ds is None else self._record_logprobs(rows, self.sampler.unpack(ds, host))
            for _, sample in rows:
                sample.request.num_pending = 0
        else:
            token_ids = launched.token_ids
        if out.prompt_logits:
            self._collect_prompt_logprobs(out.prompt_logits)
        for group in launched.forking:  # before the parent can finish and free its blocks
            for child in group.pending_forks:
                self._fork(group, child)
            group.pending_forks = []
            self._forking.discard(group.prep.request_id)

        now = time.monotonic()
        delta_kind, final_kind = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
        touched: dict[str, _Group] = {}  # groups that report this step (DELTA, CUMULATIVE)
        ended: dict[str, _Group] = {}  # groups with a sample that finished this step
        for (group, sample), tok in zip(rows, token_ids, strict=True):
            req = sample.request
            if req.is_finished:  # stopped or aborted while this step was in flight: dropped
                continue
            out_ids = req.output_token_ids
            out_ids.append(tok)
            req.all_token_ids.append(tok)
            kind = group.kind
            if kind is delta_kind:
                sample.new_token_ids.append(tok)
            # _check_stop only when the token could end the request (it also feeds the detokenizer)
            if tok in sample.stop_ids or len(out_ids) >= sample.max_output or sample.detok is not None:
                self._check_stop(sample, tok)
                if req.is_finished:
                    ended[group.prep.request_id] = group
            if group.first_token_time is None:
                group.first_token_time = now
            if kind is not final_kind:
                touched[group.prep.request_id] = group

        self.stats.on_step(launched.sched.num_tokens, len(rows), self.scheduler, self.kv)
        results = [self._make_output(group, now) for group in touched.values()]
        for rid, group in ended.items():
            if not group.finished:
                continue
            if group.kind is final_kind:
                results.append(self._make_output(group))
            del self.groups[rid]
            for s in group.samples:
                self.samples.pop(s.request.request_id, None)
            self.stats.on_request_finished(aborted=False)
        return results

    def _rows_with_forks(
        self, request_ids: list[str]
    ) -> tuple[list[tuple[_Group, _Sample]], list[int] | None, list[_Group]]:
        """Rows when some n > 1 request still has to fork: its children get rows repeating the
        parent's logits row (``index``: the logits row of each row; None when nothing repeats)."""
        rows: list[tuple[_Group, _Sample]] = []
        forking: list[_Group] = []
        index: list[int] | None = None
        for i, rid in enumerate(request_ids):
            entry = self.samples[rid]
            rows.append(entry)
            group, sample = entry
            if index is not None:
                index.append(i)
            if group.pending_forks and sample is group.samples[0]:
                forking.append(group)
                if index is None:
                    index = list(range(i + 1))
                for child in group.pending_forks:
                    rows.append((group, child))
                    index.append(i)
        return rows, index, forking

    def _sampling_metadata_sample(self, rows: list[tuple[_Group, _Sample]], logits: torch.Tensor) -> DeviceSample:
        """The full sampler, left on the device."""
        meta = SamplingMetadata(
            params=[s.request.sampling_params for _, s in rows],
            generators=[s.generator for _, s in rows],
            prompt_token_ids=[s.request.prompt_token_ids for _, s in rows],
            output_token_ids=[s.request.output_token_ids for _, s in rows],
            eos_token_ids=self.eos_token_ids,
            specs=[s.spec for _, s in rows],
        )
        return self.sampler.sample_tensors(logits, meta, sampled_logprobs=False)

    def _sample(self, rows: list[tuple[_Group, _Sample]], logits: torch.Tensor) -> list[int]:
        """The full sampler, on the host at once; records the logprobs of the rows that asked."""
        return self._record_logprobs(rows, self.sampler.to_output(self._sampling_metadata_sample(rows, logits)))

    @staticmethod
    def _record_logprobs(rows: list[tuple[_Group, _Sample]], sampled: SamplerOutput) -> list[int]:
        if sampled.sampled_logprobs is None:  # no row asked for logprobs
            return sampled.sampled_token_ids
        for (_, sample), lp, tops in zip(rows, sampled.sampled_logprobs, sampled.logprobs, strict=True):
            if sample.wants_logprobs and not sample.request.is_finished:
                sample.cumulative_logprob += lp
                sample.new_logprobs.append(tops)
        return sampled.sampled_token_ids

    def _collect_prompt_logprobs(self, prompt_logits: dict[str, tuple[int, torch.Tensor]]) -> None:
        for rid, (start, logits) in prompt_logits.items():
            group, sample = self.samples[rid]
            prompt = sample.request.prompt_token_ids
            # entries exist for positions 0 .. have-1; a recompute after preemption repeats some
            have = len(group.prompt_logprobs)
            skip = max(0, have - (start + 1))
            if skip < logits.shape[0]:
                targets = prompt[start + 1 + skip : start + 1 + logits.shape[0]]
                group.prompt_logprobs.extend(
                    compute_prompt_logprobs(logits[skip:], targets, group.prep.params.prompt_logprobs))

    def _fork(self, group: _Group, child: _Sample) -> None:
        parent = group.samples[0].request
        req = child.request
        self.kv.fork(parent, req)
        req.num_computed_tokens = parent.num_computed_tokens
        req.num_cached_tokens = parent.num_cached_tokens
        self.scheduler.add_running(req)

    def _check_stop(self, sample: _Sample, tok: int) -> None:
        req = sample.request
        params = req.sampling_params
        stop_str = sample.detok.update(tok) if sample.detok is not None else None
        status = None
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and tok in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif tok in params.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
            elif stop_str is not None:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(req, status)

    def _make_output(self, group: _Group, step_time: float | None = None) -> RequestOutput:
        """The group's output of its kind: DELTA holds what is new since the last one (and resets
        it), CUMULATIVE and FINAL_ONLY hold everything so far. ``step_time``: when the step
        that produced a DELTA's new tokens was processed (its ``step_times``)."""
        delta = group.kind is RequestOutputKind.DELTA
        outs = []
        for s in group.samples:
            req = s.request
            finished = req.is_finished
            if delta:
                if not s.new_token_ids and (s.reported_finish or not finished):
                    continue
                token_ids, logprobs = s.new_token_ids, s.new_logprobs
                text = s.detok.delta(finished) if s.detok is not None else ""
                s.new_token_ids, s.new_logprobs = [], []
            else:
                if not req.output_token_ids and not finished:
                    continue
                token_ids, logprobs = list(req.output_token_ids), list(s.new_logprobs)
                if s.detok is not None:
                    s.text += s.detok.delta(finished)
                text = s.text
            outs.append(CompletionOutput(
                index=req.sample_index,
                text=text,
                token_ids=token_ids,
                logprobs=logprobs if s.wants_logprobs else None,
                finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
                cumulative_logprob=s.cumulative_logprob if s.wants_logprobs else None,
                num_output_tokens=len(req.output_token_ids),
            ))
            s.reported_finish = finished
        prompt_lp = None
        if group.prompt_logprobs is not None and (not delta or not group.prompt_logprobs_sent):
            prompt_lp, group.prompt_logprobs_sent = group.prompt_logprobs, True
        lead = group.samples[0].request
        usage = Usage(
            prompt_tokens=lead.num_prompt_tokens,
            completion_tokens=sum(len(s.request.output_token_ids) for s in group.samples),
            cached_tokens=max(0, lead.num_cached_tokens),
        )
        times = [step_time] if delta and step_time is not None and any(c.token_ids for c in outs) else []
        return RequestOutput(group.prep.request_id, group.prep.prompt, group.prep.prompt_token_ids,
                             outs, group.finished, usage, prompt_lp, times)

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
        close = getattr(self.runner, "shutdown", None)
        if close is not None:
            close()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for.

    A vocabulary entry's own UTF-8 spelling is never shorter than the text it decodes to
    (byte-level BPE spells each byte with one character of 1-2 bytes; SentencePiece spells
    a space with the 3-byte ``\u2581``; byte-fallback tokens spell one byte as ``<0xNN>``),
    so a text of more than ``max_model_len`` times this many bytes needs more tokens than
    the context holds.
    """
    vocab = tokenizer.get_vocab()
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    return max(longest, 4)


def _load_tokenizer(path, required: bool):
    """The model's HF tokenizer; a random-weights (dummy) model may have none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        if required:
            raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
        logger.warning("no tokenizer in %s: token-id prompts only, no detokenization", path)
        return None
