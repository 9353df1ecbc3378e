"""Reasoning in model output, by vLLM's ``--reasoning-parser`` names (pure Python, no engine).

``parse(text, final)`` splits the output so far into the reasoning (``reasoning_content``) and the
content after it; while the output runs both are stable prefixes of the finished split (a partial
``</think>`` is held back, as is whitespace that may end the reasoning).

    deepseek_r1   DeepSeek-R1: <think>REASONING</think>CONTENT. The output is reasoning up to </think>
                  whether or not it opens with <think> (R1's template opens it in the prompt), unless
                  the prompt already closed it (a template's thinking switched off)
    glm45         GLM-4.5 / 4.6 / 4.7: reasoning only when the output opens with <think> or the prompt
                  ends inside one; otherwise all of it is content

``prompt_tail`` (the end of the rendered prompt) tells whether the template opened or closed the
block before the output starts. The reasoning is returned without its surrounding whitespace, the
content without the whitespace that follows ``</think>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_parsers import _held_prefix

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str | None  # None: no reasoning block in this output
    content: str
    ended: bool  # the reasoning is over (content may follow)


class ReasoningParser:
    name = ""
    reason_without_start = True  # output that does not open with <think> is still reasoning

    def __init__(self, prompt_tail: str = "") -> None:
        tail = prompt_tail.rstrip()
        opened, closed = tail.rfind(THINK_START), tail.rfind(THINK_END)
        self.prompt_opened = opened >= 0 and opened > closed and tail.endswith(THINK_START)
        self.prompt_closed = closed >= 0 and tail.endswith(THINK_END)

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        if self.prompt_closed:
            return ReasoningSplit(None, text, True)
        body = text.lstrip()
        if body.startswith(THINK_START):
            body = body[len(THINK_START):]
        elif not final and THINK_START.startswith(body) and not self.prompt_opened:
            return ReasoningSplit(None, "", False)  # maybe the start of <think>
        elif not (self.prompt_opened or self.reason_without_start):
            return ReasoningSplit(None, text, True)
        k = body.find(THINK_END)
        if k >= 0:
            return ReasoningSplit(body[:k].strip(), body[k + len(THINK_END):].lstrip(), True)
        if final:
            return ReasoningSplit(body.strip(), "", True)
        return ReasoningSplit(body[:len(body) - _held_prefix(body, THINK_END)].strip(), "", False)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
    reason_without_start = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Glm45ReasoningParser)
}


def reasoning_parser(name: str, prompt_tail: str = "") -> ReasoningParser:
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return cls(prompt_tail)
