"""A real ``bentoml serve`` under hostile input: API keys, size limits, request ids, unicode,
disconnects, tenant isolation of the prefix cache, and a bounded fuzz of both OpenAI routes.

One server for the module, started with an API key and small limits; every test ends with
the KV cache empty (no block leaked) and the server still answering.
"""

from __future__ import annotations

import asyncio
import http.client as httplib
import json
import socket
import time

import httpx
import pytest
from bento_server import MODEL, Server, start, stop, wait_ready
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

KEYS = ("key-one", "key-two")
ARGS = {"max_model_len": 1024, "num_gpu_blocks_override": 384, "api_key": ",".join(KEYS),
        "max_request_bytes": 2 << 20, "max_batch_prompts": 8, "request_read_timeout": 2}
AUTH = {"authorization": f"Bearer {KEYS[0]}"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("bentoml-hardened"), ARGS)
    try:
        yield wait_ready(srv)
    finally:
        assert stop(srv), "bentoml serve did not stop on SIGTERM"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def _stats(http: httpx.Client) -> dict:
    resp = http.post("/stats", json={})
    resp.raise_for_status()
    return resp.json()


def _wait_idle(http: httpx.Client, timeout: float = 30) -> dict:
    """Stats once nothing runs or waits; the test fails if blocks stay held."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(http)
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["num_free_blocks"] == stats["model"]["num_gpu_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not go idle with every block free: {stats}")
        time.sleep(0.2)


def _openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def _still_serving(http: httpx.Client) -> None:
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text
    _wait_idle(http)


# -- request ids ------------------------------------------------------------------------

def _ids(offset: int) -> list[int]:
    return [100 + offset + i for i in range(40)]


@pytest.mark.parametrize("n2_first", [False, True])
def test_user_request_ids_cannot_collide_inside_the_engine(server, http, n2_first):
    """``k#0`` (n = 1) and ``k`` (n = 2) once named the same engine sample and killed the loop."""
    one = {"model": MODEL, "prompt": _ids(0), "max_tokens": 30, "request_id": "k#0", "temperature": 0}
    two = {"model": MODEL, "prompt": _ids(50), "max_tokens": 30, "n": 2, "request_id": "k", "temperature": 0}

    async def both():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            order = [two, one] if n2_first else [one, two]
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in order))

    responses = asyncio.run(both())
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    by_id = {r.json()["id"]: r.json() for r in responses}
    assert set(by_id) == {"cmpl-k#0", "cmpl-k"}
    assert len(by_id["cmpl-k"]["choices"]) == 2 and len(by_id["cmpl-k#0"]["choices"]) == 1
    assert all(c["finish_reason"] == "length" for r in by_id.values() for c in r["choices"])
    assert httpx.get(f"{server.url}/livez").status_code == 200
    assert httpx.get(f"{server.url}/readyz").status_code == 200
    _still_serving(http)


def test_a_duplicate_in_flight_request_id_is_a_400(server, http):
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "request_id": "twice",
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # the first request is in flight
        err = _openai_error(http.post("/v1/completions", json={**body, "stream": False}), 400)
        assert err["param"] == "request_id" and "twice" in err["message"]
    _wait_idle(http)
    again = http.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False})
    assert again.status_code == 200 and again.json()["id"] == "cmpl-twice"  # free again once finished
    _wait_idle(http)


# -- authentication -----------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    ("POST", "/generate", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/stats", {}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
])
def test_api_key_is_required_on_every_api_route(server, method, path, body):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEYS[0]}):
        resp = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=60)
        err = _openai_error(resp, 401)
        assert err["code"] == "invalid_api_key"
    for key in KEYS:
        resp = httpx.request(method, f"{server.url}{path}", json=body, headers={"authorization": f"Bearer {key}"},
                             timeout=120)
        assert resp.status_code == 200, resp.text


def test_health_and_metrics_stay_open(server):
    for path in ("/livez", "/readyz", "/metrics", "/health", "/version"):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 200, path
    assert httpx.get(f"{server.url}/version", timeout=30).json()["version"]


def test_tokenize_and_detokenize_as_vllm_serves_them(http):
    out = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    first = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1}).json()
    assert chat["count"] == first["usage"]["prompt_tokens"] and chat["token_strs"] is None
    for path, body, param in [("/detokenize", {"tokens": [10**7]}, "tokens"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "messages": CHAT}, "messages"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model")]:
        resp = http.post(path, json=body)
        assert resp.status_code in (400, 404) and _openai_error(resp, resp.status_code)["param"] == param


# -- sizes and time ------------------------------------------------------------------------

def test_an_oversized_body_is_a_413_that_does_not_echo_it(server, http):
    huge = {"model": MODEL, "prompt": "x" * (20 << 20), "max_tokens": 2}
    started = time.monotonic()
    resp = http.post("/v1/completions", json=huge)
    err = _openai_error(resp, 413)
    assert err["code"] == "request_too_large" and len(resp.content) < 1000
    assert time.monotonic() - started < 30
    _still_serving(http)


def test_a_long_text_is_refused_before_tokenizing_and_errors_never_echo_input(server, http):
    # 1.5 MB of text: more bytes than 1024 tokens of this tokenizer can hold
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "lorem ipsum " * 130_000, "max_tokens": 2})
    err = _openai_error(resp, 400)
    assert err["code"] == "context_length_exceeded" and "maximum context length is 1024" in err["message"]
    assert len(resp.content) < 2000
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "lorem " * 300_000}]})
    assert _openai_error(chat, 400)["code"] == "context_length_exceeded" and len(chat.content) < 2000
    wrong = http.post("/v1/chat/completions", json={"model": MODEL, "messages": "m" * 1_500_000})
    assert _openai_error(wrong, 400)["param"] == "messages" and len(wrong.content) < 2000
    _still_serving(http)


def test_a_slow_body_times_out(server, http):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: 100\r\n\r\n{\"mo")
        started = time.monotonic()
        data = sock.recv(65536)
        assert b" 408 " in data.split(b"\r\n", 1)[0], data[:200]
        assert time.monotonic() - started < 20
    _still_serving(http)


def test_slow_or_absent_headers_time_out(server, http):
    for opening in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):  # nothing, or headers never ended
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(opening)
            started = time.monotonic()
            data = sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 408 "), data[:200]
            assert sock.recv(65536) == b""  # and the connection is closed
            assert time.monotonic() - started < 20
    _still_serving(http)


def test_a_half_closed_client_gets_its_answer(server, http):
    payload = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3,
                          "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        sock.shutdown(socket.SHUT_WR)  # nothing more to send: waits for the answer
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    data = data.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")  # the interim answer to the half-close
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), data[:300]
    assert b'"finish_reason":"length"' in body
    _wait_idle(http)


def test_batched_prompts_are_capped(server, http):
    err = _openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 5, "n": 2,
                                                             "max_tokens": 2}), 400)
    assert err["code"] == "too_many_prompts" and "8" in err["message"]


# -- disconnects ---------------------------------------------------------------------------

def _wait_aborted(http: httpx.Client, before: dict, count: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(http)
        if stats["num_aborted_total"] - before["num_aborted_total"] >= count:
            return _wait_idle(http)
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {count} aborts: {stats}")
        time.sleep(0.2)


def test_a_batched_completion_runs_together_and_is_aborted_when_its_client_leaves(server, http):
    before = _stats(http)
    body = {"model": MODEL, "prompt": [f"Story number {i}:" for i in range(8)], "max_tokens": 500,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=3)
    stats = _wait_aborted(http, before, 8)
    assert stats["generation_tokens_total"] - before["generation_tokens_total"] < 8 * 500
    assert stats["num_aborted_total"] - before["num_aborted_total"] == 8


def test_a_request_abandoned_before_its_first_token_is_aborted(server, http):
    before = _stats(http)
    prompt = "word " * 900  # a long prefill: the client is gone before the first token
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        payload = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 100}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEYS[1].encode() + b"\r\nContent-Length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        time.sleep(0.3)
    stats = _wait_aborted(http, before, 1)
    assert stats["generation_tokens_total"] - before["generation_tokens_total"] < 100


# -- templates, tenants, unicode, small ones --------------------------------------------------

@pytest.mark.parametrize("extra", [{"chat_template": "{{ 'hello ' * 500000 }}"},
                                   {"chat_template_kwargs": {"chat_template": "{{ 'hello ' * 500000 }}"}}])
def test_request_supplied_chat_templates_are_refused(http, extra):
    err = _openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **extra}), 400)
    assert err["param"] == "chat_template" and err["code"] == "chat_template_not_allowed"


def test_cache_salt_keeps_tenants_apart(http):
    shared = "You are a helpful assistant for a travel agency. Answer briefly and politely. " * 3
    base = {"model": MODEL, "prompt": shared + "Where is Rome?", "max_tokens": 1, "temperature": 0}

    def cached(**kw) -> int:
        resp = http.post("/v1/completions", json={**base, **kw})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0  # the same tenant hits its own cache
    assert cached(cache_salt="tenant-b") == 0  # another tenant does not see it
    assert cached() == 0  # nor does a request without a salt
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": shared}],
                                                   "max_tokens": 1, "cache_salt": "tenant-c"})
    assert chat.status_code == 200
    _wait_idle(http)


def _raw(port: int, conn: httplib.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes, str | None]:
    conn.request("POST", path, body=body, headers={"content-type": "application/json", **AUTH})
    resp = conn.getresponse()
    return resp.status, resp.read(), resp.getheader("connection")


@pytest.mark.parametrize("body", [b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\ud800b", "max_tokens": 2}',
                                  b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}',
                                  b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, '
                                  b'"messages": [{"role": "user", "content": "x\\udfffy"}]}'])
def test_lone_surrogates_are_400s_that_keep_the_connection(server, body):
    conn = httplib.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, data, connection = _raw(server.port, conn, path, body)
        assert status == 400, data
        assert json.loads(data)["error"]["code"] == "invalid_unicode" and connection != "close"
        ok = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
        status, data, _ = _raw(server.port, conn, "/v1/completions", ok)  # the same keep-alive connection
        assert status == 200, data
    finally:
        conn.close()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": "7"}, "max_tokens"),
    ({"prompt": "Hi", "temperature": "0"}, "temperature"),
    ({"prompt": "Hi", "echo": 1}, "echo"),
    ({"prompt": "Hi", "stop": "x" * 200_000}, "stop"),
    ({"prompt": "Hi", "stop": [f"s{i}" for i in range(100)]}, "stop"),
    ({"prompt": "Hi", "logprobs": -1}, "logprobs"),
])
def test_strict_types_and_capped_values(http, body, param):
    resp = http.post("/v1/completions", json={"model": MODEL, **body})
    err = _openai_error(resp, 400)
    assert err["param"] == param, err
    assert len(resp.content) < 2000


def test_top_logprobs_must_not_be_negative(http):
    err = _openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "logprobs": True,
                                                                  "top_logprobs": -1}), 400)
    assert err["param"] == "top_logprobs"


def test_unimplemented_fields_are_400s_naming_them_and_logit_bias_steers_the_output(http):
    for field, value in [("functions", [{"name": "f"}]), ("reasoning_effort", "high")]:
        err = _openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, field: value}),
                            400)
        assert err["param"] == field and "not supported" in err["message"]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "logprobs": 0}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    forced = http.post("/v1/completions", json={**body, "logit_bias": {"1000": 100}}).json()
    tokens = forced["choices"][0]["logprobs"]["tokens"]
    assert len(set(tokens)) == 1 and tokens != plain and forced["choices"][0]["text"] == tokens[0] * 3
    for extra, param in [({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                         ({"stream_options": {"include_usage": True}}, "stream_options"), ({"seed": 2**64}, "seed")]:
        assert _openai_error(http.post("/v1/completions", json={**body, **extra}), 400)["param"] == param
    _wait_idle(http)


def test_structured_outputs_through_the_openai_routes(http):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 40,
                                                   "temperature": 0, "response_format": fmt})
    assert set(json.loads(resp.json()["choices"][0]["message"]["content"])) == {"city"}
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "Is the sky blue?", "max_tokens": 5,
                                              "n": 3, "temperature": 1.0, "guided_choice": ["yes", "no"]})
    assert {c["text"] for c in resp.json()["choices"]} <= {"yes", "no"}
    for extra, param in [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                                       {"type": "nonsense"}}}},
                          "response_format"),
                         ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
                         ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice")]:
        err = _openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **extra}), 400)
        assert err["param"] == param, err
    _wait_idle(http)


def test_empty_body_and_unknown_routes_answer_openai_errors(http):
    err = _openai_error(http.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"}),
                        400)
    assert "None" not in err["message"] and "empty" in err["message"]
    assert _openai_error(http.get("/v1/nothing"), 404)
    assert _openai_error(http.post("/v1/models"), 405)


def test_no_absolute_paths_are_published(http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == MODEL
    assert "model_dir" not in _stats(http)["model"]


# -- fuzz ----------------------------------------------------------------------------------

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40)
                     | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
_VALUES = {
    "model": st.sampled_from([MODEL, "other", ""]) | _JSON,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 60_000), max_size=8) | _JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                                "content": st.text(max_size=30) | _JSON}), max_size=3) | _JSON,
    "max_tokens": st.integers(-3, 4) | st.sampled_from([10**9, None]) | _JSON,
    "n": st.integers(-1, 3) | _JSON,
    "temperature": st.floats(-1, 3) | _JSON,
    "top_p": st.floats(-0.5, 1.5) | _JSON,
    "top_k": st.integers(-3, 100) | _JSON,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | _JSON,
    "seed": st.integers(-2**70, 2**70) | _JSON,
    "logprobs": st.booleans() | st.integers(-2, 30) | _JSON,
    "top_logprobs": st.integers(-2, 30) | _JSON,
    "echo": st.booleans() | _JSON,
    "stream": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-2, 60_000), max_size=3) | _JSON,
    "request_id": st.text(max_size=10) | _JSON,
    "cache_salt": st.text(max_size=10) | _JSON,
    "presence_penalty": st.floats(-3, 3) | _JSON,
    "min_tokens": st.integers(-1, 6) | _JSON,
    "response_format": _JSON,
    "logit_bias": st.dictionaries(st.integers(-2, 60_000).map(str) | st.text(max_size=4), st.floats(-200, 200),
                                  max_size=3) | _JSON,
    "allowed_token_ids": st.lists(st.integers(-2, 60_000), max_size=3) | _JSON,
    "tools": _JSON,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | _JSON,
    "structured_outputs": st.fixed_dictionaries({"regex": st.sampled_from(["[a-c]+", "(x", "y?"])}) | _JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _JSON,
}


def _body(route: str) -> st.SearchStrategy:
    first = "messages" if route == "chat" else "prompt"
    keys = st.lists(st.sampled_from([k for k in _VALUES if k not in ("messages", "prompt")]), max_size=6, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries(
        {first: _VALUES[first], **{k: _VALUES[k] for k in ks}}))


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_fuzzed_requests_never_500_and_leak_nothing(server, http, route):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    statuses: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_body(route))
    def one(body):
        tokens = body.get("max_tokens")
        if tokens is None or (type(tokens) is int and tokens > 4):
            body["max_tokens"] = 4  # every valid request stays short (chat's default is the whole context)
        resp = http.post(path, json=body)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code in (200, 400, 404), (resp.status_code, body, resp.text[:300])
        if resp.status_code != 200:
            _openai_error(resp, resp.status_code)
        elif body.get("stream") is True:
            assert resp.text.rstrip().endswith("data: [DONE]")

    one()
    assert statuses.get(400, 0) > 0 and sum(statuses.values()) >= 150
    _still_serving(http)


# -- start-up ---------------------------------------------------------------------------------

def test_a_kv_cache_smaller_than_max_model_len_refuses_to_start(tmp_path):
    srv: Server = start(tmp_path, {"max_model_len": 1024, "num_gpu_blocks_override": 16})
    try:
        srv.proc.wait(300)
    except Exception:
        stop(srv)
        raise AssertionError(f"the server kept running:\n{srv.log_tail()}") from None
    log = srv.log_text()
    assert "The KV cache holds 240 tokens, fewer than max_model_len (1024)" in log, log[-3000:]
    assert "--max-model-len" in log
