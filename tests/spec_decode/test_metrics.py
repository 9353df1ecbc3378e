"""The spec_decode counters: vLLM's names in the Prometheus page, per-position labels, the log line."""

from __future__ import annotations

import logging

from paged_backend.adapters.metrics import PrometheusMetrics

from paged_backend.engine.spec_decoding import SpecDecodeStats
from paged_backend.engine.stats import EngineStats


def test_counters_and_mean_acceptance_length():
    s = SpecDecodeStats(accepted_per_pos=[0, 0, 0])
    s.record(3, 2)
    s.record(3, 0)
    s.record(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos) == (3, 8, 4, [2, 2, 0])
    assert s.mean_acceptance_length == 1.0 + 4 / 3


def test_prometheus_families_only_with_speculative_decoding():
    stats: dict = {"num_running": 1}
    metrics = PrometheusMetrics("m", lambda: stats)
    assert "spec_decode" not in metrics.render()
    s = SpecDecodeStats(accepted_per_pos=[0, 0])
    s.record(2, 1)
    stats.update(s.snapshot())
    text = metrics.render()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 1.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 1.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 1.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 0.0' in text


class _Sched:
    num_running = num_waiting = num_swapped = 0


class _CacheStats:
    hit_rate = 0.0
    queries = hits = 0


class _KV:
    usage = 0.0
    num_free_blocks = 0
    host = None  # no host tier
    stats = _CacheStats()


def test_log_line_reports_mean_acceptance_length(caplog):
    stats = EngineStats(interval=0)
    stats.spec = SpecDecodeStats(accepted_per_pos=[0, 0])
    stats.spec.record(2, 2)
    stats.spec.record(2, 0)
    with caplog.at_level(logging.INFO, logger="paged_backend"):
        stats.log(_Sched(), _KV(), 1e9)
    assert ("Mean acceptance length: 2.00, Accepted: 2 tokens, Drafted: 4 tokens, "
            "Per-position acceptance rate: 0.500, 0.500, Avg Draft acceptance rate: 50.0%") in caplog.text
    stats.spec.record(2, 1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="paged_backend"):
        stats.log(_Sched(), _KV(), 2e9)  # only the drafts since the last line
    assert ("Mean acceptance length: 2.00, Accepted: 1 tokens, Drafted: 2 tokens, "
            "Per-position acceptance rate: 1.000, 0.000, Avg Draft acceptance rate: 50.0%") in caplog.text
    assert stats.snapshot(_Sched(), _KV())["spec_decode_num_accepted_tokens_per_pos"] == [2, 1]


def test_triton_metrics_publish_spec_counters_once_counted(monkeypatch):
    """TritonMetrics over a stand-in of Triton's pb_utils metric API: the spec_decode counters appear
    once the engine counts drafts, one counter per draft position, advanced by the differences."""
    import sys
    import types

    class Metric:
        def __init__(self, labels: dict, buckets=None) -> None:
            self.labels, self.value = labels, 0.0

        def increment(self, v: float) -> None:
            self.value += v

        def set(self, v: float) -> None:
            self.value = v

        def observe(self, v: float) -> None:
            pass

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name, self.metrics = name, []

        def Metric(self, labels: dict, buckets=None) -> Metric:  # noqa: N802 (Triton's name)
            m = Metric(labels, buckets)
            self.metrics.append(m)
            return m

    fake = types.ModuleType("triton_python_backend_utils")
    fake.MetricFamily = MetricFamily
    fake.TritonModelException = RuntimeError
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    name = "paged_backend.adapters.triton_backend"
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        from paged_backend.adapters.triton_backend import TritonMetrics
    finally:  # the module bound to the stand-in must not outlive this test
        sys.modules.pop(name, None)
        import paged_backend.adapters as adapters

        if hasattr(adapters, "triton_backend"):
            delattr(adapters, "triton_backend")

    tm = TritonMetrics({"model": "m"})
    spec_families = [f for name, f in tm.families.items() if name.startswith("vllm:spec_decode")]
    assert len(spec_families) == 4 and not any(f.metrics for f in spec_families)
    tm.update_from_stats({"num_running": 1})
    assert not any(f.metrics for f in spec_families)
    s = SpecDecodeStats(accepted_per_pos=[0, 0])
    s.record(2, 1)
    tm.update_from_stats(s.snapshot())
    s.record(2, 2)
    tm.update_from_stats(s.snapshot())
    values = {(f.name, m.labels.get("position")): m.value for f in spec_families for m in f.metrics}
    assert values == {
        ("vllm:spec_decode_num_drafts_total", None): 2.0,
        ("vllm:spec_decode_num_draft_tokens_total", None): 4.0,
        ("vllm:spec_decode_num_accepted_tokens_total", None): 3.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0"): 2.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1"): 1.0,
    }
