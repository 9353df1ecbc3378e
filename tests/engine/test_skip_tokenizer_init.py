"""``skip_tokenizer_init`` (vLLM's ``--skip-tokenizer-init``): a checkpoint without tokenizer files
serves token-id prompts, outputs carry ids and no text, a text prompt is refused by name."""

from __future__ import annotations

import pytest
from model_fixtures import make_tiny_checkpoint

from paged_backend import LLM, SamplingParams
from paged_backend.errors import InvalidRequestError


def test_token_ids_in_and_out_without_a_tokenizer(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "tiny", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20)
    llm = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20,
              skip_tokenizer_init=True, log_stats_interval=0)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text == ""
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate(["some text"], SamplingParams(max_tokens=2), use_tqdm=False)
