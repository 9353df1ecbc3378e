"""SpeculativeConfig: vLLM's keys, validated."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from paged_backend.spec_decode.config import SpeculativeConfig


def test_vllm_keys_and_lookup_defaults():
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5)
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 2, 5)
    assert SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2).prompt_lookup_max == 2
    c = SpeculativeConfig(num_speculative_tokens=3)
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)


@pytest.mark.parametrize("bad", [
    {"num_speculative_tokens": 0},
    {},
    {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
    {"num_speculative_tokens": 2, "method": "eagle", "model": "x"},
    {"num_speculative_tokens": 2, "method": "draft_model"},
    {"num_speculative_tokens": 2, "method": "ngram", "model": "x"},
    {"num_speculative_tokens": 2, "model": "x", "prompt_lookup_max": 3},
    {"num_speculative_tokens": 2, "method": "mtp", "model": "x"},
    {"num_speculative_tokens": 2, "method": "mtp", "prompt_lookup_min": 2},
    {"num_speculative_tokens": 2, "unknown_key": 1},
    {"num_speculative_tokens": 2, "disable_by_batch_size": 0},
    {"num_speculative_tokens": 2, "disable_by_batch_size": -4},
])
def test_refused(bad):
    with pytest.raises(ValidationError):
        SpeculativeConfig(**bad)


@pytest.mark.parametrize("method", [{}, {"model": "/d"}, {"method": "mtp"}])
def test_disable_by_batch_size(method):
    """Any method: None (the default) never disables speculation, 1 or more is the request count above which
    it is off."""
    assert SpeculativeConfig(num_speculative_tokens=2, **method).disable_by_batch_size is None
    for n in (1, 64):
        assert SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=n, **method).disable_by_batch_size == n
    assert SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=None).disable_by_batch_size is None


def test_draft_model_keys():
    c = SpeculativeConfig(model="/d", num_speculative_tokens=3)
    assert (c.method, c.model, c.prompt_lookup_min) == ("draft_model", "/d", None)
    assert SpeculativeConfig(method="draft_model", model="/d", num_speculative_tokens=1).method == "draft_model"


def test_mtp_keys():
    """The target's own MTP layers: no model, no lookup bounds."""
    c = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    assert (c.method, c.model, c.prompt_lookup_min, c.prompt_lookup_max) == ("mtp", None, None, None)


@pytest.mark.parametrize("alias", ["deepseek_mtp", "glm4_moe_mtp"])
def test_vllm_older_mtp_method_names_are_mtp(alias):
    assert SpeculativeConfig(method=alias, num_speculative_tokens=2).method == "mtp"
    assert SpeculativeConfig.model_validate({"method": alias, "num_speculative_tokens": 1}).method == "mtp"
    with pytest.raises(ValidationError, match="method 'mtp' takes no 'model'"):
        SpeculativeConfig(method=alias, num_speculative_tokens=2, model="x")
    with pytest.raises(ValidationError):  # other families' names are not read as mtp
        SpeculativeConfig(method="qwen3_next_mtp", num_speculative_tokens=2)


def test_engine_config_and_the_cli_flag():
    import argparse

    from paged_backend.config import EngineConfig
    from paged_backend.engine_args import add_engine_args, engine_config_from_args

    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert isinstance(cfg.speculative_config, SpeculativeConfig)
    assert EngineConfig().speculative_config is None
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                         '"prompt_lookup_max": 4, "disable_by_batch_size": 32}'])
    spec = engine_config_from_args(args).speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 4, 4)
    assert spec.disable_by_batch_size == 32
    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit):
            p.parse_args(["--speculative-config", bad])
    with pytest.raises(ValidationError):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
