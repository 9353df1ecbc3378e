"""Incremental detokenization and stop strings.

Text is decoded token by token with the tokenizers library's ``DecodeStream`` (it holds
back bytes of an unfinished UTF-8 character). Stop strings are searched in the new text
plus a tail of the old one; while a request runs, the last ``len(longest stop) - 1``
characters are held back so a stop string is never emitted in part.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from paged_backend.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._emitted = 0

    def update(self, token_id: int) -> str | None:
        """Add one token; returns the stop string it completed, if any (text is cut there)."""
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        hits = [(at, stop) for stop in self._stops if (at := self.text.find(stop, search_from)) >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop

    def delta(self, finished: bool) -> str:
        """New text that is safe to show now."""
        end = len(self.text) if finished or not self._stops else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
