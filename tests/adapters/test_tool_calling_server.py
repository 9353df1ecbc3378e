"""Tool calling end to end: a real ``bentoml serve`` of bentos/smollm2 started with vLLM's tool flags
(``enable_auto_tool_choice``, ``tool_call_parser=hermes``), driven by the official ``openai`` SDK.

``tool_choice`` "required" and a named function constrain SmolLM2's greedy output to the tools' schemas,
so every answer must be a valid call; "auto" reads calls in the Hermes format from the output (a regex
constraint makes the model write one, so the parser runs on real engine output, streamed and not).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from bento_server import MODEL, serving

pytestmark = pytest.mark.slow

ARGS = {"max_model_len": 1024, "num_gpu_blocks_override": 256, "enable_auto_tool_choice": "true",
        "tool_call_parser": "hermes"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 12}},
                                               "required": ["city"], "additionalProperties": False}}}]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("bentoml-tools"), ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _valid(name: str, arguments: str) -> dict:
    """The arguments, checked against the tool's schema (types, required, enum, no extra keys)."""
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    args = json.loads(arguments)
    assert set(schema["required"]) <= set(args) <= set(schema["properties"]), args
    for key, value in args.items():
        prop = schema["properties"][key]
        assert isinstance(value, str) and len(value) <= prop["maxLength"] if "maxLength" in prop else True
        assert value in prop.get("enum", [value])
    return args


def _streamed(client, **kw) -> tuple[list, str | None, str]:
    """(calls as [id, name, arguments], finish_reason, content) of a streamed request, deltas joined."""
    calls: dict[int, list] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.type == "function" and tc.index == len(calls) and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][2] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in range(len(calls))], finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_give_valid_calls(client, choice):
    kw = {"messages": CHAT, "tools": TOOLS, "tool_choice": choice, "max_tokens": 64, "temperature": 0}
    resp = client.chat.completions.create(model=MODEL, **kw)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        _valid(call.function.name, call.function.arguments)
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    calls, finish, content = _streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert all(i.startswith("call_") for i, _, _ in calls)


def test_parallel_tool_calls_false_gives_one_call(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=64, temperature=0)
    assert len(resp.choices[0].message.tool_calls) == 1 and resp.choices[0].finish_reason == "tool_calls"


def test_auto_reads_hermes_calls_from_the_output(client):
    kw = {"messages": CHAT, "tools": TOOLS, "max_tokens": 96, "temperature": 0,
          "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}
    resp = client.chat.completions.create(model=MODEL, **kw)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather" and _valid("get_weather", call.function.arguments)["city"] == "Paris"
    calls, finish, content = _streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]
    # no call written: the text is the content, as without tools
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert _streamed(client, messages=CHAT, tools=TOOLS, max_tokens=8, temperature=0)[2] == \
        plain.choices[0].message.content


def test_tool_history_messages_are_accepted(client):
    messages = [*CHAT,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert resp.choices[0].message.content and resp.usage.prompt_tokens > 20


def _error(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_bad_tool_requests_are_400s_naming_the_field(server):
    url = f"{server.url}/v1/chat/completions"
    base = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    cases = [({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]},
              "tools[0].function.name"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]},
              "tools[0].function.parameters"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools"),
             ({"functions": [{"name": "f"}]}, "functions")]
    for extra, param in cases:
        err = _error(httpx.post(url, json={**base, **extra}, timeout=60))
        assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
    assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200

