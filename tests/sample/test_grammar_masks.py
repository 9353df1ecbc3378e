"""``apply_grammars``: each constrained row keeps exactly the tokens its grammar allows next, other rows are
untouched; the CUDA path (pinned staging, packed rows) masks as the CPU path does."""

from __future__ import annotations

import pytest
import torch
from smollm2 import tokenizer

from paged_backend.sample.grammar import GrammarCompiler, RequestGrammar, apply_grammars
from paged_backend.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def _allowed(grammar: RequestGrammar, vocab: int) -> torch.Tensor:
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, vocab)
    grammar.fill(mask, 0)
    bits = (mask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].bool()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_masks_keep_exactly_the_allowed_tokens(device: str) -> None:
    tok = tokenizer()
    vocab = len(tok)
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    compiled = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    grammars = [RequestGrammar(compiled) for _ in range(3)]
    outputs: list[list[int]] = [[], tok.encode('{"name": "ab'), tok.encode('{"name": "x", "n": 1')]
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    before = logits.clone()
    rows = [(0, grammars[0], outputs[0]), (2, grammars[1], outputs[1]), (4, grammars[2], outputs[2])]
    apply_grammars(logits, rows)
    for i, (row, grammar, _) in enumerate(rows):
        allowed = _allowed(grammar, vocab).to(device)
        assert 0 < int(allowed.sum()) < vocab, f"row {row}: the grammar should constrain"
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert bool(torch.isneginf(logits[row][~allowed]).all())
        assert grammar.accepted == len(outputs[i])
    for row in (1, 3):
        assert torch.equal(logits[row], before[row])


def test_masks_filled_ahead_equal_the_masks_filled_at_once_and_the_fill_has_started_on_return() -> None:
    """``fill_masks_ahead`` (the accepts on the caller's thread, the fill on the mask thread) writes the masks
    ``fill_masks`` writes, and returns only once the mask thread runs the fill: it is handed the GIL, so the
    fill overlaps the caller's work instead of waiting for the caller to block."""
    from paged_backend.sample.grammar import fill_masks, fill_masks_ahead

    tok = tokenizer()
    vocab = len(tok)
    compiled = GrammarCompiler(tok, vocab, [tok.eos_token_id]).compile(StructuredOutputsParams(json=SCHEMA))
    texts = ['{"name": "ab', '{"name": "x", "n": 1', "", '{"na']
    masks = []
    for fill in (fill_masks, fill_masks_ahead):
        grammars = [RequestGrammar(compiled) for _ in texts]
        pending = [(2 * i, g, tok.encode(t)) for i, (g, t) in enumerate(zip(grammars, texts, strict=True))]
        staged = fill(pending, vocab, torch.device("cpu"))
        if fill is fill_masks_ahead:
            assert staged.running() or staged.done()
            staged = staged.result()
        assert staged is not None and staged.rows_of == [0, 2, 4, 6]
        assert [g.accepted for g in grammars] == [len(tok.encode(t)) for t in texts]
        masks.append(staged.mask[: len(texts)].clone())
    assert torch.equal(masks[0], masks[1])
    assert bool((masks[0] != -1).any()), "the grammars should forbid some tokens"


def test_batch_accepts_split_over_threads_equal_accepts_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's accepts in four chunks on the accept threads leave every grammar where accepting its
    tokens one by one leaves it: the same masks next, the same rows broken by a token outside the grammar."""
    import paged_backend.sample.grammar as grammar_mod

    monkeypatch.setattr(grammar_mod, "ACCEPT_CHUNK_ROWS", 3)
    monkeypatch.setattr(grammar_mod, "ACCEPT_THREADS", 4)
    chunks: list[int] = []
    real = grammar_mod._accept_pool

    def counting_pool(workers: int):
        pool = real(workers)
        chunks.append(workers)
        return pool

    monkeypatch.setattr(grammar_mod, "_accept_pool", counting_pool)
    tok = tokenizer()
    vocab = len(tok)
    compiled = GrammarCompiler(tok, vocab, [tok.eos_token_id]).compile(StructuredOutputsParams(json=SCHEMA))
    good = ['{"name": "abc", "n": 12}', '{"name": "x y z", "n": 3}', '{"name": "q", "n": 7}']
    texts = ['{"n": 1}' if i in (1, 11) else good[i % 3] for i in range(16)]  # rows 1 and 11 break
    ids = [tok.encode(t) for t in texts]
    steps = min(len(i) for i in ids)
    split = [RequestGrammar(compiled) for _ in texts]
    alone = [RequestGrammar(compiled) for _ in texts]
    for step in range(steps):
        grammar_mod.accept_all([(g, [i[step]]) for g, i in zip(split, ids, strict=True)])
        for g, i in zip(alone, ids, strict=True):
            g.accept([i[step]])
        assert [g.broken for g in split] == [g.broken for g in alone]
        assert [g.accepted for g in split] == [step + 1] * len(texts)
        for a, b in zip(split, alone, strict=True):
            if b.constrains:
                assert torch.equal(_allowed(a, vocab), _allowed(b, vocab))
    assert chunks, "the accepts should have been split over the accept threads"
    assert any(g.broken for g in alone) and not all(g.broken for g in alone), "some rows should break, not all"
