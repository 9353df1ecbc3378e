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
are left unmasked. Logprobs then describe the masked distribution, as vLLM's do.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from paged_backend.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info)

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


BATCH_FILL_MIN_ROWS = 2  # constrained rows from which a step fills its masks on xgrammar's thread pool


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

    @staticmethod
    def fill_many(grammars: Sequence[RequestGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """``fill`` of several matchers at once, on xgrammar's thread pool (outside the GIL)."""
        _batch_matcher().batch_fill_next_token_bitmask([g._matcher for g in grammars], bitmask, indices=rows)


@functools.cache
def _batch_matcher() -> Any:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher()


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
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    if len(live) >= BATCH_FILL_MIN_ROWS:
        RequestGrammar.fill_many([g for _, g in live], bitmask, [row for row, _ in live])
    else:
        for row, grammar in live:
            grammar.fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=[row for row, _ in live])
