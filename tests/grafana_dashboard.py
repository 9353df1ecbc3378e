"""The Grafana dashboard in docs/grafana: its PromQL expressions, the metric names they query,
and a check of those names against a server's ``/metrics`` page."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "paged-backend.json"

_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")  # not a call, not a number's part
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}
SERIES_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression: the panels' targets and the query variables'."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            yield query["query"] if isinstance(query, dict) else query


def metric_names(expr: str) -> set[str]:
    """The series names ``expr`` selects: identifiers left after label matchers (``{...}``), range
    windows (``[...]``), strings, grouping clauses and function calls are taken out."""
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = _STRING.sub(" ", expr)
    expr = _GROUPING.sub(" ", expr)
    expr = re.sub(r"\blabel_values\s*\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)", r" \1 ", expr)
    return {m for m in _IDENT.findall(expr) if m.lower() not in _KEYWORDS}


def exported(metrics_text: str) -> tuple[set[str], set[str]]:
    """(family names, sample names) of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    families, samples = set(), set()
    for family in text_string_to_metric_families(metrics_text):
        families.add(family.name)
        samples.update(s.name for s in family.samples)
    return families, samples


def family_of(series: str) -> str:
    """``x_bucket`` / ``x_sum`` / ``x_count`` / ``x_total`` -> ``x`` (other names stay)."""
    for suffix in SERIES_SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def missing_from(metrics_text: str, dashboard: dict[str, Any] | None = None) -> dict[str, str]:
    """The dashboard's series that ``metrics_text`` does not export, each with why."""
    families, samples = exported(metrics_text)
    wanted = set().union(*(metric_names(e) for e in expressions(dashboard or load())))
    out = {}
    for name in sorted(wanted):
        if family_of(name) not in families and name not in families:
            out[name] = f"no family {family_of(name)}"
        elif name not in samples and name not in families:
            out[name] = "the family is there, this series is not"
    return out
