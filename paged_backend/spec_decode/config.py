"""``SpeculativeConfig``: vLLM's ``--speculative-config`` keys, validated once."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram default when neither bound is given
# vLLM's older per-family names of the MTP method (it maps them to "mtp" too)
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp")


class SpeculativeConfig(BaseModel):
    """``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}``
    or ``{"method": "draft_model", "model": "<dir>", "num_speculative_tokens": 3}``
    or ``{"method": "mtp", "num_speculative_tokens": 1}``.

    ``ngram``: prompt lookup; one bound given alone sets the other (vLLM's rule), neither gives 5
    for both. ``draft_model``: a smaller checkpoint with the target's vocabulary proposes greedily
    (``method`` defaults to it when ``model`` is given). ``mtp``: the target checkpoint's own
    multi-token-prediction layers (``num_nextn_predict_layers`` in its config.json, checked when the
    engine loads it) propose greedily, reused in turn for more drafts than layers; vLLM's older names
    ``deepseek_mtp`` and ``glm4_moe_mtp`` are read as ``mtp``. Other vLLM methods (``eagle``, ``medusa``)
    are refused.

    ``disable_by_batch_size`` (any method; None: never): no drafts are proposed after a step while the
    scheduler holds more requests than this (running, waiting and swapped), so the next step is a plain
    decode step; speculation resumes once the count falls back to it. A large batch's verification
    passes (1 + k tokens a request) cost more than the accepted drafts save.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["ngram", "draft_model", "mtp"] | None = None
    num_speculative_tokens: int = Field(..., ge=1, le=32)
    model: str | None = None
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("method") in MTP_ALIASES:
            return {**data, "method": "mtp"}
        return data

    @model_validator(mode="after")
    def _bounds(self) -> SpeculativeConfig:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method != "ngram" and (self.prompt_lookup_min is not None or self.prompt_lookup_max is not None):
            raise ValueError("prompt_lookup_min / prompt_lookup_max are for method 'ngram'")
        if self.method == "draft_model":
            if self.model is None:
                raise ValueError("method 'draft_model' needs 'model', the draft checkpoint")
            return self
        if self.model is not None:  # mtp: the target checkpoint's own layers
            raise ValueError(f"method {self.method!r} takes no 'model'")
        if self.method == "mtp":
            return self
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
