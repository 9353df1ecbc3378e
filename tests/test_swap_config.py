"""The host tier's configuration rules, refused by name when EngineConfig is built (no engine, no torch)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from paged_backend.config import EngineConfig


def test_swap_space_with_a_draft_model_is_refused_naming_both():
    draft = {"method": "draft_model", "model": "/nowhere/draft", "num_speculative_tokens": 2}
    with pytest.raises(ValidationError, match=r"swap_space .*speculative_config method 'draft_model'"):
        EngineConfig(model="m", swap_space=1.0, speculative_config=draft)
    assert EngineConfig(model="m", swap_space=0.0, speculative_config=draft).swap_space == 0.0
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    assert EngineConfig(model="m", swap_space=1.0, speculative_config=ngram).swap_space == 1.0  # no cache of its own


def test_swap_preemption_needs_swap_space():
    with pytest.raises(ValidationError, match=r"preemption_mode 'swap' needs swap_space > 0"):
        EngineConfig(model="m", preemption_mode="swap")
    assert EngineConfig(model="m", preemption_mode="recompute").swap_space == 0.0
