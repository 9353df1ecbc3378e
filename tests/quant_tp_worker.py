"""Rank entry point for tests/test_quant_tensor_parallel.py.

Spawned processes import their target by module name; a module on the tests' pythonpath
imports in the child, a test module (``tests.test_...`` under importlib mode) would not.
"""

from __future__ import annotations

import io
import os
import traceback
from pathlib import Path

import torch
from model_fixtures import PagedCache, paged_logits

from paged_backend.attention import get_attention_backend
from paged_backend.distributed import TPGroup, destroy_tp_group, init_tp_group
from paged_backend.models.layers import FusedLinear
from paged_backend.models.model_info import ModelInfo
from paged_backend.worker.model_loader import load_model

ROOT = Path(__file__).parent / "quant_checkpoints"
CHECKPOINTS = sorted(p.name for p in ROOT.iterdir() if (p / "reference.pt").is_file()) if ROOT.is_dir() else []
LOGIT_ATOL = 1e-4  # as test_quant_checkpoints.py: float32 rounding of the same dequantized math
TP = 2


def _prefills(ids: list[int]) -> tuple[int, ...]:
    return (len(ids), len(ids) - 3)  # one prefill; prefill + 3 paged decode steps


def _fp8_acts(name: str) -> bool:
    return name.startswith("ct-fp8")


def _load(name: str, tp: TPGroup | None, act_scheme: str | None = None):
    path = ROOT / name
    info = ModelInfo.from_dir(path)
    model = load_model(path, info, torch.float32, "cpu", get_attention_backend("torch", torch.device("cpu")), tp=tp)
    if act_scheme is not None:
        for m in model.modules():
            if isinstance(m, FusedLinear) and m.linear_method is not None:
                m.linear_method.act_scheme = act_scheme
    return model, info


def _logits(name: str, model, info) -> list[torch.Tensor]:
    got = []
    for r in torch.load(ROOT / name / "reference.pt")["refs"]:
        for prefill in _prefills(r["prompt_ids"]):
            cache = PagedCache(info.num_layers, model.model.layers[0].self_attn.num_kv_heads, info.head_dim,
                               torch.float32)
            got.append(paged_logits(model, r["prompt_ids"], prefill, cache))
    return got


def _greedy(name: str, model, info, tp: TPGroup) -> list[list[int]]:
    """Greedy continuations of the reference prompts (each token from a fresh prefill; rank 0,
    which holds the gathered logits, picks it and tells the others)."""
    res = []
    for r in torch.load(ROOT / name / "reference.pt")["refs"]:
        ids = list(r["prompt_ids"])
        for _ in r["greedy"]:
            cache = PagedCache(info.num_layers, model.model.layers[0].self_attn.num_kv_heads, info.head_dim,
                               torch.float32)
            logits = paged_logits(model, ids, len(ids), cache)
            ids.append(tp.broadcast_object(int(logits[-1].argmax()) if tp.rank == 0 else None))
        res.append(ids[len(r["prompt_ids"]):])
    return res


def _probe_input(k: int) -> torch.Tensor:
    return 3 * torch.randn(5, k, generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _rank_logits(rank: int, port: int, names: list[str], out) -> None:
    """One rank: load every checkpoint split over TP ranks and run the reference prompts; rank 0
    puts {name: {"logits", "greedy", "down_proj" (fp8 activations)}} (or a traceback) on ``out``.

    FP8-activation checkpoints run with activation quantization off (a split matmul's float32
    sum order moves a few activations across e4m3 rounding steps, which the stored logits cannot
    absorb), and their row-parallel ``down_proj`` with it on, fed one whole probe input."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        tp = init_tp_group(rank, TP, torch.device("cpu"), timeout_s=120.0)
        results = {}
        for name in names:
            model, info = _load(name, tp)
            res = {"greedy": _greedy(name, model, info, tp)}
            if _fp8_acts(name):
                down = model.model.layers[0].mlp.down_proj
                start, size = down.tp_spec.in_range
                res["down_proj"] = down(_probe_input(size * TP)[:, start : start + size])
                model, info = _load(name, tp, act_scheme="none")
            else:
                model, info = _load(name, tp)
            res["logits"] = _logits(name, model, info)
            results[name] = res
        if rank == 0:  # as bytes: a tensor sent through a queue dies with its sender's shared memory
            buf = io.BytesIO()
            torch.save(results, buf)
            out.put(buf.getvalue())
    except BaseException:
        out.put(traceback.format_exc())
        raise
    finally:
        destroy_tp_group()
