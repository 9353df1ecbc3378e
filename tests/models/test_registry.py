"""The model registry: every architecture the config parser accepts has a model class, and an
unknown one is refused with the supported list."""

from __future__ import annotations

import pytest

from paged_backend.models import MODEL_REGISTRY, LlamaForCausalLM, get_model_class
from paged_backend.models.model_info import SUPPORTED_ARCHITECTURES


def test_registry_covers_exactly_the_parsed_architectures() -> None:
    assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def test_llama_family_shares_one_class() -> None:
    assert {get_model_class(a) for a in ("LlamaForCausalLM", "Qwen3ForCausalLM")} == {LlamaForCausalLM}


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
