"""Structured outputs on the real SmolLM2 (fp32, CPU): JSON schemas, any JSON, regexes, choices and EBNF
grammars hold on every sample, greedy or sampled, batched beside unconstrained requests, with n > 1 and
under async scheduling; a grammar that allows the unconstrained answer leaves greedy output unchanged; a bad
spec is refused naming the field, and nothing leaks."""

from __future__ import annotations

import json
import re

import pytest
from smollm2 import PROMPTS, assert_no_leak, make_llm

from paged_backend import InvalidRequestError, SamplingParams
from paged_backend.sampling_params import StructuredOutputsParams as Spec

pytestmark = pytest.mark.slow

CAT = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return make_llm(max_model_len=512)


def _chat(llm, spec: Spec, **kw) -> list[str]:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 48), temperature=kw.pop("temperature", 0.0),
                            structured_outputs=spec, **kw)
    return [c.text for c in llm.chat(CAT, params, use_tqdm=False)[0].outputs]


def test_a_json_schema_holds_greedy_and_sampled(llm):
    for text in _chat(llm, Spec(json=SCHEMA)) + _chat(llm, Spec(json=SCHEMA), temperature=1.0, seed=3, n=3):
        obj = json.loads(text)
        assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
        assert obj["age"] >= 0 and len(obj["name"]) <= 20
    assert_no_leak(llm.engine)


def test_any_json_regex_choice_and_grammar(llm):
    ok = [{"role": "user", "content": 'Return a JSON object with one key "ok" set to true.'}]
    out = llm.chat(ok, SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=Spec(json_object=True)),
                   use_tqdm=False)[0].outputs[0]
    assert json.loads(out.text) == {"ok": True} and out.finish_reason == "stop"
    prompt = [{"role": "user", "content": "Is Paris in France?"}]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, n=4,
                            structured_outputs=Spec(choice=["yes", "no", "I am not sure"]))
    assert {c.text for c in llm.chat(prompt, params, use_tqdm=False)[0].outputs} <= {"yes", "no", "I am not sure"}
    out = llm.generate(["The year is"], SamplingParams(max_tokens=10, temperature=0.0,
                                                        structured_outputs=Spec(regex=r" [12][0-9]{3}\.")),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r" [12][0-9]{3}\.", out.text) and out.finish_reason == "stop"
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    out = llm.generate(["Q: Is water wet? A:"], SamplingParams(max_tokens=12, temperature=0.0,
                                                               structured_outputs=Spec(grammar=grammar)),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"The answer is (yes|no)\.", out.text)


def test_a_grammar_that_allows_the_answer_leaves_greedy_unchanged_beside_unconstrained_rows(llm):
    plain = SamplingParams(max_tokens=10, temperature=0.0)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], plain, use_tqdm=False)]
    free = SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=Spec(regex=r"[\s\S]*"))
    got = llm.generate(PROMPTS[:3], [free, plain, free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert_no_leak(llm.engine)


def test_async_scheduling_keeps_the_grammar(llm):
    """Async: each step's masks are filled while the step before is processed; the greedy tokens are the
    synchronous engine's, beside an unconstrained row and a request that stops early."""
    fast = make_llm(max_model_len=512, async_scheduling=True)
    for text in _chat(fast, Spec(json=SCHEMA), temperature=1.0, seed=5, n=2):
        assert set(json.loads(text)) == {"name", "age"}
    assert fast.engine.num_async_steps > 0
    prompts = [*PROMPTS[:2], "The year is"]
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=Spec(json_object=True)),
              SamplingParams(max_tokens=24, temperature=0.0),
              SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=Spec(regex=r" [12][0-9]{3}\."))]
    ahead, deferred = fast.engine.step_sampler.num_masks_ahead, fast.engine.step_sampler.num_deferred
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fast.engine.step_sampler.num_masks_ahead > ahead
    assert fast.engine.step_sampler.num_deferred > deferred  # sampled by the next step's runner call
    assert_no_leak(fast.engine)


def test_aborts_while_a_constrained_step_waits_to_be_sampled_free_every_block(llm):
    """Async: a constrained step is sampled in the next step, after that step's inputs are built; requests
    aborted while it waits free their blocks, the others' greedy tokens are the synchronous engine's."""
    fast = make_llm(max_model_len=512, async_scheduling=True)
    eng = fast.engine
    prompts = [*PROMPTS[:3], "The year is"]
    params = [SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=Spec(json_object=True)),
              SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=Spec(regex=r" [a-z ]{1,40}\.")),
              SamplingParams(max_tokens=20, temperature=0.0),
              SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=Spec(json=SCHEMA))]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ids = [f"c{i}" for i in range(len(prompts))]
    for rid, prompt, sp in zip(ids, prompts, params, strict=True):
        eng.add_request(rid, prompt, sp)
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    aborted = {"c1", "c2"}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            toks[out.request_id] += out.outputs[0].token_ids if out.outputs else []
        steps += 1
        if steps == 5:  # mid-decode, the step just scheduled waits for its masks
            assert eng._unsampled is not None
            waiting = {s.request.request_id for _, s in eng._unsampled[0].rows}
            assert aborted <= waiting
            for rid in aborted:
                assert eng.abort_request(rid) is not None
    for i, rid in enumerate(ids):
        if rid not in aborted:
            assert toks[rid] == want[i], rid
    assert_no_leak(eng)


@pytest.mark.parametrize("spec", [Spec(json='{"type": "nonsense"}'), Spec(regex="(unclosed"),
                                  Spec(grammar="root ::= ")], ids=["schema", "regex", "grammar"])
def test_a_bad_spec_is_refused_naming_the_field(llm, spec):
    with pytest.raises(InvalidRequestError, match="invalid .* for structured outputs") as exc:
        llm.engine.add_request("bad", PROMPTS[0], SamplingParams(structured_outputs=spec))
    assert exc.value.param == "structured_outputs"
    assert_no_leak(llm.engine)


def test_exactly_one_constraint_and_no_beam_search():
    with pytest.raises(ValueError, match="exactly one"):
        Spec(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        Spec()
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, beam_width=2, structured_outputs=Spec(regex="a"))
