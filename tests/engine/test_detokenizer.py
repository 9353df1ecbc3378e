"""``IncrementalDetokenizer`` against the straightforward algorithm it implements (the whole text kept and
searched from ``len(longest stop) - 1`` characters back at each token): the same returned stop strings and
the same deltas, over SmolLM2's real tokenizer, stop strings that span tokens, and any delta schedule."""

from __future__ import annotations

import random

import pytest
from smollm2 import tokenizer
from tokenizers.decoders import DecodeStream

from paged_backend.engine.detokenizer import IncrementalDetokenizer
from paged_backend.sampling_params import SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog. Ünïcödé ✓ and emoji 🦊 split over byte tokens; "
        "then the fox said: STOP here, or stop there? The end.\n\nSecond paragraph, same fox.")


class WholeText:
    """The reference: the whole text, searched from ``hold`` characters before each new piece."""

    def __init__(self, tok, params: SamplingParams) -> None:
        self._backend, self._stream = tok.backend_tokenizer, DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stops, self._include = params.stop, params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text, self._emitted = "", 0

    def update(self, token_id: int) -> str | None:
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        hits = [(at, s) for s in self._stops if (at := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[: at + len(stop)] if self._include else self.text[:at]
        return stop

    def delta(self, finished: bool) -> str:
        end = len(self.text) if finished or not self._stops else max(self._emitted, len(self.text) - self._hold)
        out, self._emitted = self.text[self._emitted : end], end
        return out


def _run(detok, ids: list[int], schedule: random.Random) -> tuple[list[str], str | None]:
    deltas: list[str] = []
    for tok_id in ids:
        stop = detok.update(tok_id)
        if stop is not None:
            deltas.append(detok.delta(True))
            return deltas, stop
        if schedule.random() < 0.4:  # a delta after some tokens only (several tokens a step, or a slow reader)
            deltas.append(detok.delta(False))
    deltas.append(detok.delta(True))
    return deltas, None


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("stops", [[], ["STOP"], ["fox said", "lazy"], ["🦊", "ü"], ["over the lazy dog. Ün", "e"],
                                   ["end.\n\nSecond", "nowhere"], [".", "The"], ["lazy dog."]])
def test_incremental_text_and_stops_equal_the_whole_text_algorithm(stops: list[str], include_stop: bool) -> None:
    tok = tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include_stop)
    for seed in range(6):
        got = _run(IncrementalDetokenizer(tok, params), ids, random.Random(seed))
        want = _run(WholeText(tok, params), ids, random.Random(seed))
        assert got == want, f"seed {seed}"
        if not stops:
            assert "".join(got[0]) == tok.decode(ids)


def test_a_long_output_keeps_only_its_unemitted_text() -> None:
    """Deltas taken as it runs leave only the held-back tail inside: the text is not kept twice."""
    tok = tokenizer()
    ids = tok.encode(TEXT * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["never appears"]))
    pieces = []
    for tok_id in ids:
        assert detok.update(tok_id) is None
        pieces.append(detok.delta(False))
        assert len("".join(detok._parts)) <= len("never appears") - 1
    pieces.append(detok.delta(True))
    assert "".join(pieces) == tok.decode(ids)
