"""docs/grafana/paged-backend.json: valid JSON, a data-source variable every panel uses, and
PromQL that queries only metrics of the vLLM-named table (a running server's page: the
``/metrics`` tests of the bentoml and Triton server modules)."""

from __future__ import annotations

import grafana_dashboard as gd
from paged_backend.adapters.metrics import METRICS


def test_metric_names_of_promql_expressions():
    expr = ('histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:e2e_request_latency_seconds_bucket'
            '{instance=~"$instance", le!="+Inf"}[$__rate_interval]))) / on (instance) group_left up')
    assert gd.metric_names(expr) == {"vllm:e2e_request_latency_seconds_bucket", "up"}
    assert gd.metric_names("sum(rate(a_total[5m])) / sum(rate(b:c_total[5m])) > bool 0") == {"a_total", "b:c_total"}
    assert gd.metric_names("label_values(vllm:num_requests_running, instance)") == {"vllm:num_requests_running"}
    assert gd.family_of("x_bucket") == "x" and gd.family_of("x_total") == "x" and gd.family_of("x") == "x"


def test_dashboard_panels_use_the_datasource_variable():
    dash = gd.load()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert dash["panels"] and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"], panel["title"]


def test_dashboard_queries_what_the_metrics_table_exports():
    dash = gd.load()
    names = set().union(*(gd.metric_names(e) for e in gd.expressions(dash)))
    families = {gd.family_of(n) for n in names}
    specs = {m.name: m for m in METRICS}
    assert families <= set(specs), families - set(specs)
    for name in names:  # counters as <name>_total, histograms by their series
        kind = specs[gd.family_of(name)].kind
        assert (kind == "counter") == name.endswith("_total"), name
        assert (kind == "histogram") == name.endswith(("_bucket", "_sum", "_count")), name
    # the panels the dashboard promises
    for family in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:prompt_tokens",
                   "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                   "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:num_preemptions"):
        assert family in families, family
    exprs = list(gd.expressions(dash))
    assert any("histogram_quantile(0.99" in e and "time_to_first_token" in e for e in exprs)
    assert any("rate(vllm:generation_tokens_total" in e for e in exprs)
