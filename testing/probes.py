"""Readiness probes (httpGet, tcpSocket, exec) with the kubelet's timing and thresholds."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from disagg.testing.podenv import Obj, PodConfigError, container_port


@dataclass(frozen=True)
class Probe:
    """One probe's target and timing, resolved against its pod."""

    kind: str  # "http" | "tcp" | "exec"
    host: str = ""
    port: int = 0
    path: str = "/"
    https: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] = ()
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    def run(self, env: Mapping[str, str], cwd: str) -> bool:
        """One attempt: True on success (HTTP 200-399, a TCP connect, exit code 0)."""
        try:
            if self.kind == "http":
                return self._http()
            if self.kind == "tcp":
                with socket.create_connection((self.host, self.port), timeout=self.timeout_s):
                    return True
            done = subprocess.run(
                list(self.command), env=dict(env), cwd=cwd, timeout=self.timeout_s,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
            )
            return done.returncode == 0
        except (OSError, http.client.HTTPException, subprocess.TimeoutExpired):
            return False

    def _http(self) -> bool:
        conn: http.client.HTTPConnection
        if self.https:
            # The kubelet does not verify a probe's certificate either.
            conn = http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout_s, context=ssl._create_unverified_context()
            )
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("GET", self.path, headers=dict(self.headers))
            status = conn.getresponse().status
        finally:
            conn.close()
        return 200 <= status < 400


def parse_probe(probe: Obj, container: Obj, pod_ip: str) -> Probe:
    """Resolve `probe` (the API's defaults applied) for a container serving on `pod_ip`."""
    # The timing every kind shares; `kind` is settled below.
    base = Probe(
        kind="exec",
        initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
        period_s=float(probe.get("periodSeconds", 10)),
        timeout_s=float(probe.get("timeoutSeconds", 1)),
        success_threshold=int(probe.get("successThreshold", 1)),
        failure_threshold=int(probe.get("failureThreshold", 3)),
    )
    if "httpGet" in probe:
        g = probe["httpGet"]
        return replace(
            base,
            kind="http",
            host=g.get("host") or pod_ip,
            port=container_port(container, g["port"]),
            path=g.get("path", "/"),
            https=g.get("scheme", "HTTP").upper() == "HTTPS",
            headers=tuple((h["name"], h["value"]) for h in g.get("httpHeaders", [])),
        )
    if "tcpSocket" in probe:
        t = probe["tcpSocket"]
        return replace(base, kind="tcp", host=t.get("host") or pod_ip, port=container_port(container, t["port"]))
    if probe.get("exec", {}).get("command"):
        return replace(base, command=tuple(probe["exec"]["command"]))
    raise PodConfigError("readinessProbe has no httpGet, tcpSocket or exec (grpc probes are not supported)")


@dataclass
class ProbeTracker:
    """Consecutive results against the thresholds, and when the next attempt is due."""

    probe: Probe
    started_at: float  # monotonic time the container started
    ready: bool = False
    successes: int = 0
    failures: int = 0
    next_due: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.next_due = self.started_at + self.probe.initial_delay_s

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def record(self, ok: bool, now: float) -> bool:
        """Count one result; returns whether readiness changed."""
        self.next_due = now + self.probe.period_s
        before = self.ready
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.probe.success_threshold:
                self.ready = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.probe.failure_threshold:
                self.ready = False
        return self.ready != before
