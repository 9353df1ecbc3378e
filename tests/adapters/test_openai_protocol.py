"""The OpenAI protocol layer without a model: request mapping and OpenAI-shaped errors."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from paged_backend.adapters.api import AdapterError
from paged_backend.adapters.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from paged_backend.adapters.openai_server import (
    _completion_logprobs,
    _message_dicts,
    _TokenText,
    chat_sampling_params,
    completion_sampling_params,
    create_openai_app,
)


@pytest.fixture(scope="module")
def client():
    with TestClient(create_openai_app(prefix="/v1"), raise_server_exceptions=False) as c:
        yield c


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_malformed_json_is_400(client):
    err = _error(client.post("/v1/chat/completions", content=b'{"model": "m", "messages": [',
                             headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error" and "not valid JSON" in err["message"]


def test_missing_field_is_400_naming_it(client):
    err = _error(client.post("/v1/chat/completions", json={"model": "m"}), 400)
    assert err["param"] == "messages" and "messages" in err["message"]
    err = _error(client.post("/v1/completions", json={"model": "m"}), 400)
    assert err["param"] == "prompt"


def test_mistyped_field_is_400(client):
    err = _error(client.post("/v1/chat/completions", json={"messages": [], "n": "many"}), 400)
    assert err["param"] == "n"


def test_no_engine_is_503_and_unknown_route_404(client):
    assert _error(client.get("/v1/models"), 503)["type"] == "service_unavailable_error"
    _error(client.get("/v1/nothing"), 404)
    assert client.get("/v1/health").status_code == 503 and client.get("/v1/version").status_code == 200
    _error(client.post("/v1/tokenize", json={"prompt": "x"}), 503)


REFUSED_CHAT = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("reasoning_effort", "low"),
    ("modalities", ["text", "audio"]),
    ("store", True),
    ("guided_decoding_backend", "outlines"),
    ("guided_whitespace_pattern", " "),
]


@pytest.mark.parametrize("field,value", REFUSED_CHAT, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED_CHAT)])
def test_unimplemented_openai_fields_are_refused_naming_them(client, field, value):
    err = _error(client.post("/v1/chat/completions", json={"messages": [], field: value}), 400)
    assert err["param"] == field and "not supported" in err["message"]


def test_neutral_values_of_unimplemented_fields_and_harmless_fields_pass(client):
    body = {"messages": [], "response_format": {"type": "json_object"}, "tools": [], "tool_choice": "none",
            "parallel_tool_calls": True, "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
            "prompt_cache_key": "p", "modalities": ["text"], "logit_bias": {"5": 1.0}}
    assert client.post("/v1/chat/completions", json=body).status_code == 503  # valid; no engine here
    err = _error(client.post("/v1/completions", json={"prompt": "x", "best_of": 3}), 400)
    assert err["param"] == "best_of"


def test_structured_outputs_come_from_response_format_structured_outputs_or_guided_fields():
    msgs = [ChatMessage(role="user", content="hi")]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [({"response_format": {"type": "json_object"}}, "json_object", True),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              "json", schema),
             ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
             ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
             ({"guided_json": schema}, "json", schema), ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"')]
    for extra, kind, value in cases:
        spec = chat_sampling_params(ChatCompletionRequest(messages=msgs, **extra))[0].structured_outputs
        assert spec.kind == kind and getattr(spec, "json_schema" if kind == "json" else kind) == value
    plain = chat_sampling_params(ChatCompletionRequest(messages=msgs, response_format={"type": "text"}))[0]
    assert plain.structured_outputs is None
    spec = completion_sampling_params(CompletionRequest(prompt="x", guided_regex="a+"))[0].structured_outputs
    assert spec.regex == "a+"
    for extra, param in [({"response_format": {"type": "xml"}}, "response_format"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                          "response_format"),
                         ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                         ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                         ({"structured_outputs": {"xml": "a"}}, "structured_outputs")]:
        with pytest.raises(AdapterError) as exc:
            chat_sampling_params(ChatCompletionRequest(messages=msgs, **extra))
        assert exc.value.param.split(".")[0] == param, (extra, exc.value.message)


def test_seed_outside_64_bits_is_refused_naming_it(client):
    err = _error(client.post("/v1/chat/completions", json={"messages": [], "seed": 2**64}), 400)
    assert err["param"] == "seed"


def test_logit_bias_keys_and_stream_options_need_their_context():
    msgs = [ChatMessage(role="user", content="hi")]
    params, _ = chat_sampling_params(ChatCompletionRequest(messages=msgs, logit_bias={"50": -100, "7": 2.5},
                                                           allowed_token_ids=[7, 50]))
    assert params.logit_bias == {50: -100.0, 7: 2.5} and params.allowed_token_ids == [7, 50]
    with pytest.raises(AdapterError, match="token ids") as exc:
        chat_sampling_params(ChatCompletionRequest(messages=msgs, logit_bias={"hello": 1.0}))
    assert exc.value.param == "logit_bias"
    with pytest.raises(AdapterError, match=r"\[-100, 100\]") as exc:
        completion_sampling_params(CompletionRequest(prompt="x", logit_bias={"5": 300.0}))
    assert exc.value.param == "logit_bias"
    with pytest.raises(AdapterError, match="stream=True") as exc:
        completion_sampling_params(CompletionRequest(prompt="x", stream_options={"include_usage": True}))
    assert exc.value.param == "stream_options"


def test_chat_fields_map_to_sampling_params():
    body = ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=5,
                                 max_completion_tokens=9, logprobs=True, top_logprobs=3, top_k=4, stop="x", seed=1)
    params, names = chat_sampling_params(body)
    assert (params.max_tokens, params.logprobs, params.top_k, params.stop, params.seed) == (9, 3, 4, ["x"], 1)
    assert names["max_tokens"] == "max_completion_tokens"
    plain, _ = chat_sampling_params(ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")]))
    assert plain.max_tokens is None and plain.logprobs is None  # chat: up to the context


def test_chat_error_names_the_field_the_user_sent():
    body = ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")], max_completion_tokens=0)
    with pytest.raises(AdapterError) as ei:
        chat_sampling_params(body)
    assert ei.value.param == "max_completion_tokens"
    with pytest.raises(AdapterError) as ei:
        chat_sampling_params(ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")],
                                                   top_logprobs=2))
    assert ei.value.param == "top_logprobs"


def test_completion_echo_with_logprobs_asks_for_prompt_logprobs():
    params, _ = completion_sampling_params(CompletionRequest(prompt="a", echo=True, logprobs=2))
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (16, 2, 2)
    params, _ = completion_sampling_params(CompletionRequest(prompt="a", logprobs=2))
    assert params.prompt_logprobs is None


def test_content_parts_are_joined_and_images_refused():
    msgs = _message_dicts([ChatMessage(role="user", content=[{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}])])
    assert msgs == [{"role": "user", "content": "ab"}]
    with pytest.raises(AdapterError):
        _message_dicts([ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])])
    with pytest.raises(AdapterError):
        _message_dicts([])


def test_completion_logprobs_offsets_follow_the_text():
    from transformers import AutoTokenizer

    from paged_backend.models.default_model import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    ids = tok.encode(" Paris is nice")
    lps = [{t: -0.5, 0: -1.0} for t in ids]
    out, end = _completion_logprobs(ids, lps, 1, _TokenText(tok), 10)
    assert "".join(out.tokens) == " Paris is nice"
    assert out.text_offset[0] == 10 and end == 10 + len(" Paris is nice")
    assert out.token_logprobs == [-0.5] * len(ids)
    assert all(len(t) == 1 for t in out.top_logprobs)  # top-1 is the chosen token itself here
