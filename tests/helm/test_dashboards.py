"""The chart's Grafana dashboards: off by default, in a ConfigMap with the sidecar
label when on, and every panel's query is PromQL naming only metrics that the
workers and the operator really export (read from their registries)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import promql_parser
import pytest
from prometheus_client import CollectorRegistry

from disagg.operator.metrics import OperatorMetrics
from disagg.workers.metrics import WorkerMetrics

if TYPE_CHECKING:
    from conftest import Helm

# Grafana's own variables, replaced as Grafana would before the query is sent.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m"}
# What each metric type adds to a family's name in the exposition.
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created"), "info": ("_info",)}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry can expose, labelled children or not."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES.get(family.type, ("",))}


def metric_names(node: Any) -> set[str]:
    """Metric names a parsed PromQL expression selects."""
    if isinstance(node, promql_parser.VectorSelector):
        return {node.name} if node.name else set()
    if isinstance(node, promql_parser.MatrixSelector):
        return metric_names(node.vector_selector)
    if isinstance(node, promql_parser.BinaryExpr):
        return metric_names(node.lhs) | metric_names(node.rhs)
    if isinstance(node, promql_parser.AggregateExpr):
        return metric_names(node.expr) | (metric_names(node.param) if node.param is not None else set())
    if isinstance(node, promql_parser.Call):
        return set().union(*(metric_names(a) for a in node.args))
    if isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        return metric_names(node.expr)
    return set()  # literals


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, query) of every panel, rows' nested panels included."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found += [(inner["title"], t["expr"]) for t in inner.get("targets", [])]
    return found


@pytest.fixture(scope="module")
def dashboards(helm: Helm) -> dict[str, dict[str, Any]]:
    configmap = helm.template("--set", "metrics.grafanaDashboards.enabled=true").one("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    return {name: json.loads(text) for name, text in configmap["data"].items()}


def test_dashboards_are_off_by_default(helm: Helm) -> None:
    assert helm.template().find("ConfigMap") == []


def test_dashboards_go_to_the_namespace_given(helm: Helm) -> None:
    configmap = helm.template("--set", "metrics.grafanaDashboards.enabled=true",
                              "--set", "metrics.grafanaDashboards.namespace=monitoring").one("ConfigMap")
    assert configmap["metadata"]["namespace"] == "monitoring"


def test_every_panel_query_parses_and_names_only_exported_metrics(dashboards: dict[str, dict[str, Any]]) -> None:
    exported = exported_names(WorkerMetrics("prefill").registry) | exported_names(OperatorMetrics().registry)
    assert "disagg_kv_blocks_free" in exported and "disagg_operator_links" in exported
    for file, dashboard in dashboards.items():
        queries = panel_queries(dashboard)
        assert len(queries) >= 15, f"{file}: only {len(queries)} queries"
        for title, query in queries:
            for variable, value in GRAFANA_VARIABLES.items():
                query = query.replace(variable, value)
            names = metric_names(promql_parser.parse(query))  # raises on anything but PromQL
            assert names, f"{file} / {title}: selects no metric: {query}"
            assert names <= exported, f"{file} / {title}: not exported: {sorted(names - exported)}"


def test_the_dashboard_covers_what_the_chart_promises(dashboards: dict[str, dict[str, Any]]) -> None:
    used = {name for d in dashboards.values() for _, q in panel_queries(d)
            for name in metric_names(promql_parser.parse(q.replace("$__rate_interval", "5m")))}
    for needed in ("disagg_time_to_first_token_seconds_bucket", "disagg_time_per_output_token_seconds_bucket",
                   "disagg_generation_tokens_total", "disagg_kv_transfer_bytes_total", "disagg_kv_blocks_free",
                   "disagg_links", "disagg_operator_reconcile_duration_seconds_bucket",
                   "disagg_operator_link_operation_duration_seconds_bucket", "disagg_operator_autoscaler_decisions_total"):
        assert needed in used, needed
