"""The Triton model's wire format without a server: inputs, outputs, model.json, the repository."""

from __future__ import annotations

import filecmp
import json

import numpy as np
import pytest
from paged_backend.adapters.api import AdapterError
from paged_backend.adapters.triton_protocol import (
    GenerateInputs,
    OutputState,
    engine_config_from_model_json,
    output_values,
    parse_sampling_parameters,
)
from paged_backend.adapters.triton_repo import SAMPLE_REPOSITORY, main, write_model_repository

from paged_backend.outputs import CompletionOutput, RequestOutput, Usage


def test_prompt_is_prepended_unless_excluded_and_never_while_streaming():
    assert GenerateInputs.from_values(b"hi").prepend_input
    assert not GenerateInputs.from_values(b"hi", exclude_input_in_output=True).prepend_input
    assert not GenerateInputs.from_values(b"hi", stream=True).prepend_input
    with pytest.raises(AdapterError) as ei:
        GenerateInputs.from_values(b"hi", stream=True, exclude_input_in_output=False)
    assert ei.value.param == "exclude_input_in_output"
    with pytest.raises(AdapterError):
        GenerateInputs.from_values(None)


def test_sampling_parameters_json_like_vllm_backend():
    p = parse_sampling_parameters(b'{"max_tokens": "8", "temperature": "0.5", "top_p": null, "stop": ["x"]}')
    assert (p.max_tokens, p.temperature, p.top_p, p.stop) == (8, 0.5, 1.0, ["x"])
    assert parse_sampling_parameters(None).max_tokens == 16
    assert parse_sampling_parameters("{}").n == 1
    for bad, param in [("{oops", "sampling_parameters"), ("[1]", "sampling_parameters"),
                       ('{"n": 0}', "n"), ('{"best_of": 2}', "best_of"), ('{"lora_name": "a"}', "lora_name")]:
        with pytest.raises(AdapterError) as ei:
            parse_sampling_parameters(bad)
        assert ei.value.param == param and ei.value.status == 400



def test_structured_outputs_in_every_form_vllm_backend_clients_send():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for values in ({"structured_outputs": {"json": schema}},
                   {"structured_outputs": json.dumps({"json": schema})},  # JSON text inside the JSON, as they send it
                   {"guided_decoding": {"json": schema, "backend": "xgrammar"}},
                   {"guided_decoding": json.dumps({"json": schema})},
                   {"guided_json": schema}):
        assert parse_sampling_parameters(json.dumps(values)).structured_outputs.json_schema == schema, values
    assert parse_sampling_parameters('{"guided_choice": ["yes", "no"]}').structured_outputs.choice == ["yes", "no"]
    for bad, param in [({"structured_outputs": "{oops"}, "structured_outputs"),
                       ({"structured_outputs": {"yaml": "a: 1"}}, "structured_outputs.yaml"),
                       ({"guided_decoding": {"regex": "a+", "backend": "outlines"}}, "guided_decoding.backend"),
                       ({"guided_decoding": {"yaml": "a: 1"}}, "guided_decoding.yaml"),
                       ({"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, "guided_choice")]:
        with pytest.raises(AdapterError) as ei:
            parse_sampling_parameters(json.dumps(bad))
        assert ei.value.param == param and ei.value.status == 400

def test_cache_salt_and_bad_bytes_in_the_inputs():
    inputs = GenerateInputs.from_values(b"hi", sampling_parameters=b'{"max_tokens": 2, "cache_salt": "t1"}')
    assert inputs.cache_salt == "t1" and inputs.params.max_tokens == 2
    assert GenerateInputs.from_values(b"hi").cache_salt is None
    for kwargs, param in [({"sampling_parameters": b'{"cache_salt": 3}'}, "cache_salt"),
                          ({"sampling_parameters": b'{"cache_salt": ""}'}, "cache_salt"),
                          ({"sampling_parameters": b"\xff{}"}, "sampling_parameters")]:
        with pytest.raises(AdapterError) as ei:
            GenerateInputs.from_values(b"hi", **kwargs)
        assert ei.value.param == param and ei.value.status == 400
    with pytest.raises(AdapterError) as ei:
        GenerateInputs.from_values(b"a\xed\xa0\x80b")  # a UTF-8-encoded lone surrogate
    assert ei.value.param == "text_input"


def test_model_json_uses_vllm_names_and_ignores_vllm_only_flags():
    cfg, ignored = engine_config_from_model_json({"model": "SmolLM2-135M-Instruct", "max_model_len": 512,
                                                  "kv_cache_dtype": "fp8", "enforce_eager": True,
                                                  "trust_remote_code": True, "gpu_memory_utilization": "0.5"})
    assert (cfg.max_model_len, cfg.kv_cache_dtype, cfg.gpu_memory_utilization) == (512, "fp8", 0.5)
    assert cfg.enforce_eager  # a vLLM flag this engine honours
    assert ignored == ["trust_remote_code"]
    with pytest.raises(AdapterError, match="unsupported engine arguments"):
        engine_config_from_model_json({"model": "m", "no_such_vllm_argument": "x"})
    # vLLM engine arguments for features left off load (ignored); switched on they are refused, named
    cfg, ignored = engine_config_from_model_json({"model": "m", "enable_lora": False, "disable_log_stats": True,
                                                  "data_parallel_size": 1, "max_loras": 4, "cpu_offload_gb": 0,
                                                  "dtype": "half", "served_model_name": ["llm"]})
    assert ignored == ["cpu_offload_gb", "data_parallel_size", "enable_lora", "max_loras"]
    assert cfg.disable_log_stats and cfg.dtype == "float16" and cfg.name == "llm"
    for key, value, off in [("enable_lora", True, "false"), ("data_parallel_size", 2, "1")]:
        with pytest.raises(AdapterError) as ei:
            engine_config_from_model_json({"model": "m", key: value})
        assert ei.value.param == key and f"leave it off ({key}: {off})" in ei.value.message
    cfg, _ = engine_config_from_model_json({"model": "m", "pipeline_parallel_size": 2})  # implemented now
    assert cfg.pipeline_parallel_size == 2
    cfg, _ = engine_config_from_model_json({"model": "m", "speculative_config": {"method": "ngram",
                                                                              "num_speculative_tokens": 2}})
    assert cfg.speculative_config is not None and cfg.speculative_config.num_speculative_tokens == 2
    with pytest.raises(AdapterError) as ei:
        engine_config_from_model_json({"model": "m", "max_num_seqs": 0})
    assert ei.value.param == "max_num_seqs"


def _out(outputs, prompt="P") -> RequestOutput:
    return RequestOutput("r", prompt, [1, 2, 3], outputs, all(c.finish_reason for c in outputs), Usage(3, 2))


def test_streaming_outputs_have_one_entry_per_sample_and_only_news():
    inputs = GenerateInputs.from_values(b"P", stream=True, sampling_parameters='{"n": 2, "logprobs": 1}',
                                        returns=dict.fromkeys(("return_finish_reason", "return_num_output_tokens",
                                                               "return_logprobs", "return_num_input_tokens"), True))
    state = OutputState(n=2)
    first = _out([CompletionOutput(1, " b", [7], [{7: -0.5, 9: -1.5}])])
    v = output_values(inputs, first, state, lambda t: f"<{t}>")
    assert v["text_output"].tolist() == [b"", b" b"]
    assert v["finish_reason"].tolist() == [b"None", b"None"]
    assert v["num_output_tokens"].tolist() == [0, 1]
    assert v["num_input_tokens"].tolist() == [3]
    assert json.loads(v["logprobs"][0]) is None
    assert json.loads(v["logprobs"][1]) == [{"7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
                                             "9": {"logprob": -1.5, "rank": 2, "decoded_token": "<9>"}}]
    last = _out([CompletionOutput(0, " a", [5], finish_reason="length"),
                 CompletionOutput(1, "", [], finish_reason="stop")])
    v = output_values(inputs, last, state, str)
    assert v["text_output"].tolist() == [b" a", b""]
    assert v["finish_reason"].tolist() == [b"length", b"stop"]
    assert "cumulative_logprob" not in v


def test_full_output_prepends_the_prompt_once():
    inputs = GenerateInputs.from_values(b"P", returns={"return_cumulative_logprob": True})
    state = OutputState(n=1)
    out = _out([CompletionOutput(0, " done", [4], cumulative_logprob=-1.25, finish_reason="stop")], prompt="Hello")
    v = output_values(inputs, out, state, str)
    assert v["text_output"].tolist() == [b"Hello done"]
    assert v["cumulative_logprob"].dtype == np.float32 and v["cumulative_logprob"].tolist() == [-1.25]


def test_shipped_sample_repository_is_the_generator_default(tmp_path):
    write_model_repository(tmp_path)
    cmp = filecmp.dircmp(tmp_path, SAMPLE_REPOSITORY)
    assert _same_tree(cmp), "adapters/triton_model_repository drifted from triton_repo's default output"


def _same_tree(cmp: filecmp.dircmp) -> bool:
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    return all(_same_tree(sub) for sub in cmp.subdirs.values())


def test_cli_writes_engine_args(tmp_path):
    assert main([str(tmp_path), "--model-name", "m", "--engine-arg", "max_model_len=512",
                 "--engine-arg", "kv_cache_dtype=fp8"]) == 0
    args = json.loads((tmp_path / "m" / "1" / "model.json").read_text())
    assert args["max_model_len"] == 512 and args["kv_cache_dtype"] == "fp8"
    assert 'backend: "python"' in (tmp_path / "m" / "config.pbtxt").read_text()
    with pytest.raises(AdapterError):
        main([str(tmp_path), "--engine-arg", "max_num_seqs=0"])
