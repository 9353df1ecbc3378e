"""Quantized checkpoints under tensor parallelism (CPU, gloo): each tool-made checkpoint in
tests/quant_checkpoints/ split over 2 ranks reproduces the tool's own logits (same tolerance as
test_quant_checkpoints.py) and the single-process engine's greedy tokens; a group size that
does not divide a row-parallel rank's input is refused naming the layer.

Row-parallel ranks of the act-order GPTQ checkpoint use groups of every part of the input, and
FP8 per-token activation scales need the max over the whole split row: both are exercised here.
"""

from __future__ import annotations

import io
import socket

import pytest
import torch
import torch.multiprocessing as mp
from quant_tp_worker import (  # noqa: F401
    CHECKPOINTS,
    LOGIT_ATOL,
    ROOT,
    TP,
    _fp8_acts,
    _greedy,
    _load,
    _logits,
    _prefills,
    _probe_input,
    _rank_logits,
)

from paged_backend import LLM, SamplingParams
from paged_backend.attention import get_attention_backend
from paged_backend.distributed import TPGroup
from paged_backend.models.model_info import ModelInfo
from paged_backend.worker.model_loader import load_model


@pytest.fixture(scope="module")
def tp_logits() -> dict[str, list[torch.Tensor]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_logits, args=(r, port, CHECKPOINTS, out), daemon=True) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert not isinstance(res, str), res
    return torch.load(io.BytesIO(res))


def test_all_tool_checkpoints_are_split(tp_logits):
    want = {"gptq-g32", "gptq-g64-act-order", "awq-g64", "ct-w4a16-g128", "ct-fp8-dynamic"}
    assert want <= set(tp_logits), sorted(tp_logits)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_greedy_tokens_equal_tp1(tp_logits, name):
    """The stored greedy tokens are TP=1's (test_quant_checkpoints.py checks them through the engine)."""
    assert tp_logits[name]["greedy"] == [r["greedy"] for r in torch.load(ROOT / name / "reference.pt")["refs"]]


@pytest.mark.parametrize("name", [c for c in CHECKPOINTS if not _fp8_acts(c)])
def test_tp2_logits_match_the_tools_own_inference(tp_logits, name):
    ref = torch.load(ROOT / name / "reference.pt")
    want = [(r["logits"], n) for r in ref["refs"] for n in _prefills(r["prompt_ids"])]
    assert len(tp_logits[name]["logits"]) == len(want)
    for got, (logits, prefill) in zip(tp_logits[name]["logits"], want, strict=True):
        torch.testing.assert_close(got, logits, rtol=0.0, atol=LOGIT_ATOL,
                                   msg=lambda m, n=prefill: f"{name} ({ref['tool']}) at TP={TP}, prefill {n}: {m}")


@pytest.mark.parametrize("name", [c for c in CHECKPOINTS if _fp8_acts(c)])
@torch.no_grad()
def test_tp2_fp8_weights_and_activation_scales_match_tp1(tp_logits, name):
    """FP8 weights sliced per rank give TP=1's logits; a row-parallel rank's per-token activation
    scale is the max over the whole row (a per-rank max would quantize differently)."""
    model, info = _load(name, None, act_scheme="none")
    for got, want in zip(tp_logits[name]["logits"], _logits(name, model, info), strict=True):
        torch.testing.assert_close(got, want, rtol=0.0, atol=LOGIT_ATOL)
    model, _ = _load(name, None)
    down = model.model.layers[0].mlp.down_proj
    assert down.linear_method.act_scheme == "dynamic_token"
    want = down(_probe_input(down.in_features))
    torch.testing.assert_close(tp_logits[name]["down_proj"], want, rtol=0.0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("name", ["gptq-g64-act-order", "ct-fp8-dynamic"])
def test_tp2_engine_greedy_tokens_equal_tp1(name):
    """Through the engine (spawned worker): the act-order and fp8-activation checkpoints, whose
    row-parallel paths differ most from TP=1."""
    ref = torch.load(ROOT / name / "reference.pt")
    prompts = [r["prompt_ids"] for r in ref["refs"]]
    params = SamplingParams(temperature=0.0, max_tokens=len(ref["refs"][0]["greedy"]), ignore_eos=True)
    args = dict(model=str(ROOT / name), dtype="float32", device="cpu", attention_backend="torch",
                kv_cache_memory_bytes=1 << 22, disable_log_stats=True)
    tp1 = [o.outputs[0].token_ids for o in LLM(**args).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**args, tensor_parallel_size=TP)
    try:
        tp2 = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert tp2 == tp1 == [r["greedy"] for r in ref["refs"]]


def test_group_size_not_dividing_a_ranks_input_is_refused():
    """ct-w4a16-g128 over 4 ranks: o_proj's 256 inputs give each rank 64, half a group."""
    path = ROOT / "ct-w4a16-g128"
    info = ModelInfo.from_dir(path)
    backend = get_attention_backend("torch", torch.device("cpu"))
    tp = TPGroup(1, 4, torch.device("cpu"))  # no collectives run before the weights are created
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj: the per-rank input size 64 "
                                         r"\(256 split over tensor_parallel_size 4\) is not a multiple of "
                                         r"group_size=128"):
        load_model(path, info, torch.float32, "cpu", backend, tp=tp)
