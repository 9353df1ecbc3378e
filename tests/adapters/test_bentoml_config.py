"""The BentoML service configuration the bentos get from ``service_config`` (no server started)."""

from __future__ import annotations

import pytest
from paged_backend.adapters.bentoml_service import STREAMING_URLS, ServeArgs, service_config

pytest.importorskip("opentelemetry.util.http")


def _excluded(config: dict) -> object:
    from opentelemetry.util.http import ExcludeList

    return ExcludeList(config.get("tracing", {}).get("excluded_urls", []))


def test_streaming_endpoints_are_left_out_of_tracing_by_default():
    # BentoML's OpenTelemetry middleware matches these patterns against the full request URL
    excluded = _excluded(service_config(ServeArgs(device="cpu")))
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        assert excluded.url_disabled(f"http://127.0.0.1:3000{path}"), path
    for path in ("/v1/models", "/stats", "/metrics", "/readyz", "/v1/completions/x", "/generate_x"):
        assert not excluded.url_disabled(f"http://127.0.0.1:3000{path}"), path


def test_trace_streams_keeps_bentoml_tracing_everywhere():
    config = service_config(ServeArgs(device="cpu", trace_streams=True))
    assert "tracing" not in config
    assert not _excluded(config).url_disabled("http://127.0.0.1:3000/v1/completions")


def test_service_config_is_valid_bentoml_config():
    from _bentoml_sdk.service.config import validate

    config = service_config(ServeArgs(device="cpu"))
    valid = validate({k: v for k, v in config.items() if k not in ("name", "labels", "envs")})
    assert list(valid["tracing"]["excluded_urls"]) == list(STREAMING_URLS)
