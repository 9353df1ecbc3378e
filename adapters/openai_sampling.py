"""OpenAI request fields as ``SamplingParams``, and the user's names for the fields that
are renamed on the way (so an error names ``max_completion_tokens``, not ``max_tokens``).
"""

from __future__ import annotations

from typing import Any

from paged_backend.sampling_params import SamplingParams

from .api import AdapterError, build_sampling_params
from .openai_protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields


def _common_fields(body: _SamplingFields) -> dict[str, Any]:
    names = ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
             "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
             "include_stop_str_in_output", "allowed_token_ids")
    if body.stream_options is not None and not body.stream:
        raise AdapterError("Stream options can only be defined when `stream=True`.", param="stream_options")
    fields = {k: getattr(body, k) for k in names if getattr(body, k) is not None}
    if body.logit_bias:
        fields["logit_bias"] = _token_keys(body.logit_bias)
    return fields


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` JSON (token ids as object keys) with int keys."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise AdapterError(f"logit_bias keys must be token ids, got {key[:40]!r}.", param="logit_bias") from None
    return out


def chat_sampling_params(body: ChatCompletionRequest) -> tuple[SamplingParams, dict[str, str]]:
    """SamplingParams of a chat request, and the user's names for renamed fields."""
    fields = _common_fields(body)
    names: dict[str, str] = {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        fields["max_tokens"], names["max_tokens"] = body.max_completion_tokens, "max_completion_tokens"
    else:
        fields["max_tokens"] = body.max_tokens
    if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
        raise AdapterError("When using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    fields["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    return build_sampling_params(fields, field_names=names), names


def completion_sampling_params(body: CompletionRequest) -> tuple[SamplingParams, dict[str, str]]:
    fields = _common_fields(body)
    fields["max_tokens"] = body.max_tokens
    fields["logprobs"] = body.logprobs
    if body.echo and body.logprobs is not None:
        fields["prompt_logprobs"] = body.logprobs
    return build_sampling_params(fields, field_names={"prompt_logprobs": "logprobs"}), {"prompt_logprobs": "logprobs"}
