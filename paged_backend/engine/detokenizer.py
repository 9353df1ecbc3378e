"""Incremental detokenization and stop strings.

Text is decoded token by token with the tokenizers library's ``DecodeStream`` (it holds
back bytes of an unfinished UTF-8 character). Stop strings are searched in the new text
plus a tail of the old one; while a request runs, the last ``len(longest stop) - 1``
characters are held back so a stop string is never emitted in part. The text not yet emitted
is kept in pieces, joined when ``delta`` asks for it, and a stop string is searched in the
held-back tail plus the new piece only, so a token costs the same at the end of a long output
as at its start.
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
        self._parts: list[str] = []  # the text not yet returned by ``delta``, in pieces (joined by ``delta``)
        self._tail = ""  # the text's last ``_hold`` characters (never returned while the request runs)

    def update(self, token_id: int) -> str | None:
        """Add one token; returns the stop string it completed, if any (text is cut there)."""
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        self._parts.append(piece)
        if not self._stops:
            return None
        window = self._tail + piece
        self._tail = window[-self._hold:] if self._hold else ""
        hits = [(at, stop) for stop in self._stops if (at := window.find(stop)) >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        text = "".join(self._parts)  # ends with ``window``: the tail is held back, so it is not emitted yet
        cut = len(text) - len(window) + at + (len(stop) if self._include_stop else 0)
        self._parts = [text[:cut]]
        return stop

    def delta(self, finished: bool) -> str:
        """New text that is safe to show now."""
        text = "".join(self._parts)
        end = len(text) if finished or not self._stops else max(0, len(text) - self._hold)
        self._parts = [text[end:]] if end < len(text) else []
        return text[:end]
