"""Tool-call and reasoning parsers against real renderings of each family's public chat template.

The templates under ``chat_templates/`` are copied verbatim from the models' public files:

    qwen2_5.jinja      Qwen/Qwen2.5-7B-Instruct, tokenizer_config.json "chat_template"       (hermes)
    llama3_2.jinja     meta-llama/Llama-3.2-1B-Instruct, tokenizer_config.json "chat_template" (llama3_json)
    deepseek_v3.jinja  deepseek-ai/DeepSeek-V3, tokenizer_config.json "chat_template"        (deepseek_v3)
    deepseek_r1.jinja  deepseek-ai/DeepSeek-R1, tokenizer_config.json "chat_template"        (deepseek_r1)
    glm4_6.jinja       zai-org/GLM-4.6, chat_template.jinja (the GLM-4.5 tool format)     (glm45)

Each is rendered by transformers' ``apply_chat_template`` with the local SmolLM2 tokenizer (no network);
the assistant turn a template renders is what the model would have written, and the parser must give
back exactly the calls, content and reasoning that went in. Fed piece by piece, the stream's deltas
must add up to the same message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paged_backend.adapters.adapter_errors import AdapterError
from paged_backend.adapters.openai_chat import _message_dicts, chat_template_kwargs
from paged_backend.adapters.openai_protocol import ChatCompletionRequest, ChatMessage
from paged_backend.adapters.openai_tools import (
    AUTO_NEEDS_FLAGS,
    OutputParser,
    StreamedChoice,
    response_message,
    tool_request,
)
from paged_backend.adapters.reasoning_parsers import reasoning_parser
from paged_backend.adapters.serving_options import ServingOptions
from paged_backend.adapters.tool_parsers import TOOL_PARSERS, tool_parser
from smollm2 import tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer"},
                                          "units": {"type": "string", "enum": ["C", "F"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Web search",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string"}, "filters": {"type": "object"}}}}},
]
CALLS = [("get_weather", {"city": "Paris", "days": 3, "units": "C"}),
         ("search", {"query": "ÉtÉ à Paris \"quoted\" {braces}", "filters": {"year": 2024, "tags": ["a", "b"]}})]
USER = {"role": "user", "content": "What's the weather in Paris?"}


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def _render(template: str, messages: list[dict], **kw) -> str:
    return tokenizer().apply_chat_template(messages, tools=TOOLS, tokenize=False, chat_template=_template(template),
                                           **kw)


def _assistant_turn(template: str, content: str | None, calls, end: str, reasoning: str | None = None,
                    text_arguments: bool = False) -> tuple[str, str]:
    """(prompt, model output) of a conversation whose last turn is the assistant's, as the template renders it."""
    tool_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                  for i, (n, a) in enumerate(calls)] or None
    msgs = _message_dicts([ChatMessage(**USER), ChatMessage(role="assistant", content=content, tool_calls=tool_calls,
                                                            reasoning_content=reasoning)], text_arguments)
    prompt = _render(template, msgs[:1], add_generation_prompt=True)
    full = _render(template, msgs)
    assert full.startswith(prompt), (prompt, full)
    out = full[len(prompt):]
    return prompt, out[:out.index(end)] if end else out


def _stream(parser_factory, text: str, pieces: list[str]) -> dict:
    """The message the stream's deltas add up to (feeding ``pieces``, which join to ``text``)."""
    assert "".join(pieces) == text
    sc = StreamedChoice(parser_factory())
    content, reasoning, calls = "", "", {}
    for k, piece in enumerate(pieces):
        for d in sc.feed(piece, final=k == len(pieces) - 1):
            content += d.content or ""
            reasoning += d.reasoning_content or ""
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    assert tc.index == len(calls) and tc.type == "function" and tc.id.startswith("call_")
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.function.name is None
                    calls[tc.index][1] += tc.function.arguments
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [tuple(calls[i]) for i in range(len(calls))]}


def _splits(text: str) -> list[list[str]]:
    """Ways to cut the output: SmolLM2's tokens, every character, and fixed-size pieces."""
    tok = tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    tokens = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    by_token = [b[len(a):] for a, b in zip([""] + tokens, tokens, strict=False)]
    if "".join(by_token) != text:
        by_token = [text]
    return [by_token, list(text), *[[text[i:i + n] for i in range(0, len(text), n)] for n in (2, 5, 13)], [text]]


def _check(factory, text: str, content: str | None, calls, reasoning: str | None = None) -> None:
    msg = response_message(factory().parse(text, final=True))
    assert msg.content == content
    assert msg.reasoning_content == reasoning
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == list(calls)
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    unstreamed = {"content": msg.content, "reasoning": msg.reasoning_content,
                  "calls": [(c.function.name, c.function.arguments) for c in msg.tool_calls]}
    for pieces in _splits(text):
        assert _stream(factory, text, pieces) == unstreamed, pieces


@pytest.mark.parametrize("content", ["Let me check.", None])
def test_hermes_recovers_qwen25_calls(content):
    _, out = _assistant_turn("qwen2_5", content, CALLS, "<|im_end|>")
    _check(lambda: OutputParser(None, tool_parser("hermes", TOOLS)), out, content, CALLS)


def test_llama3_json_recovers_llama32_call():
    _, out = _assistant_turn("llama3_2", None, CALLS[:1], "<|eot_id|>")
    assert out.startswith('{"name": "get_weather", "parameters": ')
    _check(lambda: OutputParser(None, tool_parser("llama3_json", TOOLS)), out, None, CALLS[:1])
    # several calls joined by ';', after <|python_tag|> (the template renders one call per turn)
    many = "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)
    _check(lambda: OutputParser(None, tool_parser("llama3_json", TOOLS)), many, None, CALLS)


@pytest.mark.parametrize("content", ["Let me check.", None])
def test_deepseek_v3_recovers_its_calls(content):
    _, out = _assistant_turn("deepseek_v3", content, CALLS, "<｜end▁of▁sentence｜>", text_arguments=True)
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" in out
    _check(lambda: OutputParser(None, tool_parser("deepseek_v3", TOOLS)), out, content or None, CALLS)


def test_glm45_recovers_glm_calls_and_reasoning():
    prompt, out = _assistant_turn("glm4_6", "Let me check.", CALLS, "", reasoning="The user wants the weather.")
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in out
    tail = prompt[-40:]
    _check(lambda: OutputParser(reasoning_parser("glm45", tail), tool_parser("glm45", TOOLS)), out,
           "Let me check.", CALLS, reasoning="The user wants the weather.")


def test_plain_text_that_is_no_call_reaches_the_user():
    texts = {"hermes": "Use <tool_call> tags? <tool_call>not json</tool_call> and <tool_",
             "llama3_json": '{"answer": 42, "note": "no name"}',
             "deepseek_v3": "A plain answer with ``` fences\n",
             "glm45": "No call here: <tool_"}
    for name, text in texts.items():
        _check(lambda name=name: OutputParser(None, tool_parser(name, TOOLS)), text, text, [])


def test_deepseek_r1_reasoning_when_the_template_opened_think():
    prompt = _render("deepseek_r1", [USER], add_generation_prompt=True)
    assert prompt.endswith("<think>\n")
    out = "The user asks about Paris.\nIt is sunny.\n</think>\n\nIt is sunny in Paris."
    factory = lambda: OutputParser(reasoning_parser("deepseek_r1", prompt[-40:]), None)  # noqa: E731
    _check(factory, out, "It is sunny in Paris.", [], reasoning="The user asks about Paris.\nIt is sunny.")
    # the output may open the block itself, and name tools after it (hermes after reasoning)
    both = lambda: OutputParser(reasoning_parser("deepseek_r1"), tool_parser("hermes", TOOLS))  # noqa: E731
    _, calls = _assistant_turn("qwen2_5", None, CALLS[:1], "<|im_end|>")
    _check(both, "<think>Need the weather tool.</think>\n\n" + calls, None, CALLS[:1],
           reasoning="Need the weather tool.")


def test_enable_thinking_reaches_the_template_and_closes_reasoning():
    body = ChatCompletionRequest(messages=[ChatMessage(**USER)], chat_template_kwargs={"enable_thinking": False})
    kwargs = chat_template_kwargs(body, ServingOptions())
    prompt = _render("glm4_6", [USER], add_generation_prompt=True, **kwargs)
    assert prompt.endswith("<|assistant|>\n<think></think>") and "/nothink" in prompt
    parser = OutputParser(reasoning_parser("glm45", prompt[-40:]), None)
    assert response_message(parser.parse("\nIt is sunny.", final=True)).reasoning_content is None
    assert response_message(parser.parse("\nIt is sunny.", final=True)).content == "\nIt is sunny."


def test_parallel_tool_calls_false_keeps_the_first_call():
    _, out = _assistant_turn("qwen2_5", None, CALLS, "<|im_end|>")
    _check(lambda: OutputParser(None, tool_parser("hermes", TOOLS), parallel=False), out, None, CALLS[:1])


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[ChatMessage(**USER)], **kw)


def test_tool_requests_follow_vllms_rules():
    auto = ServingOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert tool_request(_request(tools=TOOLS), auto).mode == "auto"
    assert tool_request(_request(tools=TOOLS, tool_choice="none"), ServingOptions()).mode == "none"
    req = tool_request(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ServingOptions())
    schema = req.constraint["json"]
    assert req.mode == "required" and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = tool_request(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}}),
                         ServingOptions())
    assert named.named == "search" and named.constraint == {"json": TOOLS[1]["function"]["parameters"]}
    cases = [({"tools": TOOLS}, "tool_choice", AUTO_NEEDS_FLAGS),  # auto by default, and no parser here
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
              "does not match"),
             ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Invalid value"),
             ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
             ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
              "tools[0].function.name", "Invalid"),
             ({"tools": [{"type": "code"}], "tool_choice": "none"}, "tools[0].type", "'function'"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function"
              ".parameters", "JSON schema"),
             ({"tools": {"name": "f"}}, "tools", "list")]
    for extra, param, needle in cases:
        with pytest.raises(AdapterError) as exc:
            tool_request(_request(**extra), ServingOptions())
        assert exc.value.param == param and needle in exc.value.message, (extra, exc.value)


def test_options_know_vllms_parser_names():
    assert sorted(TOOL_PARSERS) == ["deepseek_v3", "glm45", "hermes", "llama3_json"]
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServingOptions(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServingOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServingOptions(reasoning_parser="qwen3")
