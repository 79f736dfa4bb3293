"""The built-in autoscaler as the operator runs it (docs/autoscaling.md, "The
operator's contract"): on a due pass, scrape the serving pods, summarise each
role's window, call `autoscaler.decide`, and keep what the status, the Events
and the metrics report. Its counts enter the pass through
`ClusterController.recommended`; from there a scale-down is like any other
(roles.decide_count, then reconcile.plan_pods: drain, unlink, delete).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from disagg.operator.autoscaler import HOLD_MISSING, HOLD_STALE, AutoscalerState, Decision, RoleInput, decide
from disagg.operator.pod_metrics import MetricsWindow, scrape
from disagg.operator.reconcile import PodView
from disagg.operator.scaling import ROLES, AutoscalerSpec, RatioBand, Role

METRICS_HOLDS = (HOLD_MISSING, HOLD_STALE)
# What status.scaling.<role> holds while the autoscaler owns the role (`Scaler.role_status`).
ROLE_STATUS_KEYS = ("outcome", "hold", "reason", "lastScaleTime")


@dataclass(frozen=True)
class MetricsCondition:
    """The MetricsAvailable condition: whether every role's decision had fresh metrics."""

    ok: bool
    reason: str
    message: str


@dataclass
class Scaler:
    """One cluster's autoscaler between passes: the metrics window, `decide`'s memory, the latest decision."""

    window_s: float
    interval_s: float
    window: MetricsWindow = field(init=False)
    state: AutoscalerState = field(default_factory=AutoscalerState)
    last_run: float | None = None
    decision: Decision | None = None
    latency_p90_s: dict[Role, float | None] = field(default_factory=dict)  # what the latest decision read
    last_scale_time: dict[str, str] = field(default_factory=dict)  # per role, RFC 3339, for the status

    def __post_init__(self) -> None:
        self.window = MetricsWindow(self.window_s)

    def due(self, now: float) -> bool:
        return self.last_run is None or now - self.last_run >= self.interval_s

    async def run(self, http: httpx.AsyncClient, spec: AutoscalerSpec, band: RatioBand | None,
                  views: Sequence[PodView], replicas: Mapping[str, int], rollouts: Mapping[str, bool],
                  now: float) -> Decision:
        """Scrape the pods that serve (ready and linked), then decide both roles' counts."""
        serving = [v for v in views if v.serving and v.is_active and v.ip]
        samples = await asyncio.gather(*(scrape(http, v.ip) for v in serving))
        for view, sample in zip(serving, samples):
            if sample is not None:
                self.window.add(view.name, sample)
        self.window.keep(v.name for v in serving)
        names = {role: [v.name for v in serving if v.role == role] for role in ROLES}
        inputs = {role: RoleInput(replicas[role], self.window.role_metrics(role, names[role], names["prefill"]),
                                  rollouts[role]) for role in ROLES}
        self.latency_p90_s = {role: None if i.metrics is None else
                              i.metrics.ttft_p90_s if role == "prefill" else i.metrics.tpot_p90_s
                              for role, i in inputs.items()}
        self.decision = decide(spec, band, inputs, self.state, now)
        self.state, self.last_run = self.decision.state, now
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.last_scale_time.update({role: stamp for role, d in self.decision.roles.items() if d.acted})
        return self.decision

    def role_status(self, role: str) -> dict[str, object]:
        """What status.scaling.<role> adds while the autoscaler owns the role."""
        assert self.decision is not None, "the status is written after a decision"
        (d,) = (d for r, d in self.decision.roles.items() if r == role)
        return dict(zip(ROLE_STATUS_KEYS, (d.outcome, d.hold or "", d.reason, self.last_scale_time.get(role, ""))))

    def metrics_condition(self) -> MetricsCondition:
        assert self.decision is not None, "the condition is written after a decision"
        held = {role: d.hold for role, d in self.decision.roles.items() if d.hold in METRICS_HOLDS}
        if not held:
            return MetricsCondition(True, "MetricsFresh", "every role's worker metrics are fresh")
        reason = "MetricsMissing" if HOLD_MISSING in held.values() else "MetricsStale"
        why = "; ".join(f"{role}: {self.decision.roles[role].reason}" for role in held)
        return MetricsCondition(False, reason, f"the autoscaler holds {', '.join(held)} where it is: {why}")
