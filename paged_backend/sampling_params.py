"""Per-request sampling parameters, with the OpenAI / vLLM field names.

Validation happens once, here: an invalid value raises ``pydantic.ValidationError``
whose message names the field. Adapters turn that into a 400 / InvalidArgument.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64  # a stop string is searched for in every new piece of text: both are capped
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # entries (OpenAI takes up to 300)
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 1024  # each is tokenized once per request and matched against the output every step
MAX_BAD_WORD_CHARS = 1024


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a request holds (vLLM's values).

    CUMULATIVE: everything so far, every step. DELTA: only what is new since the last output
    (the default here: the streaming adapters and ``AsyncEngine`` merge deltas).
    FINAL_ONLY: one output, when the request finishes, holding everything; ``LLM.generate``
    uses it so the engine builds no per-step outputs.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}  # vLLM's key -> field


class StructuredOutputsParams(BaseModel):
    """A constraint on the output (vLLM's ``structured_outputs``): exactly one of a JSON schema, any JSON
    object, a regex, a choice among strings or an EBNF grammar (``sample/grammar.py`` compiles it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json",
                                                     description="a JSON schema (object or its text)")
    json_object: bool | None = Field(None, description="any JSON object")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="an EBNF (GBNF) grammar")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [k for k in _KINDS if getattr(self, _KINDS[k]) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar "
                             f"(got {', '.join(given) or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, _KINDS[k]) not in (None, False))


class SamplingParams(BaseModel):
    """How to turn logits into tokens, and when to stop."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    n: int = Field(1, ge=1, le=128, description="parallel samples per prompt")
    max_tokens: int | None = Field(16, ge=1, description="None: up to max_model_len")
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0: disabled")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    logit_bias: dict[int, float] | None = Field(None, description="token id -> added to its logit (-100..100)")
    allowed_token_ids: list[int] | None = Field(None, description="only these token ids may be sampled")
    bad_words: list[str] | None = Field(None, description="words never generated: the last token of each one's "
                                                          "token sequence (with and without a leading space) is "
                                                          "banned right after the rest of it")
    structured_outputs: StructuredOutputsParams | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True
    detokenize: bool = True
    use_beam_search: bool = False
    beam_width: int = Field(1, ge=1, le=64)
    length_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(v)})")
        longest = max(map(len, v), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters (got {longest})")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_nonneg(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed (got {len(v)})")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed (got {len(v)})")
        for t, b in v.items():
            if t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids (got {t})")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100] (token {t}: {b})")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_nonempty(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("allowed_token_ids must not be empty")
        if any(t < 0 for t in v):
            raise ValueError("allowed_token_ids must be non-negative token ids")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words_valid(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if len(v) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad_words are allowed (got {len(v)})")
        if any(not w.strip() for w in v):
            raise ValueError("bad_words must not be empty or blank")
        longest = max(map(len, v), default=0)
        if longest > MAX_BAD_WORD_CHARS:
            raise ValueError(f"a bad word may have at most {MAX_BAD_WORD_CHARS} characters (got {longest})")
        return v

    @property
    def biases_logits(self) -> bool:
        """Whether ``logit_bias`` or ``allowed_token_ids`` change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.use_beam_search and self.structured_outputs is not None:
            raise ValueError("structured_outputs do not apply to beam search")
        if self.use_beam_search and self.biases_logits:
            raise ValueError("logit_bias and allowed_token_ids do not apply to beam search (it ranks the raw "
                             "logprobs)")
        if self.use_beam_search and self.bad_words:
            raise ValueError("bad_words do not apply to beam search (it ranks the raw logprobs)")
        if self.use_beam_search and self.beam_width < 2 and self.n < 2:
            # beam search with one beam is greedy; allowed, but beam_width follows n
            pass
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (-1, 0) else self.top_k

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
