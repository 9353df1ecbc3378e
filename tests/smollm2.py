"""Shared fixtures for tests on the real SmolLM2-135M-Instruct (fp32, CPU).

Reference outputs come from transformers' own ``generate`` on the same checkpoint, one
prompt at a time, computed once per session.
"""

from __future__ import annotations

import functools

import torch

MAX_NEW = 16
LONG = ("The history of the city goes back many centuries. Merchants came from distant lands to trade "
        "spices, silk and silver in its busy markets, and scholars gathered in its libraries. ") * 3
SHARED = ("You are a careful assistant. Answer the question in one short sentence, and do not add "
          "anything else. Think about the facts before you answer. Question: ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5, 6,",
    LONG + "In summary, the city was",
    SHARED + "What color is the sky?",
    SHARED + "How many legs does a spider have?",
    "Hi",
]


@functools.lru_cache(maxsize=1)
def model_dir() -> str:
    from paged_backend.models.default_model import ensure_default_model

    return str(ensure_default_model())


@functools.lru_cache(maxsize=1)
def hf_model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32)
    return m.eval()


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def prompt_ids(prompt: str) -> list[int]:
    return tokenizer().encode(prompt)


@functools.cache
def hf_greedy(prompt: str, max_new: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([prompt_ids(prompt)])
    with torch.inference_mode():
        out = hf_model().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                  do_sample=False, pad_token_id=2)
    return out[0, ids.shape[1]:].tolist()


@functools.cache
def hf_beam(prompt: str, num_beams: int, max_new: int, length_penalty: float) -> list[int]:
    ids = torch.tensor([prompt_ids(prompt)])
    with torch.inference_mode():
        out = hf_model().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                  do_sample=False, num_beams=num_beams, length_penalty=length_penalty,
                                  early_stopping=False, pad_token_id=2)
    toks = out[0, ids.shape[1]:].tolist()
    # transformers pads finished beams; cut after the first EOS
    return toks[: toks.index(2) + 1] if 2 in toks else toks


def make_llm(**kw):
    from paged_backend import LLM

    args = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=128 << 20, log_stats_interval=0, seed=0)
    args.update(kw)
    return LLM(model_dir(), **args)


def assert_no_leak(engine) -> None:
    """Every block is back in its pool (device and host tier) and no request is left anywhere."""
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    assert engine.kv.num_free_blocks == engine.kv.block_pool.num_total_usable
    assert engine.scheduler.num_swapped == 0
    if engine.swap is not None:  # the host tier: every block back too
        assert engine.swap.num_free_blocks == engine.swap.num_total_usable
