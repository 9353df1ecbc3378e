"""The engine core's outputs on the pipe: a plain delta crosses as a tuple and comes back equal; every
other output crosses as it is."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from paged_backend.engine.core_process import (
    CoreClient,
    CoreOutputs,
    EngineCore,
    merge_outputs,
    pack_output,
    unpack_output,
)
from paged_backend.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage


def _delta(**kw: object) -> RequestOutput:
    comp = {k: kw.pop(k) for k in [f.name for f in dataclasses.fields(CompletionOutput)] if k in kw}
    out = dict(request_id="r1", prompt=None, prompt_token_ids=[], finished=False, usage=Usage(7, 3, 2),
               step_times=[12.5])
    out.update(kw)
    return RequestOutput(outputs=[CompletionOutput(**{"index": 0, "text": " the", "token_ids": [11, 12],
                                                      "num_output_tokens": 3, **comp})], **out)


def test_a_plain_delta_crosses_as_a_tuple_and_comes_back_equal() -> None:
    out = _delta()
    packed = pack_output(out)
    assert isinstance(packed, tuple)
    assert unpack_output(pickle.loads(pickle.dumps(packed))) == out


@pytest.mark.parametrize("change", [
    dict(finished=True),
    dict(logprobs=[{11: -0.5}, {12: -0.25}], cumulative_logprob=-0.75),
    dict(finish_reason="stop", stop_reason="."),
    dict(prompt_logprobs=[None, {3: -1.0}], prompt_logprob_ranks=[None, 1]),
    dict(metrics=RequestMetrics(1.0, 1.5, 2.0, 3.0)),
])
def test_any_other_output_crosses_as_it_is(change: dict) -> None:
    out = _delta(**change)
    assert pack_output(out) is out
    assert unpack_output(out) is out


def test_several_sequences_cross_as_they_are() -> None:
    out = _delta()
    out.outputs.append(CompletionOutput(1, "a", [5], num_output_tokens=1))
    assert pack_output(out) is out


def test_the_tuple_form_knows_every_field() -> None:
    """A field added to the output types must be handled by pack_output (packed, or the output sent as it is)."""
    assert [f.name for f in dataclasses.fields(RequestOutput)] == [
        "request_id", "prompt", "prompt_token_ids", "outputs", "finished", "usage", "prompt_logprobs", "step_times",
        "metrics", "prompt_logprob_ranks"]
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "cumulative_logprob",
        "num_output_tokens"]
    assert [f.name for f in dataclasses.fields(Usage)] == ["prompt_tokens", "completion_tokens", "cached_tokens"]


def test_merged_messages_keep_each_request_s_outputs_in_order() -> None:
    first = CoreOutputs(outputs=[pack_output(_delta(prompt_logprobs=[None], prompt_logprob_ranks=[None]))])
    later = CoreOutputs(outputs=[pack_output(_delta(token_ids=[13])), pack_output(_delta(finished=True))])
    merge_outputs(first, later)
    got = [unpack_output(o) for o in pickle.loads(pickle.dumps(first)).outputs]
    assert [o.prompt_logprobs is not None for o in got] == [True, False, False]
    assert [o.outputs[0].token_ids for o in got] == [[11, 12], [13], [11, 12]]
    assert [o.finished for o in got] == [False, False, True]


def test_a_step_s_outputs_go_to_their_clients_in_order() -> None:
    """Interleaved clients' outputs: each client gets its own, in step order, under its own ids; a gone
    client's outputs are dropped; a finished request leaves its client's set."""
    core = EngineCore(None)  # type: ignore[arg-type]  # routing needs no engine
    a, b = CoreClient(0, None), CoreClient(1, None)  # type: ignore[arg-type]
    core.clients = {0: a, 1: b}
    a.requests, b.requests = {"0:x", "0:y"}, {"1:x"}
    outs = [_delta(request_id="0:x"), _delta(request_id="1:x", token_ids=[5]), _delta(request_id="7:x"),
            _delta(request_id="0:y", finished=True), _delta(request_id="0:x", token_ids=[6])]
    core._route(outs)
    got_a = [unpack_output(o) for o in a.pending.outputs]
    got_b = [unpack_output(o) for o in b.pending.outputs]
    assert [(o.request_id, o.outputs[0].token_ids, o.finished) for o in got_a] == [
        ("x", [11, 12], False), ("y", [11, 12], True), ("x", [6], False)]
    assert [(o.request_id, o.outputs[0].token_ids) for o in got_b] == [("x", [5])]
    assert a.requests == {"0:x"} and b.requests == {"1:x"}
