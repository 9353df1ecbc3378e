"""Dense fp32 linears on the CPU (``models/cpu_linear.py``'s ``cpu_linear``): oneDNN on a weight
packed once when it is available and the batch has 2+ rows, ``F.linear`` otherwise; the same
result either way, the packed copy dropped by ``load_weights`` and bounded by the RAM budget."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_backend.models import cpu_linear as dense
from paged_backend.models.layers import FusedLinear


def _layer(bias: bool = True) -> FusedLinear:
    g = torch.Generator().manual_seed(0)
    layer = FusedLinear(64, [48, 48], bias=bias, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.data = torch.randn(96, 64, generator=g)
        if bias:
            layer.bias.data = torch.randn(96, generator=g)
    return layer


def _packed(layer: FusedLinear) -> dict:
    return layer.__dict__.get(dense.PACKED, {})


@pytest.mark.parametrize("rows", [None, (0, 48), (48, 96)])
def test_equals_f_linear_and_packs_once(rows, monkeypatch):
    # a budget of its own: engines of earlier tests in this process may still hold theirs
    monkeypatch.setattr(dense, "_PACK_BUDGET", [1 << 30])
    layer = _layer()
    x = torch.randn(7, 64)
    w, b = layer.weight, layer.bias
    if rows is not None:
        w, b = w[rows[0] : rows[1]], b[rows[0] : rows[1]]
    want = F.linear(x, w, b)
    got = dense.cpu_linear(layer, x, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32, another summation order
    key = rows or (0, 96)
    if dense._ONEDNN:
        first = _packed(layer)[key]
        assert first is not None
        dense.cpu_linear(layer, x, rows)
        assert _packed(layer)[key] is first  # reused, not packed again
    else:
        assert key not in _packed(layer)


def test_one_row_takes_f_linear():
    layer = _layer(bias=False)
    x = torch.randn(1, 64)
    torch.testing.assert_close(dense.cpu_linear(layer, x), F.linear(x, layer.weight))
    assert not _packed(layer)


def test_budget_exhausted_falls_back(monkeypatch):
    monkeypatch.setattr(dense, "_PACK_BUDGET", [100])  # bytes: less than one weight
    layer = _layer()
    x = torch.randn(5, 64)
    torch.testing.assert_close(dense.cpu_linear(layer, x), F.linear(x, layer.weight, layer.bias))
    if dense._ONEDNN:
        assert _packed(layer)[(0, 96)] is None  # remembered: F.linear from now on
        assert dense._PACK_BUDGET == [100]


@pytest.mark.skipif(not dense._ONEDNN, reason="oneDNN linear ops unavailable in this torch")
def test_load_weights_drops_the_packed_copies(tmp_path):
    from model_fixtures import make_tiny_checkpoint

    from paged_backend.attention import get_attention_backend
    from paged_backend.models.model_info import ModelInfo
    from paged_backend.worker.model_loader import load_model

    path = make_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    model = load_model(path, ModelInfo.from_dir(path), torch.float32, "cpu",
                       get_attention_backend("torch", torch.device("cpu")))
    lm_head = model.lm_head
    x = torch.randn(3, lm_head.in_features)
    before = model.compute_logits(x)
    assert _packed(lm_head)
    with torch.no_grad():
        lm_head.weight.mul_(2.0)  # in place: same storage, so only the drop makes it visible
    model.load_weights(iter([]))
    assert not _packed(lm_head)
    torch.testing.assert_close(model.compute_logits(x), 2 * before, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not dense._ONEDNN, reason="needs torch's oneDNN linear ops")
def test_freed_packed_copies_return_to_the_budget(monkeypatch):
    budget = [1 << 20]
    monkeypatch.setattr(dense, "_PACK_BUDGET", budget)
    layer = _layer()
    dense.cpu_linear(layer, torch.randn(4, 64))
    assert budget[0] == (1 << 20) - 96 * 64 * 4
    del layer  # no cycles here: freed at once, and with it the packed copy
    import gc

    gc.collect()
    assert budget[0] == 1 << 20
