"""The adapter API: the one framework-neutral surface every serving adapter goes through.

``EngineAdapter`` owns an ``AsyncEngine``, or with ``engine_core_process`` an
``EngineCoreClient`` of an engine core process (start / ready / drain / shutdown), streams
deltas with metrics recorded on the way, and is the single place where user-facing
request fields become ``SamplingParams`` and where any refusal becomes an
``AdapterError`` (message, offending field, kind -> HTTP status / Triton code; defined in
``adapter_errors`` and importable from here).

    adapter = EngineAdapter({"model": "SmolLM2-135M-Instruct"}); adapter.start()
    params = build_sampling_params({"max_tokens": 32, "temperature": 0})
    async for delta in adapter.generate("Hello", params): ...
"""

from __future__ import annotations

import json
import logging
import threading
import types
import typing
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal

import pydantic

from paged_backend.config import EngineConfig
from paged_backend.errors import EngineDeadError, InvalidRequestError
from paged_backend.outputs import RequestOutput, merge_delta
from paged_backend.sampling_params import SamplingParams

from .adapter_errors import AdapterError, ErrorKind, short_repr, to_adapter_error
from .metrics import MetricsSink, PrometheusMetrics, RequestTimer, cache_config_labels

__all__ = [
    "AdapterError",
    "EngineAdapter",
    "ErrorKind",
    "build_sampling_params",
    "check_kv_capacity",
    "merge_delta",
    "short_repr",
    "to_adapter_error",
]

logger = logging.getLogger(__name__)


# -- user-facing fields -> SamplingParams ------------------------------------------------

def _scalar_types(annotation: Any) -> set[type]:
    """The plain types a field accepts (``int | None`` -> {int}; ``list[str]`` -> {list})."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        out: set[type] = set()
        for arg in typing.get_args(annotation):
            out |= _scalar_types(arg)
        return out
    if origin is not None:
        return {origin}
    return {annotation} if isinstance(annotation, type) else set()


def _coerce_string(name: str, value: str) -> Any:
    """A string that stands for another type (Triton sends every parameter as JSON text)."""
    field = SamplingParams.model_fields.get(name)
    if field is None:
        return value
    accepted = _scalar_types(field.annotation) - {type(None)}
    text = value.strip()
    if list in accepted and text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise AdapterError(f"Invalid value for '{name}': not a JSON list ({exc.msg}).", param=name) from exc
    if str in accepted or list in accepted:
        return value
    if bool in accepted:
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise AdapterError(f"Invalid value for '{name}': expected a boolean, got {value!r}.", param=name)
    try:
        if int in accepted:
            as_float = float(text)
            if not as_float.is_integer():
                raise ValueError
            return int(as_float)
        if float in accepted:
            return float(text)
    except ValueError as exc:
        kind = "an integer" if int in accepted else "a number"
        raise AdapterError(f"Invalid value for '{name}': expected {kind}, got {value!r}.", param=name) from exc
    return value


def build_sampling_params(fields: Mapping[str, Any], *, field_names: Mapping[str, str] | None = None,
                          coerce_strings: bool = False) -> SamplingParams:
    """The one place user-facing request fields become ``SamplingParams``.

    Keys are SamplingParams' (vLLM's) field names; unknown keys and bad values raise
    ``AdapterError`` naming the field as the user called it (``field_names``).
    ``coerce_strings`` converts string values to the field's type ("0.5" -> 0.5).
    """
    values = dict(fields)
    if "output_kind" in values:  # the adapters stream deltas and merge them themselves
        name = (field_names or {}).get("output_kind", "output_kind")
        raise AdapterError(f"{name} cannot be set through an adapter (outputs are streamed as deltas)", param=name)
    if coerce_strings:
        values = {k: _coerce_string(k, v) if isinstance(v, str) else v for k, v in values.items()}
    try:
        return SamplingParams(**values)
    except pydantic.ValidationError as exc:
        raise to_adapter_error(exc, field_names) from None


# -- the engine behind the adapters ------------------------------------------------------

def check_kv_capacity(kv_tokens: int, max_model_len: int) -> None:
    """A server must hold one request of ``max_model_len`` tokens, or refuse to start (as vLLM does)."""
    if kv_tokens < max_model_len:
        raise ValueError(
            f"The KV cache holds {kv_tokens} tokens, fewer than max_model_len ({max_model_len}): a request of "
            f"the model's full length could never run. Lower --max-model-len (max_model_len) to at most "
            f"{kv_tokens}, or give the cache more room (--gpu-memory-utilization, kv_cache_memory_bytes, "
            "num_gpu_blocks_override).")


class EngineAdapter:
    """Lifecycle, generation, metrics and introspection of one engine, for any framework."""

    def __init__(self, config: EngineConfig | Mapping[str, Any] | None = None, *,
                 metrics: MetricsSink | Literal["prometheus"] | None = "prometheus") -> None:
        try:
            self.config = config if isinstance(config, EngineConfig) else EngineConfig(**dict(config or {}))
        except pydantic.ValidationError as exc:
            raise to_adapter_error(exc) from None
        self.prometheus: PrometheusMetrics | None = None
        if metrics == "prometheus":
            self.prometheus = PrometheusMetrics(self.served_model_name, self.stats, step_tokens=self.take_step_tokens,
                                                cache_info=self.cache_config_info)
            metrics = self.prometheus
        self.sink: MetricsSink | None = metrics
        self._engine: Any = None
        self._load_error: BaseException | None = None
        self._loaded = threading.Event()
        self._cond = threading.Condition()
        self._inflight = 0
        self._draining = False
        self._loader: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def served_model_name(self) -> str:
        return self.config.name

    def start(self, *, background: bool = False) -> None:
        """Load the model and start the engine loop; ``background`` returns at once."""
        if self._loader is not None or self._loaded.is_set():
            return
        if background:
            self._loader = threading.Thread(target=self._load, name="paged-backend-loader", daemon=True)
            self._loader.start()
            return
        self._load()
        if self._load_error is not None:
            raise self._load_error

    def _load(self) -> None:
        if self.config.engine_core_process or self.config.engine_core_shared:  # the engine steps in a process of its own
            from paged_backend.engine.core_client import EngineCoreClient as engine_class
        else:
            from paged_backend.engine.async_engine import AsyncEngine as engine_class

        try:
            engine = engine_class(self.config)
            try:
                info = engine.model_info()
                check_kv_capacity(info["kv_capacity_tokens"], info["max_model_len"])
            except ValueError:
                engine.shutdown()
                raise
            self._engine = engine
            logger.info("engine ready: %s", self._engine.model_info())
        except BaseException as exc:  # reported through is_ready / wait_ready, never lost
            logger.exception("engine failed to start")
            self._load_error = exc
        finally:
            self._loaded.set()

    @property
    def is_ready(self) -> bool:
        return self._engine is not None and self._engine.is_ready and not self._draining

    @property
    def is_alive(self) -> bool:
        """False once the model failed to load or the engine loop died: the process should be replaced."""
        return self._load_error is None and not (self._engine is not None and self._engine.is_dead)

    @property
    def failure(self) -> str | None:
        """Why this engine cannot serve (a failed load or a dead engine loop), or None."""
        if self._load_error is not None:
            return f"the model failed to load: {self._load_error!r}"
        if self._engine is not None and self._engine.is_dead:
            return self._engine.dead_reason
        return None

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def load_error(self) -> BaseException | None:
        return self._load_error

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loaded; re-raises a load failure; False on timeout."""
        if not self._loaded.wait(timeout):
            return False
        if self._load_error is not None:
            raise self._load_error
        return self.is_ready

    def begin_drain(self) -> None:
        """Refuse new requests from now on (503); in-flight ones go on."""
        with self._cond:
            self._draining = True

    def drain(self, timeout: float = 30.0) -> bool:
        """Refuse new requests and wait up to ``timeout`` for in-flight ones; those still running
        then are aborted (finish_reason "abort", blocks freed). True if all finished in time."""
        with self._cond:
            self._draining = True
            if self._cond.wait_for(lambda: self._inflight == 0, timeout):
                return True
        if self._engine is not None:
            n = self._engine.abort_all()
            logger.warning("drain timeout (%.1fs): aborted %d request(s) still running", timeout, n)
            with self._cond:
                self._cond.wait_for(lambda: self._inflight == 0, 5.0)
        return False

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Optionally drain, then stop the engine loop (pending requests end with an error)."""
        if drain_timeout > 0:
            self.drain(drain_timeout)
        self._draining = True
        if self._loader is not None:
            self._loader.join()
        if self._engine is not None:
            self._engine.shutdown()

    # -- requests ----------------------------------------------------------------------

    def _require_engine(self) -> Any:
        if self._draining:
            raise AdapterError("The server is shutting down.", kind="unavailable")
        if self._load_error is not None:
            raise AdapterError(f"The model failed to load: {self._load_error!r}", kind="unavailable")
        if self._engine is not None and self._engine.is_dead:
            raise AdapterError("The engine has stopped after an internal error; this server must be restarted.",
                               kind="unavailable")
        if self._engine is None or not self._engine.is_ready:
            raise AdapterError("The model is still loading; retry shortly.", kind="unavailable")
        return self._engine

    @property
    def tokenizer(self) -> Any:
        return self._require_engine().tokenizer

    def check_text_size(self, num_bytes: int, param: str = "prompt") -> None:
        """AdapterError (400) when a text of this many UTF-8 bytes cannot fit the context."""
        try:
            self._require_engine().check_text_size(num_bytes, param)
        except InvalidRequestError as exc:
            raise to_adapter_error(exc) from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation through the model's own chat template.

        The messages' text is size-checked before the template runs (a conversation longer
        than the context is refused untokenized)."""
        tok = self.tokenizer
        self.check_text_size(sum(len(str(v).encode("utf-8", "surrogatepass")) for m in messages for v in m.values()),
                             "messages")
        try:
            text = tok.apply_chat_template([dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **dict(chat_template_kwargs or {}))
        except Exception as exc:  # jinja errors from the template (roles, missing fields ...)
            raise AdapterError(f"Cannot apply the chat template: {exc}", param="messages") from exc
        return tok.encode(text, add_special_tokens=False)

    async def encode_chat_async(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """``encode_chat`` on the engine's input threads: the caller's event loop keeps serving."""
        return await self._require_engine().run_blocking(self.encode_chat, messages, **kwargs)

    async def generate(self, prompt: str | list[int], params: SamplingParams, *,
                       request_id: str | None = None, cache_salt: str | None = None,
                       field_names: Mapping[str, str] | None = None) -> AsyncIterator[RequestOutput]:
        """Deltas of one request; ``AdapterError`` before the first if it is refused.

        ``cache_salt`` keeps the request's prefix-cache blocks apart from those of requests
        with another salt (or none). Leaving the loop early (break, cancellation, client
        gone) aborts the request and frees its blocks.
        """
        engine = self._require_engine()
        rid = request_id or uuid.uuid4().hex
        timer = RequestTimer(self.sink, n=params.n, max_tokens=params.max_tokens)
        with self._cond:
            self._inflight += 1
        if params.use_beam_search:  # one finished output, after the search
            stream = engine.beam_search(rid, prompt, params, cache_salt=cache_salt)
        else:
            stream = engine.generate(rid, prompt, params, cache_salt=cache_salt)
        settled = False  # finished, or refused before it started
        try:
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                settled = True
                return
            except (InvalidRequestError, EngineDeadError, pydantic.ValidationError, ValueError) as exc:
                settled = timer.done = True  # refused: not a served request
                raise to_adapter_error(exc, field_names) from None
            timer.on_delta(first)
            settled = first.finished
            yield first
            if settled:
                return
            async for delta in stream:
                timer.on_delta(delta)
                settled = delta.finished
                yield delta
                if settled:
                    return
        except EngineDeadError as exc:
            settled = True
            raise to_adapter_error(exc) from None
        finally:
            if not settled:
                timer.finish("abort")
            try:
                await stream.aclose()
                if not settled:
                    await engine.abort(rid)  # blocks are back in the pool before we return
            finally:
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()

    async def complete(self, prompt: str | list[int], params: SamplingParams, *,
                       request_id: str | None = None, cache_salt: str | None = None,
                       field_names: Mapping[str, str] | None = None) -> RequestOutput:
        """The whole output of one request (deltas merged)."""
        acc: RequestOutput | None = None
        async for delta in self.generate(prompt, params, request_id=request_id, cache_salt=cache_salt,
                                         field_names=field_names):
            acc = merge_delta(acc, delta)
        if acc is None:
            raise AdapterError("The engine returned no output.", kind="internal")
        return acc

    def has_requests(self, request_ids: Sequence[str]) -> bool:
        """Whether any of these engine request ids is still in flight."""
        return self._engine is not None and any(self._engine.has_request(r) for r in request_ids)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks are free when this returns."""
        if self._engine is not None:
            await self._engine.abort(request_id)

    # -- introspection -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return dict(self._engine.stats()) if self._engine is not None else {}

    def take_step_tokens(self) -> list[int]:
        """Tokens of each engine step since the last call (``vllm:iteration_tokens_total``)."""
        return self._engine.take_step_tokens() if self._engine is not None else []

    def cache_config_info(self) -> dict[str, str] | None:
        """Labels of ``vllm:cache_config_info`` once the engine is loaded, else None."""
        if self._engine is None:
            return None
        return cache_config_labels(self._engine.model_info(), self.config)

    def model_info(self, *, with_path: bool = True) -> dict[str, Any]:
        """Model facts; ``with_path=False`` leaves out where the model lives on disk."""
        info = dict(self._engine.model_info()) if self._engine is not None else {}
        info["served_model_name"] = self.served_model_name
        if not with_path:
            info.pop("model_dir", None)
        return info

    def metrics_text(self) -> str:
        """Prometheus exposition of the engine metrics (vLLM names); empty without prometheus."""
        return self.prometheus.render() if self.prometheus is not None else ""
