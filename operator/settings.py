"""The operator's own settings: read from environment variables once, when
`disagg operator` starts, into a frozen dataclass kept in kopf's memo.

The Helm chart sets these variables; `configure` applies them to kopf. Our
finalizer and annotations live under `disagg.dev` (kopf's defaults under
kopf.zalando.org are never used).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import kopf

PREFIX = "DISAGG_OPERATOR_"
FINALIZER = "disagg.dev/finalizer"
ANNOTATION_PREFIX = "disagg.dev"
# Random peering priorities are drawn below this (kopf stores priorities as int32).
MAX_PRIORITY = 2**31 - 1

log = logging.getLogger(__name__)


def _json_object(raw: str) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _namespaces(raw: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in raw.split(",") if n.strip())


@dataclass(frozen=True)
class OperatorSettings:
    # Namespaces to watch (comma-separated) when `disagg operator` is given no
    # --namespace; empty watches all. The flags win when both are given.
    namespace: tuple[str, ...] = field(default=(), metadata={"parse": _namespaces})
    peering: str = "disagg-operator"  # the KopfPeering object shared by replicas; "" runs standalone
    # Peering priority: the replica with the highest one acts, the others
    # stand by; equal priorities pause every replica. 0 draws a random one per
    # process, so replicas of one Deployment never tie.
    priority: int = 0
    resync_s: float = 10.0  # level reconcile period (pod events reconcile at once in between)
    reassert_s: float = 60.0  # how often every link is re-sent, so restarted workers converge
    link_timeout_s: float = 5.0  # deadline of one LinkInstance/UnlinkInstance
    link_concurrency: int = 64  # link RPCs in flight at once
    # How often a running worker that has not loaded its model yet is asked
    # GET /health: it is linked within this long of loading (a prefill's
    # readiness waits for its links, so no pod event says it has loaded).
    health_poll_s: float = 0.5
    # Drain: how long a pod out of routing still takes new work (so load
    # balancers notice the readiness change first), and how often its load is read.
    drain_grace_s: float = 2.0
    metrics_poll_s: float = 0.5
    metrics_port: int = 8080  # Prometheus /metrics of the operator; 0 disables
    # The built-in autoscaler (spec.scaling.autoscaler): how often it reads the
    # workers' /metrics and decides, and the window its figures summarise.
    autoscaler_interval_s: float = 15.0
    autoscaler_window_s: float = 30.0
    api_timeout_s: float = 30.0  # every Kubernetes API request
    # Security contexts of the worker pods and containers the operator creates (JSON objects).
    worker_pod_security_context: Mapping[str, Any] = field(default_factory=dict, metadata={"parse": _json_object})
    worker_security_context: Mapping[str, Any] = field(default_factory=dict, metadata={"parse": _json_object})

    def __post_init__(self) -> None:
        for name in ("resync_s", "reassert_s", "link_timeout_s", "health_poll_s", "metrics_poll_s", "api_timeout_s",
                     "autoscaler_interval_s", "autoscaler_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{PREFIX}{name.upper()} must be positive, got {getattr(self, name)}")
        if self.autoscaler_window_s < 2 * self.autoscaler_interval_s:  # rates and latencies need two samples
            raise ValueError(f"{PREFIX}AUTOSCALER_WINDOW_S ({self.autoscaler_window_s}) must be at least twice "
                             f"{PREFIX}AUTOSCALER_INTERVAL_S ({self.autoscaler_interval_s}): latencies and rates "
                             "need two samples of each pod within the window")
        if self.drain_grace_s < 0:
            raise ValueError(f"{PREFIX}DRAIN_GRACE_S must not be negative, got {self.drain_grace_s}")
        if self.link_concurrency < 1:
            raise ValueError(f"{PREFIX}LINK_CONCURRENCY must be at least 1, got {self.link_concurrency}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"{PREFIX}METRICS_PORT must be a port number, got {self.metrics_port}")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"{PREFIX}PRIORITY must fit in 32 bits, got {self.priority}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        """The settings from `DISAGG_OPERATOR_<FIELD>` variables; ValueError names a bad one.

        Unknown `DISAGG_OPERATOR_*` variables (a typo in the chart's extraEnv)
        are logged, not fatal.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        defaults = cls()
        for f in fields(cls):
            raw = env.get(PREFIX + f.name.upper())
            if raw is None:
                continue
            parse: Callable[[str], Any] = f.metadata.get("parse") or type(getattr(defaults, f.name))
            try:
                values[f.name] = parse(raw)
            except ValueError as e:
                raise ValueError(f"{PREFIX}{f.name.upper()}={raw!r} is invalid: {e}") from None
        known = {PREFIX + f.name.upper() for f in fields(cls)}
        for name in sorted(k for k in env if k.startswith(PREFIX) and k not in known):
            log.warning("ignoring %s: not an operator setting", name)
        return cls(**values)

    def watched(self, flags: Sequence[str]) -> tuple[str, ...]:
        """The namespaces to watch: the --namespace flags if any, else ours; () is all."""
        return tuple(flags) or self.namespace

    def peering_priority(self) -> int:
        return self.priority or 1 + secrets.randbelow(MAX_PRIORITY - 1)


def configure(kopf_settings: kopf.OperatorSettings, ours: OperatorSettings, namespaces: Sequence[str],
              standalone: bool, priority: int) -> None:
    """Apply our settings to kopf (called from the startup handler)."""
    kopf_settings.persistence.finalizer = FINALIZER
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    kopf_settings.peering.standalone = standalone or not ours.peering
    if ours.peering:
        kopf_settings.peering.name = ours.peering
    # A namespaced operator peers through a KopfPeering in each watched
    # namespace, a cluster-wide one through a ClusterKopfPeering.
    kopf_settings.peering.clusterwide = not namespaces
    kopf_settings.peering.priority = priority
    kopf_settings.networking.request_timeout = ours.api_timeout_s
    kopf_settings.watching.server_timeout = 60
    kopf_settings.watching.client_timeout = 90
    # Our own Events say what matters; kopf's per-handler chatter is left at warnings.
    kopf_settings.posting.level = 30
