"""Triton Inference Server Python-backend model: paged-backend behind vllm_backend's interface.

A model repository's ``1/model.py`` imports ``TritonPythonModel`` from here; ``1/model.json``
holds the engine arguments (vLLM's names). Only importable inside Triton's Python stub
(``triton_python_backend_utils``).

    execute() --run_coroutine_threadsafe--> asyncio loop thread: _infer() per request
       _infer: EngineAdapter.generate() deltas --> response queue --> response thread
               (sender.send, then sender.is_cancelled() -> abort, CANCELLED)
    engine loop thread (AsyncEngine) steps the model; finalize() drains and stops all.

Errors read as vllm_backend's (``Error generating stream: ...``). When the engine dies, every
request fails UNAVAILABLE ("Model is unavailable due to unhealthy engine ..."); with the model
parameter ``ENABLE_VLLM_HEALTH_CHECK`` (vllm_backend's) the model also unloads itself, so Triton
reports it not ready (that needs ``--model-control-mode=explicit``, as in vllm_backend).
Custom metrics (``REPORT_CUSTOM_METRICS``) stay off when model.json says ``disable_log_stats``.

With several model instances (``instance_group`` count > 1: one stub process each) every instance is a
front end of one shared engine core process (``engine_core_shared``; the model loads once): the first
instance starts it, the others attach, the last one's ``finalize`` stops it. Each instance's custom
metrics carry an ``instance`` label (two instances holding one Triton metric of the same labels free
it twice at unload and crash the server): every instance observes its own requests, and the engine's
gauges, counters and step tokens are published by one instance at a time (the core's
``engine_core_publisher``; the others' gauges read 0 and their counters stand still), so a sum over
``instance`` counts each once.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import traceback
import uuid
from typing import Any

import triton_python_backend_utils as pb_utils

from .api import AdapterError, EngineAdapter, merge_delta, to_adapter_error
from .metrics import (
    CACHE_CONFIG_INFO,
    ITERATION_TOKENS,
    METRICS,
    SPEC_ACCEPTED_PER_POS,
    SPEC_DECODE_METRICS,
    cache_config_labels,
)
from .triton_protocol import (
    INPUTS,
    MODEL_JSON,
    OUTPUTS,
    RETURN_FLAGS,
    GenerateInputs,
    OutputState,
    engine_config_from_model_json,
    instance_count,
    output_values,
    shared_core_config,
    triton_error_code,
)

_METRICS_POLL_S = 0.5
_DRAIN_TIMEOUT_S = 30.0


class TritonPythonModel:
    """Decoupled model: every request gets its responses through its own response sender."""

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        config = auto_complete_model_config.as_dict()
        have_in = {i["name"] for i in config.get("input", [])}
        have_out = {o["name"] for o in config.get("output", [])}
        for spec in INPUTS:
            if spec["name"] not in have_in:
                auto_complete_model_config.add_input(dict(spec))
        for spec in OUTPUTS:
            if spec["name"] not in have_out:
                auto_complete_model_config.add_output(dict(spec))
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    # -- lifecycle ---------------------------------------------------------------------

    def initialize(self, args: dict[str, str]) -> None:
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("paged-backend needs `model_transaction_policy { decoupled: true }`")
        path = os.path.join(args["model_repository"], args["model_version"], MODEL_JSON)
        with open(path) as f:
            engine_args = json.load(f)
        config, ignored = engine_config_from_model_json(engine_args)
        if ignored:
            self.logger.log_warn(f"[paged-backend] ignoring vLLM engine arguments this engine does not use: "
                                 f"{ignored}")
        config = shared_core_config(config, self.model_config)
        if config.engine_core_shared:
            self.logger.log_info(f"[paged-backend] {instance_count(self.model_config)} model instances: this one "
                                 f"({args.get('model_instance_name')}) is a front end of the shared engine core")
        self.model_name = args["model_name"]
        self._health_check = self._param("ENABLE_VLLM_HEALTH_CHECK").lower() == "true"
        self._unhealthy = False
        self._health_lock = threading.Lock()
        self.metrics: TritonMetrics | None = None
        if self._param("REPORT_CUSTOM_METRICS").lower() == "true":
            if config.disable_log_stats:  # as vllm_backend: no custom metrics without the engine's stats
                self.logger.log_info("[paged-backend] custom metrics are off: disable_log_stats is set in model.json")
            else:
                labels = {"model": self.model_name, "version": args["model_version"]}
                if config.engine_core_shared:  # Triton must not hold one metric for two instances (see above)
                    labels["instance"] = args.get("model_instance_name", "")
                self.metrics = TritonMetrics.create(labels,
                                                    self.logger)
        self.adapter = EngineAdapter(config, metrics=self.metrics)
        self.adapter.start()  # the model is loaded before Triton reports the model ready
        self.logger.log_info(f"[paged-backend] engine ready: {self.adapter.model_info()}")
        if self.metrics is not None:
            self.metrics.set_cache_config(cache_config_labels(self.adapter.model_info(), config))
        self._token_text_cache: dict[int, str] = {}
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="paged-backend-asyncio", daemon=True)
        self._loop_thread.start()
        self._responses: queue.Queue = queue.Queue()
        self._response_thread = threading.Thread(target=self._response_loop, name="paged-backend-responses",
                                                  daemon=True)
        self._response_thread.start()
        self._stop = threading.Event()
        if self.metrics is not None:
            self._metrics_thread = threading.Thread(target=self._poll_metrics, name="paged-backend-metrics",
                                                    daemon=True)
            self._metrics_thread.start()

    def _param(self, name: str) -> str:
        return self.model_config.get("parameters", {}).get(name, {}).get("string_value", "")

    def execute(self, requests: list[Any]) -> None:
        if not self._check_health(requests):
            return None
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._infer(request), self.loop)
        return None

    # -- health ------------------------------------------------------------------------

    def _check_health(self, requests: list[Any]) -> bool:
        """vllm_backend's health check: a dead engine fails every request UNAVAILABLE and, with
        ENABLE_VLLM_HEALTH_CHECK, unloads the model (Triton then reports it not ready)."""
        if self.adapter.is_alive:
            return True
        self._engine_died()
        message = f"Model is unavailable due to unhealthy engine: {self.adapter.failure}"
        for request in requests:
            try:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                self.logger.log_error(f"[paged-backend] sending a response failed: {traceback.format_exc()}")
        return False

    def _engine_died(self) -> None:
        """Once: log why, and unload the model when the health check is on."""
        with self._health_lock:
            if self._unhealthy:
                return
            self._unhealthy = True
        if not self._health_check:
            self.logger.log_error(f"[paged-backend] the engine is not healthy: {self.adapter.failure}; requests "
                                  "fail UNAVAILABLE (set the model parameter ENABLE_VLLM_HEALTH_CHECK to unload the "
                                  "model instead, with --model-control-mode=explicit)")
            return
        self.logger.log_error(f"[paged-backend] Engine is not healthy and model will be unloaded: "
                              f"{self.adapter.failure}")
        try:
            pb_utils.unload_model(self.model_name)  # non-blocking: finalize() runs when in-flight calls end
        except Exception as exc:
            self.logger.log_error(f"[paged-backend] the model could not unload itself ({exc}); model control "
                                  "must be explicit (--model-control-mode=explicit) for ENABLE_VLLM_HEALTH_CHECK")

    def finalize(self) -> None:
        self.logger.log_info("[paged-backend] finalize: draining in-flight requests")
        self.adapter.shutdown(drain_timeout=_DRAIN_TIMEOUT_S)
        self._stop.set()
        self._responses.put(None)
        self._response_thread.join()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join()
        if self.metrics is not None:
            self._metrics_thread.join()
            self.metrics.close()

    # -- requests ----------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._token_text_cache[token_id] = self.adapter.tokenizer.decode([token_id])
        return text

    @staticmethod
    def _read_inputs(request: Any) -> GenerateInputs:
        def scalar(name: str) -> Any:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                return None
            arr = tensor.as_numpy()
            return arr.reshape(-1)[0] if arr.size else None

        params = scalar("sampling_parameters")
        if params is None:
            params = request.parameters()  # vllm_backend's fallback: request parameters (JSON)
        flags = {k: scalar(k) for k in RETURN_FLAGS}
        stream = scalar("stream")
        exclude = scalar("exclude_input_in_output")
        return GenerateInputs.from_values(
            scalar("text_input"),
            stream=None if stream is None else bool(stream),
            exclude_input_in_output=None if exclude is None else bool(exclude),
            sampling_parameters=params,
            returns={k: None if v is None else bool(v) for k, v in flags.items()},
        )

    def _response(self, inputs: GenerateInputs, out: Any, state: OutputState) -> Any:
        values = output_values(inputs, out, state, self._token_text)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in values.items()])

    async def _infer(self, request: Any) -> None:
        sender = request.get_response_sender()
        status = {"cancelled": False}
        rid = f"triton-{uuid.uuid4().hex}"
        stream = None
        try:
            inputs = self._read_inputs(request)
            state = OutputState(n=inputs.params.n)
            stream = self.adapter.generate(inputs.prompt, inputs.params, request_id=rid, cache_salt=inputs.cache_salt)
            acc = None
            async for delta in stream:
                cancelled = status["cancelled"] if inputs.stream else sender.is_cancelled()
                if cancelled:
                    await stream.aclose()  # aborts the request: its blocks are free now
                    self.logger.log_info(f"[paged-backend] {rid} cancelled by the client: aborted, blocks freed")
                    self._responses.put((sender, status, self._cancelled(), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))
                    return
                if inputs.stream:
                    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if delta.finished else 0
                    self._responses.put((sender, status, self._response(inputs, delta, state), flags))
                else:
                    acc = merge_delta(acc, delta)
            if self.metrics is not None:  # counters current before the client sees the end of its request
                self._update_metrics()
            if not inputs.stream:
                response = self._response(inputs, acc, state) if acc is not None else self._error(
                    AdapterError("The engine returned no output.", kind="internal"))
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            err = to_adapter_error(exc)
            if err.kind == "internal":
                self.logger.log_error(f"[paged-backend] Error generating stream: {traceback.format_exc()}")
            elif err.kind == "unavailable" and not self.adapter.is_alive:
                self._engine_died()
            self._responses.put((sender, status, self._error(err), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))
        finally:
            if stream is not None:
                await stream.aclose()

    @staticmethod
    def _error(err: AdapterError) -> Any:
        """vllm_backend's error text (``Error generating stream: ...``) with the error's own code."""
        code = getattr(pb_utils.TritonError, triton_error_code(err))
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"Error generating stream: {err.message}", code))

    @staticmethod
    def _cancelled() -> Any:
        return pb_utils.InferenceResponse(
            error=pb_utils.TritonError("Request was cancelled", pb_utils.TritonError.CANCELLED))

    def _response_loop(self) -> None:
        """Sends responses in order, off the asyncio thread; notes cancellation for _infer."""
        while True:
            item = self._responses.get()
            if item is None:
                return
            sender, status, response, flags = item
            try:
                sender.send(response, flags=flags)
                if not flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                    status["cancelled"] = sender.is_cancelled()
            except Exception:
                self.logger.log_error(f"[paged-backend] sending a response failed: {traceback.format_exc()}")

    def _poll_metrics(self) -> None:
        while not self._stop.wait(_METRICS_POLL_S):
            self._update_metrics()

    def _update_metrics(self) -> None:
        try:
            self.metrics.update_from_stats(self.adapter.stats(), self.adapter.take_step_tokens())
        except Exception:
            self.logger.log_error(f"[paged-backend] metrics update failed: {traceback.format_exc()}")


class TritonMetrics:
    """The vLLM-named metrics of metrics.METRICS as Triton custom metrics (``/metrics``)."""

    _KINDS = {"gauge": "GAUGE", "counter": "COUNTER", "histogram": "HISTOGRAM"}

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.families: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}
        self.success: dict[str, Any] = {}
        self.last: dict[str, float] = {}
        self.lock = threading.Lock()
        for spec in METRICS:
            name = spec.name + ("_total" if spec.kind == "counter" else "")
            family = pb_utils.MetricFamily(name=name, description=spec.doc,
                                           kind=getattr(pb_utils.MetricFamily, self._KINDS[spec.kind]))
            self.families[spec.name] = family
            if spec.name in ("vllm:request_success", CACHE_CONFIG_INFO) or spec.name in SPEC_DECODE_METRICS:
                # made on first use (one metric per finished_reason; spec_decode ones while speculative
                # decoding counts, one per draft position) / once the engine is loaded
                continue
            if spec.kind == "histogram":
                self.metrics[spec.name] = family.Metric(labels=labels, buckets=[float(b) for b in spec.buckets])
            else:
                self.metrics[spec.name] = family.Metric(labels=labels)

    @classmethod
    def create(cls, labels: dict[str, str], logger: Any) -> TritonMetrics | None:
        try:
            return cls(labels)
        except pb_utils.TritonModelException as exc:
            if "metrics not supported" in str(exc):
                logger.log_info("[paged-backend] metrics are disabled on this server")
                return None
            raise

    def set_cache_config(self, info: dict[str, str]) -> None:
        """``vllm:cache_config_info``: a gauge at 1 whose labels are the cache's configuration."""
        metric = self.families[CACHE_CONFIG_INFO].Metric(labels={**self.labels, **info})
        metric.set(1.0)
        self.metrics[CACHE_CONFIG_INFO] = metric

    def observe(self, name: str, value: float) -> None:
        self.metrics[name].observe(float(value))

    def request_finished(self, finished_reason: str) -> None:
        with self.lock:
            metric = self.success.get(finished_reason)
            if metric is None:
                metric = self.success[finished_reason] = self.families["vllm:request_success"].Metric(
                    labels={**self.labels, "finished_reason": finished_reason})
        metric.increment(1.0)

    def update_from_stats(self, stats: dict[str, Any], step_tokens: list[int] = ()) -> None:
        """Gauges set, counters advanced by what the engine counted since the last update, the
        engine steps since then observed (the poller and request ends both call this).

        Model instances on one shared engine core: only the core's ``engine_core_publisher`` sets the
        gauges, advances the counters and observes the steps; the others keep their gauges at 0 and
        their last values current, so whichever takes over counts on from there."""
        publisher = stats.get("engine_core_publisher")
        publish = publisher is None or publisher == stats.get("engine_core_client")
        with self.lock:
            for spec in METRICS:
                if spec.stat is None or spec.stat not in stats:
                    continue
                if spec.name == SPEC_ACCEPTED_PER_POS:
                    for pos, count in enumerate(stats[spec.stat]):
                        self._advance(f"{spec.name}/{pos}", float(count), lambda p=pos, f=self.families[
                            spec.name]: f.Metric(labels={**self.labels, "position": str(p)}), publish)
                    continue
                value = float(stats[spec.stat] or 0)
                if spec.kind == "gauge":
                    self.metrics[spec.name].set(value if publish else 0.0)
                else:
                    self._advance(spec.name, value, lambda f=self.families[spec.name]: f.Metric(labels=self.labels),
                                  publish)
            if publish:
                hist = self.metrics[ITERATION_TOKENS]
                for n in step_tokens:
                    hist.observe(float(n))

    def _advance(self, key: str, value: float, make: Any, publish: bool = True) -> None:
        """The counter ``key`` advanced to ``value`` (one missing is made by ``make()``: per-position
        counters appear with their position); not ``publish``: only its last value noted."""
        step = value - self.last.get(key, 0.0)
        if step > 0 and not publish:
            self.last[key] = value
        elif step > 0:
            metric = self.metrics.get(key)
            if metric is None:
                metric = self.metrics[key] = make()
            metric.increment(step)
            self.last[key] = value

    def close(self) -> None:
        """Metrics must go before their families (the stub refuses the other order)."""
        self.metrics.clear()
        self.success.clear()
        self.families.clear()
