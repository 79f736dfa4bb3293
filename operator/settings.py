"""The operator's own settings: read from environment variables once, at startup.

The Helm chart sets these variables; `configure` applies them to kopf. Our
finalizer and annotations live under `disagg.dev` (kopf's defaults under
kopf.zalando.org are never used).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import kopf

PREFIX = "DISAGG_OPERATOR_"
FINALIZER = "disagg.dev/finalizer"
ANNOTATION_PREFIX = "disagg.dev"


@dataclass(frozen=True)
class OperatorSettings:
    namespace: str = ""  # watch only this namespace; "" watches all
    peering: str = "disagg-operator"  # the KopfPeering object shared by replicas; "" runs standalone
    resync_s: float = 10.0  # level reconcile period (pod events reconcile at once in between)
    reassert_s: float = 60.0  # how often every link is re-sent, so restarted workers converge
    link_timeout_s: float = 5.0  # deadline of one LinkInstance/UnlinkInstance
    link_concurrency: int = 64  # link RPCs in flight at once
    metrics_poll_s: float = 0.5  # drain: how often a draining worker's /metrics is read
    metrics_port: int = 8080  # Prometheus /metrics of the operator; 0 disables
    api_timeout_s: float = 30.0  # every Kubernetes API request

    def __post_init__(self) -> None:
        for name in ("resync_s", "reassert_s", "link_timeout_s", "metrics_poll_s", "api_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{PREFIX}{name.upper()} must be positive, got {getattr(self, name)}")
        if self.link_concurrency < 1:
            raise ValueError(f"{PREFIX}LINK_CONCURRENCY must be at least 1, got {self.link_concurrency}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"{PREFIX}METRICS_PORT must be a port number, got {self.metrics_port}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        """The settings from `DISAGG_OPERATOR_<FIELD>` variables; ValueError names a bad one."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        defaults = cls()
        for name in cls.__dataclass_fields__:
            raw = env.get(PREFIX + name.upper())
            if raw is None:
                continue
            kind = type(getattr(defaults, name))
            try:
                values[name] = kind(raw)
            except ValueError:
                raise ValueError(f"{PREFIX}{name.upper()}={raw!r} is not a {kind.__name__}") from None
        return cls(**values)  # type: ignore[arg-type]


def configure(kopf_settings: kopf.OperatorSettings, ours: OperatorSettings, standalone: bool) -> None:
    """Apply our settings to kopf (called from the startup handler)."""
    kopf_settings.persistence.finalizer = FINALIZER
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    kopf_settings.peering.standalone = standalone or not ours.peering
    if ours.peering:
        kopf_settings.peering.name = ours.peering
    kopf_settings.peering.clusterwide = not ours.namespace
    kopf_settings.networking.request_timeout = ours.api_timeout_s
    kopf_settings.watching.server_timeout = 60
    kopf_settings.watching.client_timeout = 90
    # Our own Events say what matters; kopf's per-handler chatter is left at warnings.
    kopf_settings.posting.level = 30
