"""The operator's Prometheus metrics (prefix `disagg_operator_`), in a registry of their own."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from disagg.operator.links import LinkResult
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

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Expose /metrics on `port` in a background thread; once (a retried startup calls it again)."""
        if self.port is not None:
            assert self.port == port, f"metrics already served on port {self.port}, not {port}"
            return
        start_http_server(port, addr=host, registry=self.registry)
        self.port = port
