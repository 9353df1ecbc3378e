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
constrained step adds at small models), into pinned buffers whose copies to the device do not wait for the
stream (``PINNED_STAGING``).
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Sequence
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
        for t in output_token_ids[self.accepted:]:
            if self.broken or self._matcher.is_terminated():
                break
            if not self._matcher.accept_token(int(t)):
                self.broken = True
        self.accepted = len(output_token_ids)

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


FILL_THREADS = 4  # 0: one matcher after another; n: xgrammar's BatchGrammarMatcher on n threads
PINNED_STAGING = True  # CUDA: masks staged in pinned buffers (packed rows); False: pageable, one row per logits row


@functools.cache
def _batch_matcher(threads: int) -> Any:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=threads)


def _fill(live: list[tuple[int, RequestGrammar]], mask: torch.Tensor, mask_rows: list[int]) -> None:
    if FILL_THREADS and len(live) > 1:
        _batch_matcher(FILL_THREADS).batch_fill_next_token_bitmask([g._matcher for _, g in live], mask,
                                                                   indices=mask_rows)
    else:
        for (_, grammar), r in zip(live, mask_rows, strict=True):
            grammar.fill(mask, r)


def apply_grammars(logits: torch.Tensor, rows: Sequence[tuple[int, RequestGrammar, Sequence[int]]]) -> None:
    """Mask ``logits`` [R, V] in place: each (row, grammar, output ids so far) row keeps only the tokens its
    grammar allows next."""
    import xgrammar as xgr

    live = []
    for row, grammar, outputs in rows:
        grammar.sync(outputs)
        if grammar.constrains:
            live.append((row, grammar))
    if not live:
        return
    rows_of = [row for row, _ in live]
    if logits.device.type != "cuda" or not PINNED_STAGING:
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        _fill(live, bitmask, rows_of)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows_of)
        return
    staging = _staging.setdefault(logits.device, _MaskStaging())
    n = len(live)
    mask, rows_buf = staging.buffers(n, (logits.shape[1] + 31) // 32)
    _fill(live, mask, list(range(n)))  # the live rows packed: mask row i belongs to logits row rows_of[i]
    rows_buf.numpy()[:n] = rows_of
    dev_mask = mask[:n].to(logits.device, non_blocking=True)
    dev_rows = rows_buf[:n].to(logits.device, non_blocking=True)
    staging.event = torch.cuda.Event()
    staging.event.record()
    with torch.inference_mode():  # the step's logits are inference tensors
        index = dev_rows.long()
        packed = logits[index]  # the live rows, masked, then put back
        xgr.apply_token_bitmask_inplace(packed, dev_mask)
        logits.index_copy_(0, index, packed)
