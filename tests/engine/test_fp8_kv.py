"""FP8 (e4m3) KV cache on the CPU reference path: same arithmetic as the kernels."""

from __future__ import annotations

import math

import pytest
import torch
from smollm2 import PROMPTS, make_llm, prompt_ids

from paged_backend import SamplingParams

pytestmark = pytest.mark.slow

TEXT = ("The Industrial Revolution began in Great Britain in the late eighteenth century and spread to "
        "Europe and North America. It changed how goods were made: hand tools gave way to machines, and "
        "workshops to factories powered first by water and then by steam. Cities grew quickly as people "
        "moved from the countryside to find work.")


def _perplexity(llm, ids):
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    return math.exp(-sum(lps) / len(lps))


def _top1(llm, ids):
    """The most likely next token at every prompt position (teacher-forced)."""
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    return [max(lp, key=lp.get) for lp in out.prompt_logprobs[1:]]


@pytest.mark.parametrize("calculate", [False, True])
def test_fp8_kv_perplexity_and_greedy_agreement(llm, calculate, capsys):
    fp8 = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=calculate)
    assert fp8.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    ids = prompt_ids(TEXT)
    base, quant = _perplexity(llm, ids), _perplexity(fp8, ids)
    attns = [m for m in fp8.engine.runner.model.modules() if hasattr(m, "calibrate_kv_scales")]
    assert len(attns) == 30 and not any(m.calibrate_kv_scales for m in attns)
    assert all(float(m.k_scale) != 1.0 for m in attns) == calculate
    # top-1 agreement with teacher forcing: every position is judged on the same prefix (a free
    # greedy continuation would count every token after a first divergence as a miss)
    same, total = 0, 0
    for prompt in [TEXT, *PROMPTS]:
        pids = prompt_ids(prompt)
        a, b = _top1(llm, pids), _top1(fp8, pids)
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
    with capsys.disabled():
        print(f"\nfp8 KV (calculate_kv_scales={calculate}): perplexity {base:.4f} -> {quant:.4f} "
              f"({100 * (quant / base - 1):+.2f}%), teacher-forced top-1 agreement {same}/{total}")
    assert abs(quant / base - 1) <= 0.02
    assert same / total >= 0.85
