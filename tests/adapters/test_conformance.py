"""One set of scenarios through the three front ends, so a behaviour cannot exist in one and not another.

The front ends: the adapter API in-process (``EngineAdapter``), the OpenAI API of a real ``bentoml serve``
of bentos/smollm2 driven by the official ``openai`` SDK, and a real ``tritonserver`` (the nvidia-pytriton
wheel) driven by ``tritonclient`` gRPC streaming and HTTP ``generate``. Each is wrapped in a small driver
with one interface (``complete``, ``stream``, ``cancel_after_first_piece``, ``bad_request``, ``tool_call``,
``metrics_text``); each scenario runs once per driver and compares with the offline ``LLM`` on the same
engine arguments. The servers start once for the module, together, while the offline engine and the
in-process adapter load.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
import openai
import pytest
from bento_server import MODEL, Server
from bento_server import start as start_bento
from bento_server import stop as stop_bento
from bento_server import wait_ready as wait_bento
from paged_backend.adapters.api import AdapterError, EngineAdapter, build_sampling_params
from paged_backend.adapters.triton_local import TritonServer
from paged_backend.adapters.triton_repo import DEFAULT_ENGINE_ARGS, write_model_repository

from paged_backend import LLM, SamplingParams

pytestmark = pytest.mark.slow

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a test dependency")

ENGINE_ARGS: dict[str, Any] = {"max_model_len": 1024, "num_gpu_blocks_override": 128}
TRITON_MODEL = "paged_llm"
FRONT_ENDS = ("adapter", "openai", "triton")
PROMPT = "The capital of France is"
STORY = "Once upon a time, in a land far away,"
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_PROMPT = "Write a JSON object describing a person, with a name and an age: "
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- what every front end returns ---------------------------------------------------------

@dataclass
class Sample:
    """One sample (choice) of a finished request."""

    text: str
    finish_reason: str | None
    token_ids: list[int] | None = None  # where the front end returns them
    logprobs: list[dict[int, float]] | None = None  # per output token: token id -> logprob (sampled one included)


@dataclass
class Refusal:
    """A refused request: the status it maps to, the field it names (where the front end has a field) and
    its message."""

    status: int
    param: str | None
    message: str


class FrontEnd(Protocol):
    name: str

    def complete(self, prompt: str, params: Mapping[str, Any]) -> list[Sample]: ...

    def stream(self, prompt: str, params: Mapping[str, Any]) -> list[str]: ...

    def cancel_after_first_piece(self, prompt: str, params: Mapping[str, Any]) -> None: ...

    def bad_request(self, field: str, value: Any) -> Refusal: ...

    def tool_call(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], name: str,
                  max_tokens: int) -> Sample: ...

    def metrics_text(self) -> str: ...


# -- drivers ------------------------------------------------------------------------------

class AdapterDriver:
    """The adapter API in-process: ``build_sampling_params`` then ``EngineAdapter.generate``."""

    name = "adapter"

    def __init__(self, adapter: EngineAdapter) -> None:
        self.adapter = adapter

    def complete(self, prompt: str | list[int], params: Mapping[str, Any]) -> list[Sample]:
        out = asyncio.run(self.adapter.complete(prompt, build_sampling_params(params)))
        return [Sample(c.text, c.finish_reason, list(c.token_ids), c.logprobs)
                for c in sorted(out.outputs, key=lambda c: c.index)]

    def stream(self, prompt: str, params: Mapping[str, Any]) -> list[str]:
        async def go() -> list[str]:
            return [c.text async for d in self.adapter.generate(prompt, build_sampling_params(params))
                    for c in d.outputs if c.text]

        return asyncio.run(go())

    def cancel_after_first_piece(self, prompt: str, params: Mapping[str, Any]) -> None:
        async def go() -> None:
            stream = self.adapter.generate(prompt, build_sampling_params(params))
            async for delta in stream:
                if any(c.text for c in delta.outputs):
                    break
            await stream.aclose()  # the caller leaves: the request is aborted

        asyncio.run(go())

    def bad_request(self, field: str, value: Any) -> Refusal:
        try:
            self.complete(PROMPT, {"max_tokens": 4, field: value})
        except AdapterError as err:
            return Refusal(err.status, err.param, err.message)
        raise AssertionError(f"{field}={value!r} was accepted")

    def tool_call(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], name: str,
                  max_tokens: int) -> Sample:
        """No tools in the adapter API: the named function's parameters as a JSON-schema constraint over the
        conversation rendered with the tools, as the chat route does."""
        ids = self.adapter.encode_chat(messages, chat_template_kwargs={"tools": tools})
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
        (sample,) = self.complete(ids, {"temperature": 0.0, "max_tokens": max_tokens,
                                        "structured_outputs": {"json": schema}})
        return sample

    def metrics_text(self) -> str:
        return self.adapter.metrics_text()


class OpenAIDriver:
    """The completions route (the chat route for tools) of ``bentoml serve``, through the ``openai`` SDK."""

    name = "openai"

    def __init__(self, server: Server) -> None:
        self.server = server
        self.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

    @staticmethod
    def _kwargs(params: Mapping[str, Any]) -> dict[str, Any]:
        kw = dict(params)
        extra: dict[str, Any] = {"return_token_ids": True}
        spec = kw.pop("structured_outputs", None)
        if isinstance(spec, dict) and set(spec) == {"json"}:  # OpenAI's spelling (the SDK has it on chat only)
            extra["response_format"] = {"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": spec["json"]}}
        elif spec is not None:
            extra["structured_outputs"] = spec
        for name in ("ignore_eos", "top_k", "min_tokens"):  # vLLM's extras
            if name in kw:
                extra[name] = kw.pop(name)
        return {"model": MODEL, **kw, "extra_body": extra}

    def complete(self, prompt: str, params: Mapping[str, Any]) -> list[Sample]:
        resp = self.client.completions.create(prompt=prompt, **self._kwargs(params))
        out = []
        for c in sorted(resp.choices, key=lambda c: c.index):
            ids = c.model_extra.get("token_ids")
            logprobs = None
            if c.logprobs is not None:
                logprobs = [{tid: lp} for tid, lp in zip(ids, c.logprobs.token_logprobs, strict=True)]
            out.append(Sample(c.text, c.finish_reason, ids, logprobs))
        return out

    def stream(self, prompt: str, params: Mapping[str, Any]) -> list[str]:
        chunks = self.client.completions.create(prompt=prompt, stream=True, **self._kwargs(params))
        return [c.text for chunk in chunks for c in chunk.choices if c.text]

    def cancel_after_first_piece(self, prompt: str, params: Mapping[str, Any]) -> None:
        chunks = self.client.completions.create(prompt=prompt, stream=True, **self._kwargs(params))
        for chunk in chunks:
            if any(c.text for c in chunk.choices):
                break
        chunks.close()  # the connection goes: the server aborts the request

    def bad_request(self, field: str, value: Any) -> Refusal:
        try:
            self.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={field: value})
        except openai.APIStatusError as err:
            body = err.body if isinstance(err.body, dict) else {}
            assert body.get("type") == "invalid_request_error", body
            return Refusal(err.status_code, body.get("param"), body.get("message", ""))
        raise AssertionError(f"{field}={value!r} was accepted")

    def tool_call(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], name: str,
                  max_tokens: int) -> Sample:
        resp = self.client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": name}},
            max_tokens=max_tokens, temperature=0)
        choice = resp.choices[0]
        [call] = choice.message.tool_calls
        assert call.function.name == name and choice.message.content is None
        return Sample(call.function.arguments, choice.finish_reason)

    def metrics_text(self) -> str:
        return httpx.get(f"{self.server.url}/metrics", timeout=30).text


class TritonDriver:
    """vllm_backend's interface on ``tritonserver``: gRPC streams (streamed or not), HTTP ``generate`` for
    refusals. ``structured_outputs`` travels as JSON text inside ``sampling_parameters``, as vllm_backend's
    clients send it."""

    name = "triton"

    def __init__(self, server: TritonServer) -> None:
        self.server = server

    @staticmethod
    def _sampling_parameters(params: Mapping[str, Any]) -> str:
        values = dict(params)
        if "structured_outputs" in values:
            values["structured_outputs"] = json.dumps(values["structured_outputs"])
        return json.dumps(values)

    def _inputs(self, prompt: str, params: Mapping[str, Any], *, stream: bool) -> list[Any]:
        inputs = []

        def add(name: str, arr: np.ndarray, dtype: str) -> None:
            x = grpcclient.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            inputs.append(x)

        add("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")
        add("stream", np.array([stream]), "BOOL")
        add("sampling_parameters", np.array([self._sampling_parameters(params).encode()], dtype=np.object_), "BYTES")
        add("exclude_input_in_output", np.array([True]), "BOOL")
        for flag in ("return_finish_reason", "return_num_output_tokens"):
            add(flag, np.array([True]), "BOOL")
        if params.get("logprobs") is not None:
            add("return_logprobs", np.array([True]), "BOOL")
        return inputs

    def _run(self, prompt: str, params: Mapping[str, Any], *, stream: bool, cancel_on_text: bool = False) -> list:
        """The request's responses; with ``cancel_on_text``, the stream is cancelled at the first text."""
        client = grpcclient.InferenceServerClient(self.server.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        out: list = []
        try:
            client.async_stream_infer(TRITON_MODEL, self._inputs(prompt, params, stream=stream),
                                      request_id="conformance", enable_empty_final_response=False)
            while True:
                result, error = responses.get(timeout=300)
                assert error is None, error
                out.append(result)
                if cancel_on_text and b"".join(result.as_numpy("text_output")):
                    client.stop_stream(cancel_requests=True)
                    return out
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return out
        finally:
            client.stop_stream()
            client.close()

    def complete(self, prompt: str, params: Mapping[str, Any]) -> list[Sample]:
        (result,) = self._run(prompt, params, stream=False)
        texts = [t.decode() for t in result.as_numpy("text_output")]
        reasons = [r.decode() for r in result.as_numpy("finish_reason")]
        counts = result.as_numpy("num_output_tokens").tolist()
        steps: list[Any] = [None] * len(texts)
        if params.get("logprobs") is not None:
            steps = [json.loads(s) for s in result.as_numpy("logprobs")]
        out = []
        for text, reason, count, sample_steps in zip(texts, reasons, counts, steps, strict=True):
            logprobs = None
            if sample_steps is not None:
                logprobs = [{int(t): v["logprob"] for t, v in step.items()} for step in sample_steps]
                assert len(logprobs) == count
            out.append(Sample(text, reason, None, logprobs))
        return out

    def stream(self, prompt: str, params: Mapping[str, Any]) -> list[str]:
        results = self._run(prompt, params, stream=True)
        return [p for r in results for p in (t.decode() for t in r.as_numpy("text_output")) if p]

    def cancel_after_first_piece(self, prompt: str, params: Mapping[str, Any]) -> None:
        self._run(prompt, params, stream=True, cancel_on_text=True)

    def bad_request(self, field: str, value: Any) -> Refusal:
        params = self._sampling_parameters({"max_tokens": 4, field: value})
        resp = httpx.post(f"http://{self.server.http_url}/v2/models/{TRITON_MODEL}/generate",
                          json={"text_input": PROMPT, "sampling_parameters": params}, timeout=120)
        assert resp.status_code != 200, f"{field}={value!r} was accepted: {resp.text}"
        message = resp.json()["error"]
        assert message.startswith("Error generating stream: "), message  # vllm_backend's wording
        return Refusal(resp.status_code, None, message)

    def tool_call(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], name: str,
                  max_tokens: int) -> Sample:
        """No tools in vllm_backend's interface: the named function's parameters as a JSON-schema constraint
        over the conversation rendered (with the tools) by the model's chat template."""
        from smollm2 import tokenizer

        prompt = tokenizer().apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
        (sample,) = self.complete(prompt, {"temperature": 0.0, "max_tokens": max_tokens,
                                           "structured_outputs": {"json": schema}})
        return sample

    def metrics_text(self) -> str:
        return httpx.get(self.server.metrics_url, timeout=30).text


# -- fixtures -----------------------------------------------------------------------------

@dataclass
class Stack:
    offline: LLM
    drivers: dict[str, FrontEnd]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Both servers launched at once; the offline engine and the in-process adapter load meanwhile."""
    tmp: Path = tmp_path_factory.mktemp("conformance")
    write_model_repository(tmp / "repo", model_name=TRITON_MODEL, engine_args={**DEFAULT_ENGINE_ARGS, **ENGINE_ARGS})
    triton = TritonServer(tmp / "repo", workdir=tmp / "triton").launch()
    (tmp / "bento").mkdir()
    bento = start_bento(tmp / "bento", ENGINE_ARGS)
    adapter = None
    try:
        offline = LLM(MODEL, **ENGINE_ARGS)
        adapter = EngineAdapter({"model": MODEL, **ENGINE_ARGS})
        adapter.start()
        triton.wait_ready(600)
        wait_bento(bento)
        yield Stack(offline, {"adapter": AdapterDriver(adapter), "openai": OpenAIDriver(bento),
                              "triton": TritonDriver(triton)})
    finally:
        if adapter is not None:
            adapter.shutdown()
        bento_stopped = stop_bento(bento)
        rc = triton.stop()
    assert bento_stopped, "bentoml serve did not stop on SIGTERM"
    assert rc == 0, f"tritonserver exit code {rc}:\n{triton.log_tail()}"


@pytest.fixture(params=FRONT_ENDS)
def front(request: pytest.FixtureRequest, stack: Stack) -> FrontEnd:
    return stack.drivers[request.param]


@pytest.fixture(scope="module")
def offline(stack: Stack) -> LLM:
    return stack.offline


_OFFLINE: dict[str, Any] = {}


def _offline(llm: LLM, prompt: str, **params: Any) -> Any:
    """The offline engine's first sample for ``prompt`` (a CompletionOutput), computed once."""
    key = json.dumps([prompt, params], sort_keys=True)
    if key not in _OFFLINE:
        _OFFLINE[key] = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs
    return _OFFLINE[key][0]


def _metric(text: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples whose labels contain ``labels`` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _check_person(text: str) -> dict[str, Any]:
    """``text`` parses as JSON and fits PERSON (types, bounds, required keys, nothing else)."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "age"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 8, value
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120, value
    return value


def _check_weather(text: str) -> dict[str, Any]:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"city", "unit"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 12, value
    assert value["unit"] in ("celsius", "fahrenheit"), value
    return value


# -- scenarios ----------------------------------------------------------------------------

def test_greedy_output_equals_the_offline_engine(front: FrontEnd, offline: LLM) -> None:
    want = _offline(offline, PROMPT, **GREEDY)
    (got,) = front.complete(PROMPT, GREEDY)
    assert got.text == want.text
    assert got.finish_reason == want.finish_reason == "length"
    if got.token_ids is not None:
        assert got.token_ids == list(want.token_ids)


def test_streamed_pieces_add_up_to_the_unstreamed_text(front: FrontEnd, offline: LLM) -> None:
    params = {**GREEDY, "max_tokens": 12}
    pieces = front.stream(STORY, params)
    (whole,) = front.complete(STORY, params)
    assert len(pieces) > 1
    assert "".join(pieces) == whole.text == _offline(offline, STORY, **params).text


def test_n_2_gives_two_seeded_samples_as_the_offline_engine(front: FrontEnd, offline: LLM) -> None:
    # vllm_backend's Triton model has no ``n``; this one answers n entries per output tensor, so it runs here too
    params = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 8}
    got = front.complete(STORY, params)
    want = offline.generate([STORY], SamplingParams(**params), use_tqdm=False)[0].outputs
    assert len(got) == 2
    assert [s.text for s in got] == [w.text for w in sorted(want, key=lambda w: w.index)]
    assert all(s.finish_reason in ("length", "stop") for s in got)


def test_stop_string_ends_the_output_before_it(front: FrontEnd, offline: LLM) -> None:
    full = _offline(offline, STORY, **GREEDY).text
    stop = full.split()[2]  # a word in the middle of the greedy answer
    (got,) = front.complete(STORY, {**GREEDY, "stop": [stop]})
    assert got.finish_reason == "stop"
    assert got.text == full[: full.index(stop)]


def test_logprobs_of_the_greedy_tokens_equal_the_offline_engine(front: FrontEnd, offline: LLM) -> None:
    params = {"temperature": 0.0, "max_tokens": 8, "logprobs": 1}
    want = _offline(offline, PROMPT, **params)
    (got,) = front.complete(PROMPT, params)
    assert got.text == want.text and got.logprobs is not None
    assert len(got.logprobs) == len(want.token_ids) == len(want.logprobs)
    for step, tid, expected in zip(got.logprobs, want.token_ids, want.logprobs, strict=True):
        assert step[tid] == pytest.approx(expected[tid], abs=1e-4)


def test_json_schema_output_parses_and_validates(front: FrontEnd, offline: LLM) -> None:
    params = {"temperature": 0.0, "max_tokens": 24, "structured_outputs": {"json": PERSON}}
    (got,) = front.complete(PERSON_PROMPT, params)
    assert got.finish_reason == "stop", got
    _check_person(got.text)
    assert got.text == _offline(offline, PERSON_PROMPT, **params).text


def test_named_tool_call_gives_the_functions_arguments(front: FrontEnd, stack: Stack) -> None:
    # only the OpenAI chat route has tools; the adapter API and Triton run the same constraint (the function's
    # parameters as a JSON schema) over the same rendered conversation, and must write the same arguments
    got = front.tool_call(CHAT, TOOLS, "get_weather", max_tokens=24)
    assert got.finish_reason == ("tool_calls" if front.name == "openai" else "stop"), got
    assert _check_weather(got.text)["city"] == "Paris"
    if front.name != "adapter":
        assert got.text == stack.drivers["adapter"].tool_call(CHAT, TOOLS, "get_weather", max_tokens=24).text


def test_a_request_cancelled_after_its_first_piece_frees_its_blocks(front: FrontEnd) -> None:
    aborted = 'finished_reason="abort"'
    before = _metric(front.metrics_text(), "vllm:request_success_total", aborted)
    front.cancel_after_first_piece(STORY, {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0})
    deadline = time.monotonic() + 30
    while True:
        text = front.metrics_text()
        state = (_metric(text, "vllm:request_success_total", aborted) - before,
                 _metric(text, "vllm:num_requests_running"), _metric(text, "vllm:kv_cache_usage_perc"))
        if state == (1, 0, 0):
            break
        assert time.monotonic() < deadline, f"(aborts, running, kv usage) = {state} 30 s after the cancel"
        time.sleep(0.25)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1),
    ("top_p", 2),
    ("max_tokens", 0),
    ("n", 0),
    ("logprobs", -1),
    ("stop", [""]),
    ("structured_outputs", {"yaml": "a: 1"}),
    ("structured_outputs", {"regex": "(unclosed"}),
], ids=["temperature", "top_p", "max_tokens", "n", "logprobs", "stop", "unknown-structured-kind", "bad-regex"])
def test_bad_values_are_invalid_requests_naming_the_field(front: FrontEnd, field: str, value: Any) -> None:
    err = front.bad_request(field, value)
    assert err.status == 400, err
    # the message names the field on every front end (Triton's errors carry nothing else); the grammar
    # compiler's own errors spell it as words ("invalid regex for structured outputs: ...")
    assert field in err.message or field.replace("_", " ") in err.message, err
    if err.param is not None:  # Triton errors carry a message only
        assert err.param.startswith(field), err
    (ok,) = front.complete(PROMPT, {**GREEDY, "max_tokens": 2})  # still serving
    assert ok.finish_reason == "length"
