"""Engine metrics under vLLM's Prometheus names, kept out of the engine itself.

Two sources feed them: per-request timings that an adapter sees in the deltas it
forwards (``RequestTimer`` -> histograms, success counter), and ``engine.stats()``
read when scraped (gauges, token and prefix-cache counters). One spec table names
them all; ``PrometheusMetrics`` renders them with prometheus_client (BentoML, plain
ASGI apps) and the Triton adapter publishes the same table through
``pb_utils.MetricFamily``.

    deltas --> RequestTimer --observe()--> sink (histograms, success counter)
    engine.stats() --at scrape--> gauges, counters
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from paged_backend.outputs import RequestOutput

MetricKind = Literal["gauge", "counter", "histogram"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: ``name`` without the ``_total`` suffix Prometheus adds to counters."""

    name: str
    kind: MetricKind
    doc: str
    stat: str | None = None  # engine.stats() key for gauges / counters read at scrape time
    buckets: tuple[float, ...] = ()


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               stat="num_running"),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               stat="num_waiting"),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               stat="kv_cache_usage"),
    MetricSpec("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
               stat="prefix_cache_queries"),
    MetricSpec("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               stat="prefix_cache_hits"),
    MetricSpec("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", stat="prompt_tokens_total"),
    MetricSpec("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
               stat="generation_tokens_total"),
    MetricSpec("vllm:num_preemptions", "counter", "Cumulative number of preemptions from the engine.",
               stat="num_preemptions"),
    MetricSpec("vllm:request_success", "counter", "Count of successfully processed requests."),
    MetricSpec("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
               buckets=_LATENCY_BUCKETS),
    MetricSpec("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
               buckets=_ITL_BUCKETS),
    MetricSpec("vllm:e2e_request_latency_seconds", "histogram",
               "Histogram of e2e request latency in seconds.", buckets=_E2E_BUCKETS),
    MetricSpec("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed per request.",
               buckets=_TOKEN_BUCKETS),
    MetricSpec("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed per request.",
               buckets=_TOKEN_BUCKETS),
)
SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}


class MetricsSink(Protocol):
    """Where per-request observations go (prometheus_client, Triton's MetricFamily ...)."""

    def observe(self, name: str, value: float) -> None: ...

    def request_finished(self, finished_reason: str) -> None: ...


class RequestTimer:
    """Turns one request's stream of deltas into TTFT / ITL / e2e / token observations."""

    def __init__(self, sink: MetricsSink | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.sink = sink
        self.clock = clock
        self.start = clock()
        self.last: float | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.done = False

    def on_delta(self, out: RequestOutput) -> None:
        """TTFT / ITL per engine step, at the engine's step times (``out.step_times``, several
        when deltas were merged for a slow consumer, as vLLM counts them); outputs without
        step times are timed at their delivery."""
        now = self.clock()
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            for t in out.step_times or (now,):
                if self.sink is not None:
                    if self.last is None:
                        self.sink.observe("vllm:time_to_first_token_seconds", t - self.start)
                    else:
                        self.sink.observe("vllm:inter_token_latency_seconds", t - self.last)
                self.last = t
        self.prompt_tokens = out.usage.prompt_tokens
        self.generation_tokens = out.usage.completion_tokens
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            self.finish(reasons[-1] if reasons else "stop")

    def finish(self, finished_reason: str) -> None:
        """Record the end of the request once (a finished stream, or an abort)."""
        if self.done:
            return
        self.done = True
        if self.sink is None:
            return
        self.sink.observe("vllm:e2e_request_latency_seconds", self.clock() - self.start)
        self.sink.observe("vllm:request_prompt_tokens", self.prompt_tokens)
        self.sink.observe("vllm:request_generation_tokens", self.generation_tokens)
        self.sink.request_finished(finished_reason)


class PrometheusMetrics:
    """A private prometheus_client registry: histograms fed by timers, the rest read at scrape."""

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, float]] | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

        disable_created_metrics()  # as vLLM does: no "*_created" gauge family beside every counter / histogram
        self.model_name = model_name
        self.stats_fn = stats
        self.registry = CollectorRegistry(auto_describe=True)
        self._histograms = {
            m.name: Histogram(m.name, m.doc, ["model_name"], buckets=m.buckets, registry=self.registry)
            for m in METRICS if m.kind == "histogram"
        }
        self._success = Counter("vllm:request_success", SPECS["vllm:request_success"].doc,
                                ["model_name", "finished_reason"], registry=self.registry)
        # the labelled children once: observe() runs per streamed chunk
        self._observers = {name: h.labels(model_name=model_name) for name, h in self._histograms.items()}
        self.registry.register(_StatsCollector(self))

    def set_stats_source(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self.stats_fn = stats

    def observe(self, name: str, value: float) -> None:
        self._observers[name].observe(value)

    def request_finished(self, finished_reason: str) -> None:
        self._success.labels(model_name=self.model_name, finished_reason=finished_reason).inc()

    def render(self) -> str:
        """The Prometheus text exposition of every metric here."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode("utf-8")


class _StatsCollector:
    """Gauges and counters from ``engine.stats()``, computed at scrape time."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self.owner = owner

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = dict(self.owner.stats_fn()) if self.owner.stats_fn is not None else {}
        for m in METRICS:
            if m.stat is None:
                continue
            family_cls = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
            family = family_cls(m.name, m.doc, labels=["model_name"])
            family.add_metric([self.owner.model_name], float(stats.get(m.stat, 0) or 0))
            yield family
