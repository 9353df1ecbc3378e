"""What an operator sets for the HTTP front end, apart from the engine: keys, limits, privacy.

``ServingOptions`` is validated once; the BentoML service takes these fields as bento
arguments (``--arg api_key=...``) beside the engine's, and ``create_openai_app`` and
``ServingGuard`` read them. Defaults are the safe choice: no request-supplied chat
templates, paths of the model kept private, bodies and batches capped.
"""

from __future__ import annotations

import hashlib
import os

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

API_KEY_ENV = "VLLM_API_KEY"  # vLLM's variable, so a vLLM deployment's environment keeps working
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
MAX_CACHE_SALT_CHARS = 1024


class ServingOptions(BaseModel):
    """Front-end options (vLLM's names where vLLM has them)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    api_key: list[str] | None = Field(
        None, description="bearer keys accepted on /v1, /generate and /stats (a comma-separated string, or a "
        f"list); default: ${API_KEY_ENV} when set, else no authentication")
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=1024,
                                   description="largest request body; larger ones get a 413")
    max_batch_prompts: int = Field(256, ge=1, description="most prompts x n in one /v1/completions request")
    request_read_timeout: float = Field(30.0, gt=0.0, description="seconds to receive a request's headers, and "
                                        "again its body (408 after)")
    trust_request_chat_template: bool = Field(
        False, description="let requests bring their own Jinja chat template (chat_template, "
        "chat_template_kwargs.chat_template); off: such requests get a 400")
    enable_prompt_tokens_details: bool = Field(
        True, description="report usage.prompt_tokens_details.cached_tokens (off: a tenant cannot tell from the "
        "usage whether another tenant sent the same prompt)")
    cache_salt_from_user: bool = Field(
        False, description="salt the prefix cache with the request's `user` field when it sends no cache_salt, "
        "so different users never share cached blocks")
    expose_model_path: bool = Field(False, description="show the model's directory in /v1/models and /stats "
                                    "(off: only its name)")
    enable_auto_tool_choice: bool = Field(
        False, description="vLLM's --enable-auto-tool-choice: tool_choice 'auto' (the default with tools) lets the "
        "model write calls, found by tool_call_parser; off: such requests get a 400")
    tool_call_parser: str | None = Field(
        None, description="vLLM's --tool-call-parser: hermes, llama3_json, deepseek_v3 or glm45 (adapters/tool_parsers.py)")
    reasoning_parser: str | None = Field(
        None, description="vLLM's --reasoning-parser: deepseek_r1 or glm45; the reasoning comes back as reasoning_content")

    @model_validator(mode="after")
    def _known_parsers(self) -> ServingOptions:
        from .reasoning_parsers import REASONING_PARSERS
        from .tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not one of {', '.join(sorted(TOOL_PARSERS))}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {self.reasoning_parser!r} is not one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (vLLM: --enable-auto-tool-choice "
                             "requires --tool-call-parser)")
        return self

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            value = [k.strip() for k in value.split(",")]
        if isinstance(value, list):
            value = [k for k in value if k] or None
        return value

    def api_keys(self) -> tuple[str, ...]:
        """The keys in force: the option, else ``$VLLM_API_KEY`` (comma-separated), else none."""
        if self.api_key:
            return tuple(self.api_key)
        env = os.environ.get(API_KEY_ENV, "")
        return tuple(k.strip() for k in env.split(",") if k.strip())

    def serving_options(self) -> ServingOptions:
        """These fields alone (for subclasses that add engine or framework options)."""
        return ServingOptions(**self.model_dump(include=set(ServingOptions.model_fields)))


def effective_cache_salt(cache_salt: str | None, user: str | None, *, from_user: bool) -> str | None:
    """The prefix-cache salt of a request: its own ``cache_salt``, keyed by ``user`` too when the
    operator salts by user (so two users never share blocks, whatever salts they send)."""
    if not from_user or user is None:
        return cache_salt
    key = f"{len(user)}:{user}|{cache_salt or ''}"
    return "user:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
