"""Engine metrics under vLLM's Prometheus names, types, labels and buckets, kept out of the engine.

Three sources feed them: per-request observations an adapter makes from the deltas it
forwards (``RequestTimer`` -> request histograms, success counter), ``engine.stats()``
(gauges, token / prefix-cache / preemption counters) and the engine's per-step token counts
(``vllm:iteration_tokens_total``). One spec table names them all. ``PrometheusMetrics``
keeps its values in plain Python and renders them through one custom collector in a private
registry: no prometheus_client metric objects, so nothing lands in a multiprocess directory
(BentoML's ``PROMETHEUS_MULTIPROC_DIR``) where the server's own collector would publish each
family a second time, and no ``*_created`` families. The Triton adapter publishes the same
table through ``pb_utils.MetricFamily``.

    deltas --> RequestTimer --observe()--> sink (request histograms, success counter)
    engine.stats(), engine step tokens --at scrape (Triton: polled, and at each request end)--> the rest
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from paged_backend.outputs import RequestOutput

MetricKind = Literal["gauge", "counter", "histogram"]

# vLLM's bucket choices (vllm/v1/metrics/loggers.py)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM builds these 1-2-5 buckets up to max_model_len; here up to 100k tokens
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"  # one counter per draft position


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
    MetricSpec("vllm:num_requests_swapped", "gauge", "Number of requests swapped to CPU.", stat="num_swapped"),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               stat="kv_cache_usage"),
    MetricSpec("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
               stat="prefix_cache_queries"),
    MetricSpec("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               stat="prefix_cache_hits"),
    # vLLM's counters for prefix hits outside the GPU cache (its KV connectors, CPU offloading among them):
    # here the host tier's
    MetricSpec("vllm:external_prefix_cache_queries", "counter",
               "Prefix cache queries of the host KV tier, in terms of number of queried tokens.",
               stat="host_prefix_cache_queries"),
    MetricSpec("vllm:external_prefix_cache_hits", "counter",
               "Prefix cache hits in the host KV tier, in terms of number of cached tokens copied back.",
               stat="host_prefix_cache_hits"),
    MetricSpec("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", stat="prompt_tokens_total"),
    MetricSpec("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
               stat="generation_tokens_total"),
    MetricSpec("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.",
               stat="num_preemptions"),
    MetricSpec("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.",
               stat="spec_decode_num_drafts"),
    MetricSpec("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.",
               stat="spec_decode_num_draft_tokens"),
    MetricSpec("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.",
               stat="spec_decode_num_accepted_tokens"),
    MetricSpec(SPEC_ACCEPTED_PER_POS, "counter", "Accepted tokens per draft position.",
               stat="spec_decode_num_accepted_tokens_per_pos"),
    MetricSpec("vllm:request_success", "counter", "Count of successfully processed requests."),
    MetricSpec(CACHE_CONFIG_INFO, "gauge", "Information of the LLMEngine CacheConfig"),
    MetricSpec("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
               buckets=_TTFT_BUCKETS),
    MetricSpec("vllm:time_per_output_token_seconds", "histogram", "Histogram of time per output token in seconds.",
               buckets=_ITL_BUCKETS),
    MetricSpec("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
               buckets=_ITL_BUCKETS),
    MetricSpec("vllm:e2e_request_latency_seconds", "histogram",
               "Histogram of e2e request latency in seconds.", buckets=_REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_queue_time_seconds", "histogram",
               "Histogram of time spent in WAITING phase for request.", buckets=_REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_inference_time_seconds", "histogram",
               "Histogram of time spent in RUNNING phase for request.", buckets=_REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_prefill_time_seconds", "histogram",
               "Histogram of time spent in PREFILL phase for request.", buckets=_REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_decode_time_seconds", "histogram",
               "Histogram of time spent in DECODE phase for request.", buckets=_REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.",
               buckets=_TOKEN_BUCKETS),
    MetricSpec("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed.",
               buckets=_TOKEN_BUCKETS),
    MetricSpec("vllm:request_params_n", "histogram", "Histogram of the n request parameter.", buckets=_N_BUCKETS),
    MetricSpec("vllm:request_params_max_tokens", "histogram", "Histogram of the max_tokens request parameter.",
               buckets=_TOKEN_BUCKETS),
    MetricSpec(ITERATION_TOKENS, "histogram", "Histogram of number of tokens per engine_step.",
               buckets=_ITERATION_BUCKETS),
)
SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}
# published only while engine.stats() reports them (speculative decoding on), as vLLM registers them
SPEC_DECODE_METRICS = frozenset(m.name for m in METRICS if m.name.startswith("vllm:spec_decode_"))


def cache_config_labels(model_info: Mapping[str, Any], config: Any) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (vLLM's CacheConfig names) from the loaded engine."""
    return {
        "block_size": str(model_info.get("block_size", config.block_size)),
        "num_gpu_blocks": str(model_info.get("num_gpu_blocks", "")),
        "cache_dtype": str(config.kv_cache_dtype),
        "kv_cache_dtype": str(model_info.get("kv_cache_dtype", "")),  # the dtype the cache is stored in
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
        "calculate_kv_scales": str(config.calculate_kv_scales),
    }


class MetricsSink(Protocol):
    """Where per-request observations go (``PrometheusMetrics``, Triton's MetricFamily ...)."""

    def observe(self, name: str, value: float) -> None: ...

    def request_finished(self, finished_reason: str) -> None: ...


class RequestTimer:
    """Turns one request's stream of deltas into vLLM's per-request observations."""

    def __init__(self, sink: MetricsSink | None, clock: Callable[[], float] = time.monotonic, *,
                 n: int | None = None, max_tokens: int | None = None) -> None:
        self.sink = sink
        self.clock = clock
        self.start = clock()
        self.last: float | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.n = n
        self.max_tokens = max_tokens
        self.engine_metrics: Any = None
        self.done = False

    def on_delta(self, out: RequestOutput) -> None:
        """TTFT / ITL (and TPOT, vLLM's per-token name for the same gap) per engine step, at the
        engine's step times (``out.step_times``, several when deltas were merged for a slow
        consumer, as vLLM counts them); outputs without step times are timed at their delivery."""
        now = self.clock()
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            for t in out.step_times or (now,):
                if self.sink is not None:
                    if self.last is None:
                        self.sink.observe("vllm:time_to_first_token_seconds", t - self.start)
                    else:
                        self.sink.observe("vllm:inter_token_latency_seconds", t - self.last)
                        self.sink.observe("vllm:time_per_output_token_seconds", t - self.last)
                self.last = t
        self.prompt_tokens = out.usage.prompt_tokens
        self.generation_tokens = out.usage.completion_tokens
        if out.metrics is not None:
            self.engine_metrics = out.metrics
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            self.finish(reasons[-1] if reasons else "stop")

    def finish(self, finished_reason: str) -> None:
        """Record the end of the request once (a finished stream, or an abort)."""
        if self.done:
            return
        self.done = True
        sink = self.sink
        if sink is None:
            return
        sink.observe("vllm:e2e_request_latency_seconds", self.clock() - self.start)
        sink.observe("vllm:request_prompt_tokens", self.prompt_tokens)
        sink.observe("vllm:request_generation_tokens", self.generation_tokens)
        if self.n is not None:
            sink.observe("vllm:request_params_n", self.n)
        if self.max_tokens is not None:
            sink.observe("vllm:request_params_max_tokens", self.max_tokens)
        m = self.engine_metrics
        if m is not None:
            sink.observe("vllm:request_queue_time_seconds", m.queue_time)
            sink.observe("vllm:request_prefill_time_seconds", m.prefill_time)
            sink.observe("vllm:request_decode_time_seconds", m.decode_time)
            sink.observe("vllm:request_inference_time_seconds", m.inference_time)
        sink.request_finished(finished_reason)


class _Histogram:
    """Bucket counts, sum and count of one histogram (thread-safe)."""

    __slots__ = ("bounds", "counts", "total", "lock")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: +Inf
        self.total = 0.0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect_left(self.bounds, value)  # the first bucket whose upper bound (le) holds value
        with self.lock:
            self.counts[i] += 1
            self.total += value

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        from prometheus_client.utils import floatToGoString

        with self.lock:
            counts, total = list(self.counts), self.total
        out, acc = [], 0
        for bound, c in zip((*self.bounds, float("inf")), counts, strict=True):
            acc += c
            out.append((floatToGoString(bound), float(acc)))
        return out, total


class PrometheusMetrics:
    """Every metric of ``METRICS`` for one model, rendered by one collector in a private registry."""

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, float]] | None = None, *,
                 step_tokens: Callable[[], list[int]] | None = None,
                 cache_info: Callable[[], Mapping[str, str] | None] | None = None) -> None:
        from prometheus_client import CollectorRegistry

        self.model_name = model_name
        self.stats_fn = stats
        self.step_tokens_fn = step_tokens
        self.cache_info_fn = cache_info
        self.histograms = {m.name: _Histogram(m.buckets) for m in METRICS if m.kind == "histogram"}
        self.success: dict[str, int] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def set_stats_source(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self.stats_fn = stats

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def request_finished(self, finished_reason: str) -> None:
        with self._lock:
            self.success[finished_reason] = self.success.get(finished_reason, 0) + 1

    def take_step_tokens(self) -> None:
        """Fold the engine's per-step token counts into ``vllm:iteration_tokens_total``."""
        if self.step_tokens_fn is not None:
            hist = self.histograms[ITERATION_TOKENS]
            for n in self.step_tokens_fn():
                hist.observe(n)

    def render(self) -> str:
        """The Prometheus text exposition of every metric here."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode("utf-8")


class _Collector:
    """All families, in the spec table's order, each once."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self.owner = owner

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        owner = self.owner
        owner.take_step_tokens()
        stats = dict(owner.stats_fn()) if owner.stats_fn is not None else {}
        labels, values = ["model_name"], [owner.model_name]
        for m in METRICS:
            if m.name == CACHE_CONFIG_INFO:
                info = owner.cache_info_fn() if owner.cache_info_fn is not None else None
                if info:
                    family = GaugeMetricFamily(m.name, m.doc, labels=[*labels, *info])
                    family.add_metric([*values, *info.values()], 1.0)
                    yield family
            elif m.name == "vllm:request_success":
                family = CounterMetricFamily(m.name, m.doc, labels=[*labels, "finished_reason"])
                with owner._lock:
                    success = sorted(owner.success.items())
                for reason, count in success:
                    family.add_metric([*values, reason], float(count))
                yield family
            elif m.name in SPEC_DECODE_METRICS and m.stat not in stats:
                continue
            elif m.name == SPEC_ACCEPTED_PER_POS:
                family = CounterMetricFamily(m.name, m.doc, labels=[*labels, "position"])
                for pos, count in enumerate(stats[m.stat]):
                    family.add_metric([*values, str(pos)], float(count))
                yield family
            elif m.kind == "histogram":
                buckets, total = owner.histograms[m.name].cumulative()
                family = HistogramMetricFamily(m.name, m.doc, labels=labels)
                family.add_metric(values, buckets, total)
                yield family
            else:
                family_cls = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
                family = family_cls(m.name, m.doc, labels=labels)
                family.add_metric(values, float(stats.get(m.stat, 0) or 0))
                yield family
