"""The Triton model's wire format, without Triton: vllm_backend's inputs and outputs.

``TritonPythonModel`` (triton_backend.py) reads tensors into plain values, then this
module turns them into a ``GenerateInputs`` and turns engine deltas into the output
values of each response. Keeping it free of ``triton_python_backend_utils`` makes it
testable in-process; the real server tests cover the glue.

Inputs: text_input, stream, sampling_parameters (JSON; string values converted),
exclude_input_in_output, return_{finish_reason, cumulative_logprob, logprobs,
num_input_tokens, num_output_tokens}. Outputs: text_output, finish_reason,
cumulative_logprob, logprobs (JSON), num_input_tokens, num_output_tokens; one entry per
sample (``n``), streaming responses carry only what is new.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pydantic

from paged_backend.config import EngineConfig
from paged_backend.outputs import LogprobsDict, RequestOutput
from paged_backend.sampling_params import SamplingParams

from .api import AdapterError, build_sampling_params, to_adapter_error
from .serving_options import MAX_CACHE_SALT_CHARS

logger = logging.getLogger(__name__)

MODEL_JSON = "model.json"

INPUTS: tuple[dict[str, Any], ...] = (
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_cumulative_logprob", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_logprobs", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_input_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
)
OUTPUTS: tuple[dict[str, Any], ...] = (
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
)
RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                "return_num_output_tokens")

# vLLM engine arguments that change nothing here whatever their value (logging, Ray, remote code,
# CUDA-graph sizes, download places, v0 scheduler knobs ...): accepted, logged, ignored.
IGNORED_VLLM_ARGS = frozenset({
    "disable_custom_all_reduce", "trust_remote_code", "disable_log_requests", "enable_log_requests",
    "worker_use_ray", "distributed_executor_backend", "max_seq_len_to_capture",
    "disable_sliding_window", "tokenizer_mode", "revision", "code_revision", "tokenizer_revision", "download_dir",
    "compilation_config", "cpu_offload_gb", "use_v2_block_manager", "scheduler_delay_factor",
    "num_scheduler_steps", "multi_step_stream_outputs", "max_parallel_loading_workers", "ray_workers_use_nsight",
    "disable_async_output_proc", "guided_decoding_backend", "otlp_traces_endpoint", "collect_detailed_traces",
    "model_loader_extra_config", "ignore_patterns", "enable_sleep_mode", "max_logprobs", "block_allocator",
    "disable_frontend_multiprocessing", "limit_mm_per_prompt", "mm_processor_kwargs", "worker_cls",
    "scheduling_policy", "config_format", "load_in_low_bit", "override_pooler_config", "task", "runner",
    "max_lora_rank", "max_loras", "max_cpu_loras", "lora_extra_vocab_size", "lora_dtype", "fully_sharded_loras",
    "long_lora_scaling_factors",
})
# vLLM engine arguments for features this engine does not have: accepted (and ignored) only at the
# value that leaves the feature off, refused naming the key otherwise.
OFF_ONLY_VLLM_ARGS: dict[str, tuple[Any, ...]] = {
    "enable_lora": (None, False, "false", "False"),
    "enable_prompt_adapter": (None, False, "false", "False"),
    "data_parallel_size": (None, 1, "1"),
    "speculative_model": (None, ""),
    "num_speculative_tokens": (None, 0, "0"),
    "kv_transfer_config": (None, {}, ""),
    "hf_overrides": (None, {}, ""),
    "rope_scaling": (None, {}, ""),
}
# vLLM spellings of values that EngineConfig names otherwise
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def instance_count(model_config: Mapping[str, Any]) -> int:
    """How many instances of the model Triton runs: the ``instance_group`` counts (each times its listed
    ``gpus``); one when unset. (``KIND_GPU`` without ``gpus`` runs ``count`` on every GPU: counted once.)"""
    groups = model_config.get("instance_group") or [{}]
    return sum(int(g.get("count") or 1) * max(1, len(g.get("gpus") or [])) for g in groups)


def shared_core_config(config: EngineConfig, model_config: Mapping[str, Any]) -> EngineConfig:
    """``config`` for one model instance: with several instances they are front ends of one shared engine
    core process (``engine_core_shared``), so the model loads once."""
    if instance_count(model_config) > 1 and not config.engine_core_shared:
        return config.model_copy(update={"engine_core_shared": True})
    return config


def _vllm_to_engine_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's spellings mapped onto EngineConfig's: ``dtype: "half"``, ``served_model_name`` as a list."""
    fields = dict(args)
    dtype = fields.get("dtype")
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        fields["dtype"] = _DTYPE_ALIASES[dtype.lower()]
    name = fields.get("served_model_name")
    if isinstance(name, list):
        if len(name) > 1:
            raise AdapterError(f"{MODEL_JSON}: served_model_name: one name is served here, got {name}",
                               param="served_model_name")
        fields["served_model_name"] = name[0] if name else None
    return fields


def engine_config_from_model_json(args: Mapping[str, Any]) -> tuple[EngineConfig, list[str]]:
    """EngineConfig from a vllm_backend ``model.json``; also returns the vLLM-only keys ignored.

    Keys EngineConfig has (vLLM's names) configure the engine; vLLM engine arguments that change
    nothing here are ignored (the caller logs them); vLLM features this engine lacks are accepted
    only switched off; any other key fails, as vLLM's ``AsyncEngineArgs(**model_json)`` does."""
    known = set(EngineConfig.model_fields)
    ignored, refused = [], []
    for k, v in args.items():
        if k in known:
            continue
        if k in IGNORED_VLLM_ARGS:
            ignored.append(k)
        elif k in OFF_ONLY_VLLM_ARGS:
            (ignored if _is_off(v, OFF_ONLY_VLLM_ARGS[k]) else refused).append(k)
    if refused:
        k = sorted(refused)[0]
        off = next((v for v in OFF_ONLY_VLLM_ARGS[k] if v is not None and not isinstance(v, str)), None)
        raise AdapterError(f"{MODEL_JSON}: {k}={json.dumps(args[k])} asks for a vLLM feature this engine does not "
                           f"have; remove it or leave it off ({k}: {json.dumps(off)})", param=k)
    ignored.sort()
    fields = {k: v for k, v in args.items() if k not in ignored}
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        raise AdapterError(f"{MODEL_JSON}: unsupported engine arguments {unknown}; supported: {sorted(known)}",
                           param=unknown[0])
    try:
        return EngineConfig(**_vllm_to_engine_config(fields)), ignored
    except pydantic.ValidationError as exc:
        err = to_adapter_error(exc)
        raise AdapterError(f"{MODEL_JSON}: {err.message}", param=err.param) from None


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    return any(type(value) is type(o) and value == o for o in off)


def parse_sampling_parameters(text: str | bytes | None) -> SamplingParams:
    """vllm_backend's ``sampling_parameters`` JSON: None values dropped, strings converted."""
    return parse_request_parameters(text)[0]


def parse_request_parameters(text: str | bytes | None) -> tuple[SamplingParams, str | None]:
    """``sampling_parameters`` as SamplingParams, and the request's ``cache_salt`` (vLLM's
    per-request prefix-cache salt, sent in the same JSON) or None."""
    if text is None:
        return SamplingParams(), None
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AdapterError(f"sampling_parameters is not UTF-8 text: {exc.reason}.",
                               param="sampling_parameters") from None
    if not text.strip():
        return SamplingParams(), None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AdapterError(f"sampling_parameters is not valid JSON: {exc.msg}", param="sampling_parameters") from None
    if not isinstance(values, dict):
        raise AdapterError("sampling_parameters must be a JSON object.", param="sampling_parameters")
    values = {k: v for k, v in values.items() if v is not None}
    if "lora_name" in values:
        raise AdapterError("LoRA feature is not enabled.", param="lora_name")
    salt = values.pop("cache_salt", None)
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS):
        raise AdapterError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters.",
                           param="cache_salt")
    source = _structured_outputs(values)
    return build_sampling_params(values, field_names={"structured_outputs": source}, coerce_strings=True), salt


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vllm_backend drops a request-level ``guided_decoding.backend`` that names the default one and refuses others
_GUIDED_BACKENDS = ("xgrammar", "xgrammar:no-fallback", "auto", "xgrammar:_auto")


def _structured_outputs(values: dict[str, Any]) -> str:
    """Rewrite vllm_backend's structured-output forms in place into ``structured_outputs`` (a mapping).

    vllm_backend's clients send ``structured_outputs`` as JSON text inside ``sampling_parameters``
    (``json.dumps({"json": schema})``) or as an object; its older ``guided_decoding`` (object or
    text, with an optional ``backend``) and the OpenAI server's ``guided_*`` fields mean the same.
    More than one of them is refused naming the second. Returns the field the constraint came from."""
    found: list[str] = []
    spec: Any = None
    for name in ("structured_outputs", "guided_decoding"):
        if name not in values:
            continue
        value = values.pop(name)
        if isinstance(value, str | bytes):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise AdapterError(f"Invalid value for '{name}': not a JSON object ({exc.msg}).", param=name) from None
        if name == "guided_decoding" and isinstance(value, dict) and "backend" in value:
            value = dict(value)
            backend = value.pop("backend")
            if backend not in _GUIDED_BACKENDS:
                raise AdapterError(f"guided_decoding.backend is no longer supported request-level (got "
                                   f"{str(backend)[:40]!r}).", param="guided_decoding.backend")
        found.append(name)
        spec = value
    for name, key in _GUIDED.items():
        if name in values:
            found.append(name)
            spec = {key: values.pop(name)}
    if len(found) > 1:
        raise AdapterError(f"Send one structured-output constraint, not {', '.join(found)}.", param=found[1])
    if found:
        values["structured_outputs"] = spec
    return found[0] if found else "structured_outputs"


@dataclass
class GenerateInputs:
    """One request's inputs, decoded from its tensors."""

    prompt: str
    params: SamplingParams
    stream: bool = False
    prepend_input: bool = True
    returns: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(RETURN_FLAGS, False))
    cache_salt: str | None = None

    @classmethod
    def from_values(cls, text_input: str | bytes | None, *, stream: bool | None = None,
                    exclude_input_in_output: bool | None = None, sampling_parameters: str | bytes | None = None,
                    returns: Mapping[str, bool | None] | None = None) -> GenerateInputs:
        """vllm_backend's rules: the prompt is prepended unless excluded, never while streaming."""
        if text_input is None:
            raise AdapterError("The input 'text_input' is required.", param="text_input")
        try:
            prompt = text_input.decode("utf-8") if isinstance(text_input, bytes) else str(text_input)
        except UnicodeDecodeError as exc:
            raise AdapterError(f"text_input is not UTF-8 text: {exc.reason}.", param="text_input") from None
        streaming = bool(stream)
        if exclude_input_in_output is None:
            prepend = not streaming
        else:
            prepend = not exclude_input_in_output
        if prepend and streaming:
            raise AdapterError("When streaming, `exclude_input_in_output` = False is not allowed.",
                               param="exclude_input_in_output")
        flags = {k: bool((returns or {}).get(k)) for k in RETURN_FLAGS}
        params, salt = parse_request_parameters(sampling_parameters)
        return cls(prompt, params, streaming, prepend, flags, salt)


@dataclass
class OutputState:
    """What was already sent for one request, so streaming responses carry only news."""

    n: int
    prompt: str = ""
    sent_prompt: bool = False


def output_values(inputs: GenerateInputs, out: RequestOutput, state: OutputState,
                  token_text: Callable[[int], str]) -> dict[str, np.ndarray]:
    """Output tensors (name -> numpy) of one response, from a delta (streaming) or a merged
    full output (not streaming). Entry i belongs to sample i of the request's ``n``."""
    by_index = {c.index: c for c in out.outputs}
    n = max(state.n, len(by_index), 1)
    prefix = ""
    if inputs.prepend_input and not state.sent_prompt:
        prefix = out.prompt if out.prompt is not None else state.prompt
    state.sent_prompt = True
    values: dict[str, np.ndarray] = {}
    texts = [(prefix + by_index[i].text) if i in by_index else prefix for i in range(n)]
    values["text_output"] = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
    if inputs.returns["return_finish_reason"]:
        values["finish_reason"] = np.array(
            [str(by_index[i].finish_reason if i in by_index else None).encode() for i in range(n)], dtype=np.object_)
    if inputs.returns["return_cumulative_logprob"]:
        values["cumulative_logprob"] = np.array(
            [by_index[i].cumulative_logprob if i in by_index else 0.0 for i in range(n)], dtype=np.float32)
    if inputs.returns["return_logprobs"]:
        values["logprobs"] = np.array(
            [_logprobs_json(by_index.get(i), token_text).encode("utf-8") for i in range(n)], dtype=np.object_)
    if inputs.returns["return_num_input_tokens"]:
        values["num_input_tokens"] = np.array([len(out.prompt_token_ids)], dtype=np.uint32)
    if inputs.returns["return_num_output_tokens"]:
        values["num_output_tokens"] = np.array(
            [len(by_index[i].token_ids) if i in by_index else 0 for i in range(n)], dtype=np.uint32)
    return values


def _logprobs_json(c: Any, token_text: Callable[[int], str]) -> str:
    """vLLM's per-token logprobs: [{token_id: {logprob, rank, decoded_token}}, ...] or null.

    ``rank`` is the position among the returned candidates (1 = most likely)."""
    if c is None or c.logprobs is None:
        return "null"
    steps = []
    for d in c.logprobs:
        d: LogprobsDict
        ranked = sorted(d.items(), key=lambda kv: kv[1], reverse=True)
        steps.append({str(t): {"logprob": lp, "rank": r + 1, "decoded_token": token_text(t)}
                      for r, (t, lp) in enumerate(ranked)})
    return json.dumps(steps)


def triton_error_code(err: AdapterError) -> str:
    """Name of the ``pb_utils.TritonError`` code for an adapter error."""
    return {"invalid_request": "INVALID_ARG", "not_found": "NOT_FOUND", "unavailable": "UNAVAILABLE",
            "internal": "INTERNAL"}[err.kind]
