"""``SpeculativeConfig``: vLLM's ``--speculative-config`` keys, validated once."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram default when neither bound is given


class SpeculativeConfig(BaseModel):
    """``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}``.

    Only the n-gram (prompt lookup) proposer is served: ``method`` refuses other values (vLLM's
    ``draft_model``, ``eagle``, ``medusa``, ``mtp`` need a second model). One bound of the lookup
    given alone sets the other (vLLM's rule); neither gives 5 for both.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(..., ge=1, le=32)
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> SpeculativeConfig:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        return self
