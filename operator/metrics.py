"""The operator's Prometheus metrics (prefix `disagg_operator_`), in a registry of their own."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from disagg.operator.autoscaler import Decision
from disagg.operator.links import LinkResult
from disagg.operator.scaling import Role
from disagg.operator.snapshot import ClusterSnapshot


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.port: int | None = None  # where /metrics is served, once it is
        p = "disagg_operator_"
        self.reconcile_seconds = Histogram(p + "reconcile_duration_seconds", "One reconcile pass.", ["handler"],
                                           registry=r)
        self.reconcile_errors = Counter(p + "reconcile_errors_total", "Reconcile passes that failed.", ["handler"],
                                        registry=r)
        self.link_ops = Counter(p + "link_operations_total", "LinkInstance/UnlinkInstance RPCs.",
                                ["operation", "result"], registry=r)
        self.link_seconds = Histogram(p + "link_operation_duration_seconds", "One link RPC.",
                                      ["operation", "result"], registry=r)
        self.links = Gauge(p + "links", "Links per state (established, pending, failed, mismatched).",
                           ["namespace", "cluster", "state"], registry=r)
        self.pods = Gauge(p + "pods", "Worker pods per role and state (the status's counts, terminating and total).",
                          ["namespace", "cluster", "role", "state"], registry=r)
        self.drain_seconds = Histogram(p + "drain_duration_seconds", "From drain start to pod deletion.",
                                       buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600), registry=r)
        self.drain_timeouts = Counter(p + "drain_timeouts_total", "Drains cut short by the drain timeout.",
                                      registry=r)
        cluster_role = ["namespace", "cluster", "role"]
        self.band_adjustment = Gauge(p + "ratio_band_adjustment_replicas",
                                     "Pods the P:D ratio band added (+) or removed (-) from the role's owner's count "
                                     "on the latest pass.", cluster_role, registry=r)
        self.band_satisfiable = Gauge(p + "ratio_band_satisfiable",
                                      "1 when counts within the limits fit the P:D ratio band, 0 when none do.",
                                      ["namespace", "cluster"], registry=r)
        self.autoscaler_desired = Gauge(p + "autoscaler_desired_replicas",
                                        "The built-in autoscaler's count for the role, before the ratio band.",
                                        cluster_role, registry=r)
        self.autoscaler_decisions = Counter(p + "autoscaler_decisions_total",
                                            "The built-in autoscaler's decisions per role, by outcome and hold reason "
                                            "(none when the role moved).", [*cluster_role, "outcome", "hold"],
                                            registry=r)
        self.autoscaler_latency = Gauge(p + "autoscaler_latency_p90_seconds",
                                        "The p90 the autoscaler read over its window: TTFT for prefill, TPOT for "
                                        "decode; NaN with no sample.", cluster_role, registry=r)
        # The series labelled by cluster: `forget` drops a deleted cluster's.
        self._per_cluster = (self.links, self.pods, self.band_adjustment, self.band_satisfiable,
                             self.autoscaler_desired, self.autoscaler_decisions, self.autoscaler_latency)

    def observe_links(self, results: Iterable[LinkResult]) -> None:
        for res in results:
            result = "success" if res.ok else "error"
            self.link_ops.labels(res.op.verb, result).inc()
            self.link_seconds.labels(res.op.verb, result).observe(res.seconds)

    def export(self, namespace: str, cluster: str, snap: ClusterSnapshot) -> None:
        """A pass's counts as the gauges: the same numbers the status shows."""
        links = snap.links
        for state, n in (("established", links.established), ("failed", links.failed), ("pending", links.pending),
                         ("mismatched", len(links.mismatches))):
            self.links.labels(namespace, cluster, state).set(n)
        for role, counts in snap.roles.items():
            for state, n in asdict(counts).items():
                self.pods.labels(namespace, cluster, role, state).set(n)

    def export_band(self, namespace: str, cluster: str, adjustment: Mapping[str, int], satisfiable: bool) -> None:
        for role, delta in adjustment.items():
            self.band_adjustment.labels(namespace, cluster, role).set(delta)
        self.band_satisfiable.labels(namespace, cluster).set(1 if satisfiable else 0)

    def export_autoscaler(self, namespace: str, cluster: str, decision: Decision,
                          latency_p90_s: Mapping[Role, float | None]) -> None:
        for role, d in decision.roles.items():
            self.autoscaler_desired.labels(namespace, cluster, role).set(d.desired)
            self.autoscaler_decisions.labels(namespace, cluster, role, d.outcome, d.hold or "none").inc()
        for role, latency in latency_p90_s.items():
            self.autoscaler_latency.labels(namespace, cluster, role).set(math.nan if latency is None else latency)

    def forget(self, namespace: str, cluster: str) -> None:
        """Drop the series of a cluster that is gone: dashboards would show it at its last values."""
        for metric in self._per_cluster:
            names = metric._labelnames  # prometheus_client lists a metric's children by no public API
            for family in metric.collect():
                found = {tuple(s.labels[n] for n in names) for s in family.samples
                         if s.labels.get("namespace") == namespace and s.labels.get("cluster") == cluster}
                for labels in found:
                    metric.remove(*labels)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Expose /metrics on `port` in a background thread; once (a retried startup calls it again)."""
        if self.port is not None:
            assert self.port == port, f"metrics already served on port {self.port}, not {port}"
            return
        start_http_server(port, addr=host, registry=self.registry)
        self.port = port
