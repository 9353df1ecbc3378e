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
    if body.bad_words:
        fields["bad_words"] = body.bad_words
    if body.prompt_logprobs is not None:
        if body.stream and body.prompt_logprobs > 0:  # vLLM's rule and wording
            raise AdapterError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        fields["prompt_logprobs"] = body.prompt_logprobs
    return fields


# fields beam search does not apply (it ranks the raw logprobs of whole sequences), with their neutral values
_NOT_WITH_BEAMS: dict[str, tuple[Any, ...]] = {
    "stop": ([],), "min_tokens": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],),
    "prompt_logprobs": (),
}


def _beam_search(body: _SamplingFields, fields: dict[str, Any], names: dict[str, str], logprobs: bool) -> None:
    """``use_beam_search``: ``n`` is the beam width (vLLM's), ``length_penalty`` its length normalization;
    fields beam search would ignore are a 400 naming them. Without beam search ``length_penalty`` does nothing."""
    if not body.use_beam_search:
        return
    for name, neutral in _NOT_WITH_BEAMS.items():
        value = getattr(body, name)
        if value is not None and value not in neutral:
            raise AdapterError(f"'{name}' does not apply to beam search (use_beam_search); leave it out.",
                               param=name)
    if logprobs:
        raise AdapterError("'logprobs' does not apply to beam search (use_beam_search); leave it out.",
                           param="logprobs")
    if fields.get("structured_outputs") is not None:
        name = names.get("structured_outputs", "structured_outputs")
        raise AdapterError(f"'{name}' does not apply to beam search (use_beam_search); leave it out.", param=name)
    fields["use_beam_search"] = True
    fields["beam_width"], names["beam_width"] = fields.get("n", 1), "n"
    if body.length_penalty is not None:
        fields["length_penalty"] = body.length_penalty


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(body: _SamplingFields) -> tuple[dict[str, Any] | None, str]:
    """The request's structured-output spec (``StructuredOutputsParams``' fields) and the field it came from:
    ``response_format`` (json_object, or json_schema's ``schema``), ``structured_outputs`` or a ``guided_*``
    field; more than one is a 400."""
    found: list[tuple[dict[str, Any], str]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(({"json_object": True}, "response_format"))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, dict | bool):
                raise AdapterError("response_format of type json_schema needs json_schema.schema, a JSON schema "
                                   "object.", param="response_format")
            found.append(({"json": schema if isinstance(schema, dict) else {}}, "response_format"))
        elif kind != "text":
            raise AdapterError(f"response_format.type must be 'text', 'json_object' or 'json_schema' (got "
                               f"{str(kind)[:40]!r}).", param="response_format")
    if body.structured_outputs is not None:
        found.append((dict(body.structured_outputs), "structured_outputs"))
    for name, key in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append(({key: value}, name))
    if len(found) > 1:
        raise AdapterError(f"Send one structured-output constraint, not {', '.join(f for _, f in found)}.",
                           param=found[1][1])
    return found[0] if found else (None, "structured_outputs")


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` JSON (token ids as object keys) with int keys."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise AdapterError(f"logit_bias keys must be token ids, got {key[:40]!r}.", param="logit_bias") from None
    return out


def chat_sampling_params(body: ChatCompletionRequest, tool_constraint: dict[str, Any] | None = None
                         ) -> tuple[SamplingParams, dict[str, str]]:
    """SamplingParams of a chat request, and the user's names for renamed fields. ``tool_constraint``: the
    structured-output spec of ``tool_choice`` "required" or a named function (``openai_tools``)."""
    fields = _common_fields(body)
    names: dict[str, str] = {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        fields["max_tokens"], names["max_tokens"] = body.max_completion_tokens, "max_completion_tokens"
    else:
        fields["max_tokens"] = body.max_tokens
    if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
        raise AdapterError("When using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    fields["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    fields["structured_outputs"], names["structured_outputs"] = structured_outputs(body)
    if tool_constraint is not None:
        if fields["structured_outputs"] is not None:
            raise AdapterError(f"tool_choice {body.tool_choice!r:.60} constrains the output already; leave out "
                               f"{names['structured_outputs']}.", param=names["structured_outputs"])
        fields["structured_outputs"], names["structured_outputs"] = tool_constraint, "tools"
    _beam_search(body, fields, names, body.logprobs)
    return build_sampling_params(fields, field_names=names), names


def completion_sampling_params(body: CompletionRequest) -> tuple[SamplingParams, dict[str, str]]:
    fields = _common_fields(body)
    fields["max_tokens"] = body.max_tokens
    fields["logprobs"] = body.logprobs
    names: dict[str, str] = {}
    if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
        fields["prompt_logprobs"], names["prompt_logprobs"] = body.logprobs, "logprobs"
    fields["structured_outputs"], names["structured_outputs"] = structured_outputs(body)
    _beam_search(body, fields, names, body.logprobs is not None)
    return build_sampling_params(fields, field_names=names), names
