"""The front end's guards without a model: ServingOptions, ServingGuard (keys, body size, read
time), the internal-error guard, request-id bookkeeping and chat-template refusal."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from paged_backend.adapters.api import AdapterError
from paged_backend.adapters.http_guard import ServingGuard
from paged_backend.adapters.openai_protocol import ChatCompletionRequest
from paged_backend.adapters.openai_server import (
    InflightRequestIds,
    chat_template_kwargs,
    create_openai_app,
    install_error_handlers,
)
from paged_backend.adapters.serving_options import ServingOptions, effective_cache_salt
from pydantic import ValidationError


def test_api_keys_from_the_option_or_vllms_variable(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert ServingOptions().api_keys() == ()
    assert ServingOptions(api_key="a, b,").api_keys() == ("a", "b")
    assert ServingOptions(api_key=["c"]).api_keys() == ("c",)
    monkeypatch.setenv("VLLM_API_KEY", "env-1,env-2")
    assert ServingOptions().api_keys() == ("env-1", "env-2")
    assert ServingOptions(api_key="own").api_keys() == ("own",)
    with pytest.raises(ValidationError):
        ServingOptions(max_request_bytes=10)
    with pytest.raises(ValidationError):
        ServingOptions(no_such_option=1)


def test_cache_salt_by_user_separates_users_whatever_salt_they_send():
    assert effective_cache_salt("s", "alice", from_user=False) == "s"
    assert effective_cache_salt(None, None, from_user=True) is None
    a, b = effective_cache_salt(None, "alice", from_user=True), effective_cache_salt(None, "bob", from_user=True)
    assert a != b and a == effective_cache_salt(None, "alice", from_user=True)
    assert effective_cache_salt("s", "alice", from_user=True) != effective_cache_salt("s", "bob", from_user=True)
    assert effective_cache_salt(a, "bob", from_user=True) != a  # a salt copied from another user does not help


def _echo_app(options: ServingOptions) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(body: dict) -> dict:
        return {"size": len(str(body))}

    @app.get("/livez")
    async def livez() -> dict:
        return {}

    app.add_middleware(ServingGuard, options=options)
    return app


def test_serving_guard_checks_keys_on_protected_paths_only():
    with TestClient(_echo_app(ServingOptions(api_key="k1,k2"))) as c:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k1"}, {"authorization": "Bearer "}):
            resp = c.post("/v1/echo", json={}, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
            assert resp.headers["www-authenticate"] == "Bearer"
        for key in ("k1", "k2"):
            assert c.post("/v1/echo", json={"a": 1}, headers={"authorization": f"Bearer {key}"}).status_code == 200
        assert c.get("/livez").status_code == 200


def test_serving_guard_caps_the_body_declared_or_streamed():
    with TestClient(_echo_app(ServingOptions(max_request_bytes=2048))) as c:
        assert c.post("/v1/echo", json={"x": "y" * 1000}).status_code == 200
        resp = c.post("/v1/echo", json={"x": "y" * 5000})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
        assert len(resp.content) < 500

        def chunks():  # no content-length: counted as it arrives
            for _ in range(10):
                yield b"x" * 1000

        resp = c.post("/v1/echo", content=chunks(), headers={"content-type": "application/json"})
        assert resp.status_code == 413


def test_serving_guard_times_out_a_slow_body():
    guard = ServingGuard(None, ServingOptions(request_read_timeout=0.2))
    sent = []

    async def never() -> dict:
        await asyncio.sleep(10)
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    asyncio.run(guard(scope, never, send))
    assert sent[0]["status"] == 408


def test_an_unexpected_error_is_a_500_json_that_does_not_propagate():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("kaboom")

    with TestClient(app, raise_server_exceptions=True) as c:  # a re-raise would fail the call here
        resp = c.get("/boom")
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "internal_server_error" and "kaboom" in resp.json()["error"]["message"]


class _Engine:
    def __init__(self) -> None:
        self.live: set[str] = set()

    def has_requests(self, ids) -> bool:
        return any(i in self.live for i in ids)


def test_user_request_ids_are_taken_until_released_or_stale():
    ids, engine = InflightRequestIds(stale_after_s=60), _Engine()
    release_first = ids.claim("r", ["cmpl-1"], engine)
    with pytest.raises(AdapterError) as ei:
        ids.claim("r", ["cmpl-2"], engine)
    assert ei.value.param == "request_id" and ei.value.status == 400
    release_first()
    release_second = ids.claim("r", ["cmpl-3"], engine)
    release_first()  # a late second call of the first release: not the holder's
    with pytest.raises(AdapterError):
        ids.claim("r", ["cmpl-4"], engine)
    release_second()
    ids.claim("r", ["cmpl-5"], engine)
    ids.claim(None, ["cmpl-6"], engine)()  # no user id: nothing to track

    stale = InflightRequestIds(stale_after_s=0)
    stale.claim("s", ["cmpl-5"], engine)
    engine.live.add("cmpl-5")
    with pytest.raises(AdapterError):  # still running in the engine
        stale.claim("s", ["cmpl-6"], engine)
    engine.live.clear()
    stale.claim("s", ["cmpl-6"], engine)  # its response never ran to the end: stale, replaced


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_request_chat_templates_need_the_operators_trust():
    strict, trusting = ServingOptions(), ServingOptions(trust_request_chat_template=True)
    for body in (_chat(chat_template="{{ 1 }}"), _chat(chat_template_kwargs={"chat_template": "{{ 1 }}"})):
        with pytest.raises(AdapterError) as ei:
            chat_template_kwargs(body, strict)
        assert ei.value.param == "chat_template"
        assert chat_template_kwargs(body, trusting) == {"chat_template": "{{ 1 }}"}
    assert chat_template_kwargs(_chat(chat_template_kwargs={"enable_thinking": False}), strict) == {
        "enable_thinking": False}
    with pytest.raises(AdapterError) as ei:
        chat_template_kwargs(_chat(chat_template_kwargs={"tokenize": True}), trusting)
    assert ei.value.param == "chat_template_kwargs"


@pytest.mark.parametrize(("body", "param", "needle"), [
    (b"", None, "empty"),
    (b"[]", None, "JSON object"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages", "lone surrogate"),
    (b'{"messages": [], "n": true}', "n", "valid integer"),
    (b'{"messages": [], "n": "2"}', "n", "valid integer"),
    (b'{"messages": [], "temperature": "0.5"}', "temperature", "valid number"),
    (b'{"messages": [], "top_logprobs": -1}', "top_logprobs", "greater than or equal to 0"),
    (b'{"messages": "' + b"m" * 100_000 + b'"}', "messages", "characters)"),
])
def test_request_validation_messages_name_the_field_and_never_echo_the_input(body, param, needle):
    with TestClient(create_openai_app(prefix="/v1")) as c:
        resp = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert len(resp.content) < 1000
