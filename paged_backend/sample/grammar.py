"""Structured outputs: a request's ``StructuredOutputsParams`` as a grammar over the vocabulary (xgrammar),
and the per-step token masks that keep its samples inside it.

    GrammarCompiler(tokenizer, vocab_size, eos)   once per engine, made at the first constrained request
        .compile(spec) -> compiled grammar        JSON schema / any JSON / regex / choice / EBNF (xgrammar's
                                                  own cache keeps compiled grammars); a bad spec: ValueError
    RequestGrammar(compiled)                      one matcher per sample: ``sync`` accepts the sample's new
                                                  output tokens, ``fill`` writes its allowed-token bitmask
    apply_grammars(logits, rows)                  the masks of a step's constrained rows, applied in place
                                                  (forbidden tokens -inf) before any sampling or argmax

The engine calls ``apply_grammars`` when it launches a step's sampling: by then the step before it has
landed, so each matcher has seen every token of its sample (also under async scheduling). A finished
sample's row (async scheduling gives it one more row, whose token is dropped) and a terminated grammar
are left unmasked. Logprobs then describe the masked distribution, as vLLM's do. A step fills its masks
with xgrammar's BatchGrammarMatcher on ``FILL_THREADS`` threads (the host's per-row work is what a
constrained step adds at small models; a decode step's accepts go in chunks over ``ACCEPT_THREADS``),
into pinned buffers whose copies to the device do not wait for the stream (``PINNED_STAGING``). Under
async scheduling the engine fills them ahead (``fill_masks_ahead``): as soon as a step's sampled ids reach
the host, the matchers take them and the mask thread fills the next step's masks while the engine thread
processes the step's outputs; the sampling launch then only copies and applies them (``apply_masks``).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from paged_backend.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class SerializedGrammar:
    """A compiled grammar as xgrammar's JSON: what crosses a process boundary (compiled grammars do not
    pickle); ``GrammarCompiler.load`` turns it back."""

    json: str

    @classmethod
    def of(cls, compiled: Any) -> SerializedGrammar:
        return cls(compiled.serialize_json())


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self._info = info
        self._compiler = xgr.GrammarCompiler(info)

    def load(self, serialized: SerializedGrammar) -> Any:
        """A compiled grammar back from its ``SerializedGrammar`` (made by another process's compiler
        over the same tokenizer)."""
        return self._xgr.CompiledGrammar.deserialize_json(serialized.json, self._info)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``; ValueError naming what is wrong with it."""
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json_schema if isinstance(spec.json_schema, str) else json.dumps(spec.json_schema)
                return self._compiler.compile_json_schema(schema)
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
            return self._compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its parser's message
            why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())  # its "[time] file.cc:N:" prefix
            raise ValueError(f"invalid {kind} for structured outputs: {why[:300]}") from None


class RequestGrammar:
    """One sample's position in its grammar. ``live`` holds every matcher still referenced (by any
    engine of the process): while it is empty a step skips the scan for constrained rows."""

    live: weakref.WeakSet[RequestGrammar] = weakref.WeakSet()

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        RequestGrammar.live.add(self)
        self._matcher = xgr.GrammarMatcher(compiled)
        self.accepted = 0  # output tokens the matcher has seen
        self.broken = False  # a token outside the grammar arrived (not sampled under its mask)

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Takes the output tokens it has not seen yet."""
        self.accept(output_token_ids[self.accepted:])

    def accept(self, tokens: Sequence[int]) -> None:
        """Takes ``tokens``, the sample's next output tokens."""
        for t in tokens:
            if not self.constrains:
                break
            if not self._matcher.accept_token(int(t)):
                self.broken = True
        self.accepted += len(tokens)

    @property
    def constrains(self) -> bool:
        return not self.broken and not self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class _MaskStaging:
    """Pinned host buffers for a step's masks and row indices, reused: their copies to the device are truly
    asynchronous (a pageable source makes the host wait for the stream). A buffer is refilled only after
    the copy that read it has run (its event)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def buffers(self, num_rows: int, words: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        if self.mask is None or self.mask.shape[0] < num_rows or self.mask.shape[1] != words:
            n = 1 << max(0, num_rows - 1).bit_length()
            self.mask = torch.empty((n, words), dtype=torch.int32, pin_memory=True)
            self.rows = torch.empty((n,), dtype=torch.int32, pin_memory=True)
        assert self.rows is not None
        return self.mask, self.rows


_staging: dict[torch.device, _MaskStaging] = {}


FILL_THREADS = 4  # 0: one matcher after another; n: xgrammar's BatchGrammarMatcher on n threads (and batch accepts)
ACCEPT_THREADS = 4  # a decode step's batch accept split over at most this many threads (xgrammar's is serial)
ACCEPT_CHUNK_ROWS = 16  # rows a thread takes at the least
PINNED_STAGING = True  # CUDA: masks staged in reused pinned buffers; False: a fresh pageable buffer each step


@functools.cache
def _batch_matcher(threads: int) -> Any:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=threads)


@functools.cache
def _mask_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="paged-backend-masks")


@functools.cache
def _accept_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="paged-backend-accepts")


def _batch_accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
    """xgrammar's batch accept of one token each, in up to ``ACCEPT_THREADS`` chunks at once: the calls release
    the GIL, so the chunks run in parallel (the caller takes the first)."""
    import xgrammar as xgr

    accept = xgr.BatchGrammarMatcher.batch_accept_token
    n = len(matchers)
    chunks = min(ACCEPT_THREADS, n // ACCEPT_CHUNK_ROWS)
    if chunks <= 1:
        return accept(matchers, tokens)
    cut = [n * i // chunks for i in range(chunks + 1)]
    pool = _accept_pool(ACCEPT_THREADS - 1)
    rest = [pool.submit(accept, matchers[a:b], tokens[a:b]) for a, b in zip(cut[1:-1], cut[2:], strict=True)]
    first = accept(matchers[: cut[1]], tokens[: cut[1]])
    return first + [ok for f in rest for ok in f.result()]


@dataclass
class StagedMasks:
    """A step's filled masks, packed: ``mask`` row i belongs to logits row ``rows_of[i]``."""

    rows_of: list[int]
    mask: torch.Tensor  # int32 [>= len(rows_of), words] on the host
    row_index: torch.Tensor  # int32 [>= len(rows_of)] on the host (the rows, for the device)
    staging: _MaskStaging | None  # the pinned buffers they live in (CUDA)


def accept_all(pending: Sequence[tuple[RequestGrammar, Sequence[int]]]) -> None:
    """Each grammar takes its new tokens; one token each (a decode step) goes through xgrammar's batch
    accept (``_batch_accept``)."""
    if not (FILL_THREADS and len(pending) > 1 and all(len(t) == 1 for _, t in pending)):
        for grammar, tokens in pending:
            grammar.accept(tokens)
        return
    live = [(g, int(t[0])) for g, t in pending if g.constrains]
    if live:
        ok = _batch_accept([g._matcher for g, _ in live], [t for _, t in live])
        for (grammar, _), good in zip(live, ok, strict=True):
            if not good:
                grammar.broken = True
    for grammar, tokens in pending:
        grammar.accepted += len(tokens)


def fill_masks(pending: Sequence[tuple[int, RequestGrammar, Sequence[int]]], vocab_size: int,
               device: torch.device) -> StagedMasks | None:
    """Each (logits row, grammar, its new output tokens) takes the tokens, then the rows still constrained get
    their masks of allowed next tokens; None when no row is constrained. Host work only (no CUDA call)."""
    job = _prepare_fill(pending, vocab_size, device)
    return None if job is None else job.run()


@dataclass
class _FillJob:
    """A step's masks to fill: the live rows' matchers (mask row i is ``matchers[i]``), into ``staged``."""

    matchers: list[Any]
    staged: StagedMasks

    def run(self) -> StagedMasks:
        n = len(self.matchers)
        if FILL_THREADS and n > 1:  # one call into xgrammar, which releases the GIL for all of it
            _batch_matcher(FILL_THREADS).batch_fill_next_token_bitmask(self.matchers, self.staged.mask,
                                                                       indices=list(range(n)))
        else:
            for i, matcher in enumerate(self.matchers):
                matcher.fill_next_token_bitmask(self.staged.mask, i)
        return self.staged

    def run_started(self, started: threading.Event) -> StagedMasks:
        started.set()
        return self.run()


def _prepare_fill(pending: Sequence[tuple[int, RequestGrammar, Sequence[int]]], vocab_size: int,
                  device: torch.device) -> _FillJob | None:
    """The accepts of ``pending``'s tokens, and the buffers and rows of the masks still to fill (None: no row is
    constrained)."""
    accept_all([(g, tokens) for _, g, tokens in pending])
    live = [(row, g) for row, g, _ in pending if g.constrains]
    if not live:
        return None
    n, words = len(live), (vocab_size + 31) // 32
    staging = None
    if device.type == "cuda" and PINNED_STAGING:
        staging = _staging.setdefault(device, _MaskStaging())
        mask, row_index = staging.buffers(n, words)
    else:
        mask, row_index = torch.empty((n, words), dtype=torch.int32), torch.empty((n,), dtype=torch.int32)
    rows_of = [row for row, _ in live]
    row_index.numpy()[:n] = rows_of
    return _FillJob([g._matcher for _, g in live], StagedMasks(rows_of, mask, row_index, staging))


HANDOFF_TIMEOUT_S = 0.5  # the longest the caller waits for the mask thread to start a fill


def fill_masks_ahead(pending: Sequence[tuple[int, RequestGrammar, Sequence[int]]], vocab_size: int,
                     device: torch.device) -> Future[StagedMasks | None]:
    """``fill_masks`` with the fill on the mask thread, while the caller goes on with its own work. The accepts
    and buffers are made here; the caller then waits until the mask thread has started, so that the GIL passes
    to it at once: a thread waiting for the GIL otherwise runs only when the holder blocks or after the
    interpreter's switch interval (5 ms, longer than a step), and the fill would start when the caller
    waits for its result. The fill itself is one xgrammar call outside the GIL."""
    job = _prepare_fill(pending, vocab_size, device)
    if job is None:
        done: Future[StagedMasks | None] = Future()
        done.set_result(None)
        return done
    started = threading.Event()
    future = _mask_thread().submit(job.run_started, started)
    started.wait(HANDOFF_TIMEOUT_S)
    return future


def apply_masks(logits: torch.Tensor, staged: StagedMasks) -> None:
    """Masks ``logits`` [R, V] in place with ``staged`` (forbidden tokens -inf)."""
    import xgrammar as xgr

    n = len(staged.rows_of)
    dev_mask = staged.mask[:n].to(logits.device, non_blocking=True)
    index = staged.row_index[:n].to(logits.device, non_blocking=True).long()
    if staged.staging is not None:  # the pinned buffers are refilled only after these copies ran
        staged.staging.event = torch.cuda.Event()
        staged.staging.event.record()
    with torch.inference_mode():  # the step's logits are inference tensors
        packed = logits[index]  # the live rows, masked, then put back
        xgr.apply_token_bitmask_inplace(packed, dev_mask)
        logits.index_copy_(0, index, packed)


def apply_grammars(logits: torch.Tensor, rows: Sequence[tuple[int, RequestGrammar, Sequence[int]]]) -> None:
    """Mask ``logits`` [R, V] in place: each (row, grammar, output ids so far) row keeps only the tokens its
    grammar allows next."""
    pending = [(row, g, outputs[g.accepted:]) for row, g, outputs in rows]
    staged = fill_masks(pending, logits.shape[1], logits.device)
    if staged is not None:
        apply_masks(logits, staged)
