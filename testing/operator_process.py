"""`disagg operator` as its own process against the local control plane, for the e2e tests:
standalone, from a kubeconfig, with short periods, its /metrics readable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from disagg.workers.local import free_port

ROOT = Path(__file__).resolve().parents[1]
STOP_S = 20.0


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of `name`'s samples whose labels include `labels`, in a Prometheus text page."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


class OperatorProcess:
    """`disagg operator` as its own process, standalone, from the admin kubeconfig; restartable."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.kubeconfig, self.log = kubeconfig, log
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None, "the operator is already running"
        env = {**os.environ, "DISAGG_OPERATOR_METRICS_PORT": str(self.metrics_port),
               "DISAGG_OPERATOR_RESYNC_S": "2", "DISAGG_OPERATOR_LINK_TIMEOUT_S": "3",
               "DISAGG_OPERATOR_DRAIN_GRACE_S": "2", "DISAGG_OPERATOR_METRICS_POLL_S": "0.2",
               "DISAGG_OPERATOR_AUTOSCALER_INTERVAL_S": "1", "DISAGG_OPERATOR_AUTOSCALER_WINDOW_S": "5"}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "disagg.operator.main", "--standalone", "--liveness-port", "0",
                 "--kubeconfig", str(self.kubeconfig)],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def stop(self) -> None:
        assert self.proc is not None, "the operator is not running"
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=STOP_S)
        self.proc = None

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the operator's /metrics (0 when absent)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return sample(text, name, labels)
