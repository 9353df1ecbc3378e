"""Tool calling and reasoning on ``/chat/completions``, as vLLM serves them.

Request side (``tool_request``): ``tools`` is checked (OpenAI's function shape, a bad one is a 400
naming the field) and handed to the chat template; ``tool_choice`` picks how calls come out:

    none            the tools reach the template, the output is plain content
    auto            (the default when tools are sent) the model may write calls in its own format; the
                    server's ``tool_call_parser`` (``--tool-call-parser``) finds them. Needs
                    ``enable_auto_tool_choice`` and a parser, else a 400 (vLLM's rule)
    required        the output is constrained (structured outputs) to a JSON array of
                    ``{"name": <one of the tools>, "parameters": {...}}``, at least one, one at most
                    when ``parallel_tool_calls`` is false
    {"type": "function", "function": {"name": N}}
                    the output is constrained to N's ``parameters`` schema: the call's arguments

Output side (``OutputParser``): the server's ``reasoning_parser`` takes the reasoning off the front,
then the tool parser (or the constraint's own reading) splits the rest into content and calls.
``StreamedChoice`` turns successive parses of a growing output into OpenAI deltas
(``reasoning_content``, ``content``, ``tool_calls``: a first delta per call with index, id, type and
name, then argument fragments); concatenated, they equal the unstreamed message.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .adapter_errors import AdapterError
from .openai_protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from .reasoning_parsers import ReasoningParser, reasoning_parser
from .serving_options import ServingOptions
from .tool_parsers import ParsedCall, ParsedOutput, ToolParser, json_object_call, tool_parser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the request ---------------------------------------------------------------------------

@dataclass
class ToolRequest:
    tools: list[dict[str, Any]] | None = None  # for the chat template (OpenAI's shape)
    mode: str = "none"  # none | auto | required | named
    named: str | None = None
    parallel: bool = True
    constraint: dict[str, Any] | None = None  # structured-outputs spec of required / named

    @property
    def parses_output(self) -> bool:
        return self.mode != "none"


def _check_tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise AdapterError("'tools' must be a list of tools.", param="tools")
    names: set[str] = set()
    out = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise AdapterError(f"'{where}' must be an object.", param=where)
        if tool.get("type", "function") != "function":
            raise AdapterError(f"'{where}.type' must be 'function' (got {str(tool.get('type'))[:40]!r}).",
                               param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise AdapterError(f"Missing required parameter: '{where}.function'.", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise AdapterError(f"Invalid '{where}.function.name': a function name is 1 to 64 letters, digits, "
                               f"'_', '-', '.' or ':' (got {str(name)[:40]!r}).", param=f"{where}.function.name")
        if name in names:
            raise AdapterError(f"Duplicate function name {name!r} in 'tools'.", param=f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise AdapterError(f"'{where}.function.parameters' must be a JSON schema of type 'object'.",
                               param=f"{where}.function.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise AdapterError(f"'{where}.function.description' must be a string.",
                               param=f"{where}.function.description")
        out.append({"type": "function", "function": dict(fn)})
    return out


def _parameters(fn: Mapping[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def tool_request(body: ChatCompletionRequest, options: ServingOptions) -> ToolRequest:
    """What the request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` ask for; a 400 naming the field
    when they do not fit together (vLLM's rules)."""
    tools = _check_tools(body.tools) if body.tools is not None else None
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return ToolRequest(tools or None, "none", parallel=parallel)
    if tools is None:
        raise AdapterError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise AdapterError(AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolRequest(tools, "auto", parallel=parallel)
    if choice == "required":
        if not tools:  # OpenAI: required with no tools behaves as none
            return ToolRequest(None, "none", parallel=parallel)
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": _parameters(t["function"])},
                  "required": ["name", "parameters"]} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolRequest(tools, "required", parallel=parallel, constraint={"json": schema})
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(fn, dict):
            raise AdapterError(f"Invalid value for `tool_choice`. {_NAMED_USAGE}", param="tool_choice")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise AdapterError(f"Expected field `name` in `function` in `tool_choice`. {_NAMED_USAGE}",
                               param="tool_choice")
        match = next((t for t in tools if t["function"]["name"] == name), None)
        if match is None:
            raise AdapterError(f"The tool specified in `tool_choice` ({name[:64]!r}) does not match any of the "
                               "specified `tools`.", param="tool_choice")
        return ToolRequest(tools, "named", named=name, parallel=parallel,
                           constraint={"json": _parameters(match["function"])})
    raise AdapterError(f"Invalid value for `tool_choice`: {str(choice)[:40]!r}. Only named tools, \"none\", \"auto\" "
                       "or \"required\" are supported.", param="tool_choice")


# -- history messages ----------------------------------------------------------------------

def template_tool_calls(calls: Any, index: int, text_arguments: bool = False) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the chat template: arguments as a mapping, as most templates
    take them (``tojson``, ``.items()``), or as the JSON text the client sent (``text_arguments``: templates
    that concatenate them to a string, as DeepSeek-V3's does)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise AdapterError(f"'{where}' must be a list.", param="messages")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise AdapterError(f"'{where}[{k}]' needs a function with a name.", param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                value = json.loads(args) if args.strip() else {}
            except ValueError:
                raise AdapterError(f"'{where}[{k}].function.arguments' is not valid JSON.", param="messages") from None
            text = args
        else:
            value, text = args, json.dumps(args, ensure_ascii=False)
        if not isinstance(value, dict):
            raise AdapterError(f"'{where}[{k}].function.arguments' must be a JSON object.", param="messages")
        out.append({**call, "type": call.get("type", "function"),
                    "function": {**fn, "arguments": text if text_arguments else value}})
    return out


# -- the output ----------------------------------------------------------------------------

class _RequiredCalls(ToolParser):
    """The constrained output of ``tool_choice: required``: a JSON array of {"name", "parameters"}."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = len(text) - len(text.lstrip())
        calls: list[ParsedCall] = []
        if text[i:i + 1] == "[":
            i = _next(text, i + 1)
            while i < len(text) and text[i] == "{":
                call, end, _ = json_object_call(text, i, ("parameters", "arguments"))
                if call is None:
                    break
                calls.append(call)
                if end is None:
                    break
                i = _next(text, end)
                if text[i:i + 1] != ",":
                    break
                i = _next(text, i + 1)
        if not calls and final:
            return ParsedOutput(text)
        return ParsedOutput("", calls)


class _NamedCall(ToolParser):
    """The constrained output of a named ``tool_choice``: the arguments of that one call."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.call_name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [ParsedCall(self.call_name, text.strip())])


def _next(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


@dataclass
class ParsedMessage:
    reasoning: str | None = None
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class OutputParser:
    """One choice's output read as reasoning, content and tool calls."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel

    def parse(self, text: str, final: bool) -> ParsedMessage:
        reasoning = None
        if self.reasoning is not None:
            split = self.reasoning.parse(text, final)
            reasoning, text = split.reasoning, split.content
            if not split.ended:
                return ParsedMessage(reasoning, "")
        if self.tools is None:
            return ParsedMessage(reasoning, text)
        out = self.tools.parse(text, final)
        return ParsedMessage(reasoning, out.content, out.calls if self.parallel else out.calls[:1])


def output_parser_factory(req: ToolRequest, options: ServingOptions) -> Any:
    """A function ``(prompt_tail) -> OutputParser`` for this request, or None when the output is plain text."""
    if req.mode in ("required", "named"):  # constrained from the first token: no reasoning block
        tools: ToolParser = _RequiredCalls() if req.mode == "required" else _NamedCall(req.named or "")
        return lambda prompt_tail: OutputParser(None, tools, req.parallel)
    use_tools = req.mode == "auto" and options.tool_call_parser is not None
    if not use_tools and options.reasoning_parser is None:
        return None

    def make(prompt_tail: str) -> OutputParser:
        rp = reasoning_parser(options.reasoning_parser, prompt_tail) if options.reasoning_parser else None
        tp = tool_parser(options.tool_call_parser, req.tools) if use_tools and options.tool_call_parser else None
        return OutputParser(rp, tp, req.parallel)

    return make


def response_message(parsed: ParsedMessage) -> ChatResponseMessage:
    calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.calls]
    content: str | None = parsed.content
    if calls and not (content or "").strip():
        content = None
    return ChatResponseMessage(content=content, reasoning_content=parsed.reasoning or None, tool_calls=calls)


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class StreamedChoice:
    """One choice's stream: each growing output parsed again, what is new sent as deltas."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_args: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.sent_args)

    def feed(self, text: str, final: bool) -> list[DeltaMessage]:
        self.text += text
        parsed = self.parser.parse(self.text, final)
        out = []
        reasoning = parsed.reasoning or ""
        if len(reasoning) > self.sent_reasoning:
            out.append(DeltaMessage(reasoning_content=reasoning[self.sent_reasoning:]))
            self.sent_reasoning = len(reasoning)
        if len(parsed.content) > self.sent_content:
            out.append(DeltaMessage(content=parsed.content[self.sent_content:]))
            self.sent_content = len(parsed.content)
        calls: list[DeltaToolCall] = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.sent_args):
                calls.append(DeltaToolCall(index=i, id=new_call_id(), type="function",
                                           function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                self.sent_args.append(len(call.arguments))
            elif len(call.arguments) > self.sent_args[i]:
                calls.append(DeltaToolCall(index=i, function=DeltaFunctionCall(
                    arguments=call.arguments[self.sent_args[i]:])))
                self.sent_args[i] = len(call.arguments)
        if calls:
            out.append(DeltaMessage(tool_calls=calls))
        return out

