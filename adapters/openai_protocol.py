"""OpenAI-compatible request / response models (the wire format of ``/v1``).

Requests accept OpenAI's fields plus vLLM's sampling extras (``top_k``, ``min_p``,
``repetition_penalty`` ...). OpenAI's fields (and vLLM's output-changing extras) that are not
implemented are refused with a 400 naming them when set to anything but their neutral value
(``UNSUPPORTED``), never silently ignored; structured outputs (``response_format``, ``structured_outputs``,
``guided_*``) become ``SamplingParams.structured_outputs`` (``openai_sampling``); fields unknown to both APIs are ignored, as OpenAI does. Types are
strict, as OpenAI's are (``true`` is not 1, ``"7"`` is not 7), and text must be valid
Unicode (a lone surrogate is refused, not passed to the tokenizer). Value ranges are
checked once, by ``build_sampling_params``, so every error names the user's field.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from paged_backend.sampling_params import MAX_LOGPROBS

from .serving_options import MAX_CACHE_SALT_CHARS

MAX_REQUEST_ID_CHARS = 256


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


def _find_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string in a JSON value holding a lone surrogate (not encodable as UTF-8)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _find_surrogate(k, path) or _find_surrogate(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if type(v) is not int:  # token-id lists: the ints are skipped fast
                found = _find_surrogate(v, f"{path}[{i}]")
                if found:
                    return found
    return None


class OpenAIRequest(OpenAIModel):
    """A request body or a part of one: strict types."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk too (with include_usage, or alone)

    @property
    def wants_usage(self) -> bool:
        """The closing usage chunk: ``include_usage``, or ``continuous_usage_stats`` without it (vLLM's
        ``include_usage`` defaults to true)."""
        return self.include_usage if "include_usage" in self.model_fields_set else self.continuous_usage_stats

    @property
    def continuous(self) -> bool:
        return self.continuous_usage_stats and self.wants_usage


# Fields of OpenAI's API (and vLLM's extras that change the output) not implemented, with the values that
# ask for nothing (accepted); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "store": (False,),
    "best_of": (1,),
    "guided_decoding_backend": ("auto", "xgrammar"),
    "guided_whitespace_pattern": (),
}
_WHY = {
    "functions": "the legacy functions field is not supported; send tools", "function_call": "the legacy function_call field is not supported; send tool_choice",
    "store": "storing responses is not supported",
    "best_of": "best_of is not supported (vLLM's V1 engine dropped it); use n, or use_beam_search with n as the "
               "beam width",
}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _refuse_unless_neutral(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or "field"
    if value is None or value in UNSUPPORTED.get(name, ()):
        return value
    why = _WHY.get(name) or f"'{name}' is not supported by this server"
    neutral = ", ".join(repr(v) for v in UNSUPPORTED.get(name, ())) or "null"
    raise ValueError(f"{why}; leave it out (or send {neutral})")


class _SamplingFields(OpenAIRequest):
    """Fields shared by chat and completions (OpenAI's, then vLLM's extras); the whole body's
    text is checked for valid Unicode once, here."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = _find_surrogate(data, "")
        if path is not None:
            raise PydanticCustomError("invalid_unicode", "'{path}' is not valid Unicode text (it holds a lone "
                                      "surrogate, which cannot be encoded as UTF-8)", {"path": path})
        return data

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias in [-100, 100]
    metadata: dict[str, Any] | None = None  # accepted: meaningful only with ``store``
    service_tier: str | None = None  # accepted: one tier here
    prompt_cache_key: str | None = None  # accepted: the prefix cache needs no key
    safety_identifier: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS,
                                   description="prefix-cache blocks are shared only among requests of equal salt")
    # structured outputs (vLLM's names; OpenAI's ``response_format`` on each route): at most one of them
    structured_outputs: dict[str, Any] | None = None  # json / json_object / regex / choice / grammar
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # beam search: n is the beam width (and the number of choices), as in vLLM
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None  # top prompt logprobs per prompt position (non-streamed responses)
    bad_words: list[str] | None = None
    return_token_ids: bool | None = None  # prompt_token_ids and each choice's token_ids in the response
    # not implemented: refused unless neutral (UNSUPPORTED)
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    store: Any = None

    # every UNSUPPORTED field, here or on a route's request (chat's tools, completions' best_of)
    _refused = field_validator(*UNSUPPORTED, check_fields=False)(_refuse_unless_neutral)


class TextContentPart(OpenAIRequest):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(OpenAIRequest):
    role: str
    content: str | list[TextContentPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's past calls (openai_tools.template_tool_calls)
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's past reasoning (templates that show it)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    tools: Any = None  # checked by openai_tools.tool_request (400s name the tool's field)
    tool_choice: Any = None  # none / auto / required / {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # vLLM's completions take it too


# -- responses ---------------------------------------------------------------------------

class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


# vLLM's extras of a response, left out of the JSON unless asked for (return_token_ids, prompt_logprobs)
_ABSENT_IF_NONE = Field(None, exclude_if=lambda v: v is None)


class PromptLogprob(OpenAIModel):
    """vLLM's entry of one candidate at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # null for the first prompt token


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _ABSENT_IF_NONE


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = _ABSENT_IF_NONE
    prompt_token_ids: list[int] | None = _ABSENT_IF_NONE


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _ABSENT_IF_NONE


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _ABSENT_IF_NONE  # return_token_ids: on the first chunk


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = _ABSENT_IF_NONE
    prompt_token_ids: list[int] | None = _ABSENT_IF_NONE  # streamed: on the choice's first chunk
    token_ids: list[int] | None = _ABSENT_IF_NONE


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "paged-backend"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
