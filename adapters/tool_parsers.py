"""Tool calls in model output, by vLLM's ``--tool-call-parser`` names (pure Python, no engine).

Each parser reads the whole output text so far, ``parse(text, final)``: the content around the calls
and the calls, each a name and its arguments (an OpenAI ``arguments`` JSON string). While the
output is still running (``final=False``) every part is a stable prefix of what the finished text
gives: text that may still turn out to be (part of) a call is held back, a call appears once its
name is complete, and arguments grow only by appending. Streaming is then the difference between
successive parses (``StreamedCalls`` in ``openai_tools``), and it adds up to the unstreamed result.

    hermes        Hermes / Qwen2.5 / Qwen3: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3_json   Llama 3.1 / 3.2: {"name": ..., "parameters": {...}} (after <|python_tag|> or not),
                  several separated by ';'
    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS
                  \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    glm45         GLM-4.5 / 4.6 / 4.7: <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...
                  </tool_call>; a value is a string where the tool's schema says so, else JSON if it parses

JSON arguments are passed on as the model wrote them (only the whitespace around them dropped), so a
streamed call's argument fragments concatenate to exactly the unstreamed ``arguments``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null")


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""  # a prefix of the final JSON text while the output runs


@dataclass
class ParsedOutput:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class _Invalid(Exception):
    pass


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def _scan_string(s: str, i: int) -> int | None:
    """End (after the closing quote) of the JSON string at ``s[i] == '"'``; None when it is unfinished."""
    j, n = i + 1, len(s)
    while j < n:
        c = s[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def _scan_value(s: str, i: int) -> int | None:
    """End of the JSON value starting at ``s[i]``; None when it may go on; ``_Invalid`` when it cannot be JSON."""
    n = len(s)
    c = s[i]
    if c == '"':
        return _scan_string(s, i)
    if c in "{[":
        stack = []
        j = i
        while j < n:
            c = s[j]
            if c == '"':
                end = _scan_string(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                stack.append("}" if c == "{" else "]")
            elif c in "}]":
                if not stack or stack.pop() != c:
                    raise _Invalid
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and s[j] not in ",}] \t\r\n":
        j += 1
    if j == n:
        if not any(w.startswith(s[i:]) for w in ("true", "false", "null")) and not re.fullmatch(r"-?[\d.eE+-]*", s[i:]):
            raise _Invalid
        return None
    if not _SCALAR.fullmatch(s[i:j]):
        raise _Invalid
    return j


@dataclass
class _ObjectScan:
    fields: dict[str, tuple[int, int | None]]  # key -> (value start, value end or None while it runs)
    end: int | None  # after the closing brace; None while the object runs
    invalid: bool = False


def _scan_object(s: str, i: int) -> _ObjectScan:
    """The top-level fields of the JSON object at ``s[i] == '{'`` as far as the text goes."""
    fields: dict[str, tuple[int, int | None]] = {}
    n = len(s)
    j = _skip_ws(s, i + 1)
    if j < n and s[j] == "}":
        return _ObjectScan(fields, j + 1)
    while j < n:
        if s[j] != '"':
            return _ObjectScan(fields, None, invalid=True)
        end = _scan_string(s, j)
        if end is None:
            break
        try:
            key = json.loads(s[j:end])
        except ValueError:
            return _ObjectScan(fields, None, invalid=True)
        j = _skip_ws(s, end)
        if j >= n:
            break
        if s[j] != ":":
            return _ObjectScan(fields, None, invalid=True)
        j = _skip_ws(s, j + 1)
        if j >= n:
            break
        try:
            vend = _scan_value(s, j)
        except _Invalid:
            return _ObjectScan(fields, None, invalid=True)
        fields[key] = (j, vend)
        if vend is None:
            break
        j = _skip_ws(s, vend)
        if j >= n:
            break
        if s[j] == "}":
            return _ObjectScan(fields, j + 1)
        if s[j] != ",":
            return _ObjectScan(fields, None, invalid=True)
        j = _skip_ws(s, j + 1)
    return _ObjectScan(fields, None)


def _json_arguments(s: str, span: tuple[int, int | None] | None, done: bool) -> str:
    """The arguments text of a value span: the JSON as written (a JSON string holding JSON is unwrapped);
    while it runs, the part written so far of an object or array, nothing of a scalar."""
    if span is None:
        return "{}" if done else ""
    start, end = span
    if end is not None:
        raw = s[start:end]
        if raw.startswith('"'):
            try:
                return str(json.loads(raw)).strip()
            except ValueError:
                return raw
        return raw
    if s[start] in "{[":
        return s[start:].rstrip()
    return ""


def json_object_call(s: str, i: int, arg_keys: Sequence[str]) -> tuple[ParsedCall | None, int | None, bool]:
    """The call written as a JSON object at ``s[i] == '{'`` (``{"name": ..., <arg key>: ...}``).

    Returns (call or None while its name is unknown, end of the object or None, whether it cannot be a call)."""
    scan = _scan_object(s, i)
    name_span = scan.fields.get("name")
    name = None
    if name_span is not None and name_span[1] is not None:
        try:
            value = json.loads(s[name_span[0]:name_span[1]])
        except ValueError:
            value = None
        name = value if isinstance(value, str) and value else None
    not_a_call = (scan.invalid or scan.end is not None) and name is None
    if name is None:
        return None, scan.end, not_a_call
    span = next((scan.fields[k] for k in arg_keys if k in scan.fields), None)
    done = scan.end is not None or scan.invalid
    return ParsedCall(name, _json_arguments(s, span, done)), scan.end, False


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolParser:
    """One request's parser of tool calls in its output (``tools``: the request's tool list, OpenAI's shape)."""

    name = ""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools or () if isinstance(t.get("function"), dict)}

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


class _Segments:
    """Content around calls: text before the first call loses its trailing whitespace, text after a call
    its whitespace on both sides; text of an output with no call is kept as written once final."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.calls: list[ParsedCall] = []

    def before_call(self, text: str) -> None:
        self.parts.append(text.strip() if self.calls else text.rstrip())

    def tail(self, text: str, final: bool) -> None:
        if self.calls:
            self.parts.append(text.strip())
        else:
            self.parts.append(text if final else text.rstrip())

    def end(self, text: str, final: bool, start: str) -> ParsedOutput:
        """The result, with ``text`` (after the last call) as the tail; while not final, an end of it that
        may still grow into ``start`` is held back."""
        if not final:
            text = text[:len(text) - _held_prefix(text, start)]
        self.tail(text, final)
        return self.result()

    def result(self) -> ParsedOutput:
        return ParsedOutput("".join(self.parts), self.calls)


class TaggedJsonParser(ToolParser):
    """Calls as JSON objects between a start and an end tag (Hermes' ``<tool_call>``)."""

    start = "<tool_call>"
    end = "</tool_call>"
    arg_keys: tuple[str, ...] = ("arguments", "parameters")

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = _Segments()
        pos = search = 0
        n = len(text)
        while True:
            k = text.find(self.start, search)
            if k < 0:
                return out.end(text[pos:], final, self.start)
            j = _skip_ws(text, k + len(self.start))
            call, obj_end, not_a_call = (json_object_call(text, j, self.arg_keys) if j < n and text[j] == "{"
                                         else (None, None, j < n))
            if call is None:
                if not_a_call or final:  # not a call after all: its text stays in the content
                    close = text.find(self.end, k)
                    search = close + len(self.end) if close >= 0 else k + len(self.start)
                    continue
                out.before_call(text[pos:k])  # may still become a call: held back
                return out.result()
            out.before_call(text[pos:k])
            out.calls.append(call)
            if obj_end is None:
                return out.result()
            close = text.find(self.end, obj_end)
            if close < 0:
                return out.result()
            pos = search = close + len(self.end)


class HermesToolParser(TaggedJsonParser):
    name = "hermes"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the whole output is ``{"name": ..., "parameters": ...}`` objects joined by ';'."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        n = len(text)
        i = _skip_ws(text, 0)
        if text.startswith(self.python_tag, i):
            i = _skip_ws(text, i + len(self.python_tag))
        elif not final and self.python_tag.startswith(text[i:]):
            return ParsedOutput()
        if i >= n:
            return ParsedOutput(text if final else "")
        if text[i] != "{":
            return ParsedOutput(text if final else text.rstrip())
        calls: list[ParsedCall] = []
        while True:
            call, obj_end, not_a_call = json_object_call(text, i, ("parameters", "arguments"))
            if call is None:
                if calls:
                    rest = text[i:]
                    return ParsedOutput(rest.strip() if final or not_a_call else "", calls)
                if not_a_call or final:
                    return ParsedOutput(text if final else text.rstrip())
                return ParsedOutput()
            calls.append(call)
            if obj_end is None:
                return ParsedOutput("", calls)
            j = _skip_ws(text, obj_end)
            if j < n and text[j] == ";":
                i = _skip_ws(text, j + 1)
                if i >= n:
                    return ParsedOutput("", calls)
                if text[i] == "{":
                    continue
                j = i
            rest = text[j:]
            return ParsedOutput(rest.strip(), calls)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    calls_begin = "<｜tool▁calls▁begin｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    sep = "<｜tool▁sep｜>"
    call_end = "<｜tool▁call▁end｜>"
    calls_end = "<｜tool▁calls▁end｜>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = _Segments()
        k = text.find(self.calls_begin)
        if k < 0:
            tail = text if final else text[:len(text) - _held_prefix(text, self.calls_begin)]
            out.tail(tail, final)
            return out.result()
        out.before_call(text[:k])
        pos = k + len(self.calls_begin)
        n = len(text)
        while True:
            j = _skip_ws(text, pos)
            if text.startswith(self.call_begin, j):
                call, pos = self._call(text, j + len(self.call_begin), final)
                if call is None:
                    return out.result()
                out.calls.append(call)
                if pos is None:
                    return out.result()
                continue
            if text.startswith(self.calls_end, j):
                out.tail(text[j + len(self.calls_end):], final)
            elif final and j < n and not self.call_begin.startswith(text[j:]):
                out.tail(text[j:], final)
            return out.result()

    def _call(self, text: str, i: int, final: bool) -> tuple[ParsedCall | None, int | None]:
        sep = text.find(self.sep, i)
        if sep < 0:
            return None, None
        start = sep + len(self.sep)
        nl = text.find("\n", start)
        if nl < 0:
            return (ParsedCall(text[start:].strip(), "") if final and text[start:].strip() else None), None
        call = ParsedCall(text[start:nl].strip())
        j = _skip_ws(text, nl)
        if text.startswith("```", j):
            j += 3
            if text.startswith("json", j):
                j += 4
        elif not final and "```".startswith(text[j:]):
            return call, None
        j = _skip_ws(text, j)
        if j >= len(text):
            return call, None
        try:
            end = _scan_value(text, j)
        except _Invalid:
            end = None
            close = text.find("\n```", j)
            call.arguments = text[j:close].strip() if close >= 0 else (text[j:].strip() if final else "")
            return call, None if close < 0 else self._after(text, close)
        call.arguments = _json_arguments(text, (j, end), final)
        if end is None:
            return call, None
        return call, self._after(text, end)

    def _after(self, text: str, i: int) -> int | None:
        e = text.find(self.call_end, i)
        return None if e < 0 else e + len(self.call_end)


class Glm45ToolParser(ToolParser):
    name = "glm45"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = _Segments()
        pos = 0
        while True:
            k = text.find(self.start, pos)
            if k < 0:
                return out.end(text[pos:], final, self.start)
            call, stop = self._call(text, k + len(self.start), final)
            if call is None:
                out.before_call(text[pos:k])
                return out.result()
            out.before_call(text[pos:k])
            out.calls.append(call)
            if stop is None:
                return out.result()
            pos = stop

    def _call(self, text: str, i: int, final: bool) -> tuple[ParsedCall | None, int | None]:
        ends = [e for e in (text.find("\n", i), text.find("<arg_key>", i), text.find(self.end, i)) if e >= 0]
        if not ends:
            name = text[i:].strip()
            return (ParsedCall(name, "{}") if final and name else None), None
        name_end = min(ends)
        name = text[i:name_end].strip()
        if not name:
            return None, None
        props = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        pairs: list[str] = []
        j = name_end
        closed = None
        while True:
            j = _skip_ws(text, j)
            if text.startswith(self.end, j):
                closed = j + len(self.end)
                break
            if not text.startswith("<arg_key>", j):
                break
            ke = text.find("</arg_key>", j)
            if ke < 0:
                break
            key = text[j + len("<arg_key>"):ke].strip()
            v = _skip_ws(text, ke + len("</arg_key>"))
            if not text.startswith("<arg_value>", v):
                break
            ve = text.find("</arg_value>", v)
            if ve < 0:
                break
            raw = text[v + len("<arg_value>"):ve]
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: "
                         f"{json.dumps(self._value(raw, props.get(key)), ensure_ascii=False)}")
            j = ve + len("</arg_value>")
        body = "{" + ", ".join(pairs) if pairs else ""
        if closed is not None or final:
            return ParsedCall(name, (body or "{") + "}"), closed
        return ParsedCall(name, body), None

    @staticmethod
    def _value(raw: str, schema: Any) -> Any:
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return raw


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, DeepSeekV3ToolParser, Glm45ToolParser)
}


def tool_parser(name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolParser:
    """The parser registered under vLLM's name ``name``; ValueError naming the known ones."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return cls(tools)
