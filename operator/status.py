"""The `DisaggCluster` status, computed from a pass's ClusterSnapshot.

Written explicitly by the reconcile (never from handler return values), and
only when it changes. Condition reasons are CamelCase, messages say what is
wrong and what to look at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg.operator import manifests as m
from disagg.operator.scaler import ROLE_STATUS_KEYS, Scaler
from disagg.operator.snapshot import ClusterSnapshot
from disagg.operator.spec import AUTOSCALER, ROLES, ClusterSpec

CONDITIONS = ("Available", "Progressing", "Degraded", "LinksReady")
METRICS_AVAILABLE = "MetricsAvailable"  # only while the built-in autoscaler runs
SPEC_VALID = "SpecValid"  # only while the spec is invalid in a way the schema cannot refuse


def invalid_spec_status(previous: Mapping[str, Any], generation: int, message: str, now: str) -> dict[str, Any]:
    """The status while the spec cannot be acted on: the last pass's conditions, and SpecValid False
    with the reason (a valid spec's next pass writes the conditions without it)."""
    kept = [c for c in previous.get("conditions") or [] if c.get("type") != SPEC_VALID]
    old: Mapping[str, Any] = next((c for c in previous.get("conditions") or [] if c.get("type") == SPEC_VALID), {})
    since = old.get("lastTransitionTime") if old.get("status") == "False" else None
    return {"observedGeneration": generation, "conditions": [*kept, {
        "type": SPEC_VALID, "status": "False", "reason": "InvalidSpec", "message": message,
        "lastTransitionTime": since or now, "observedGeneration": generation}]}


@dataclass(frozen=True)
class Condition:
    type: str
    ok: bool
    reason: str
    message: str


def _first(items: Sequence[str]) -> str:
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def available(snap: ClusterSnapshot) -> Condition:
    """Requests can be served: a prefill ready and a decode linked."""
    pre, dec = snap.roles["prefill"], snap.roles["decode"]
    if pre.ready and dec.linked:
        return Condition("Available", True, "Serving",
                         f"{pre.ready} prefill and {dec.linked} decode pods serve requests")
    if not pre.ready:
        return Condition("Available", False, "NoReadyPrefill",
                         "no prefill pod is ready and linked; see the LinksReady condition and pod events")
    return Condition("Available", False, "NoLinkedDecode", "no decode pod is linked to a prefill")


def progressing(spec: ClusterSpec, snap: ClusterSnapshot) -> Condition:
    """Still on its way to the spec: the first of rolling, scaling, draining, linking, waiting for readiness."""
    roles, links = snap.roles, snap.links
    rolling = [f"{r} {roles[r].updated}/{spec.role(r).replicas}" for r in ROLES if roles[r].updated < roles[r].replicas]
    scaling = [f"{r} {roles[r].replicas}/{spec.role(r).replicas}" for r in ROLES
               if roles[r].replicas != spec.role(r).replicas]
    unready = [r for r in ROLES if roles[r].ready < roles[r].replicas]
    draining = sum(roles[r].draining for r in ROLES)
    if rolling:
        return Condition("Progressing", True, "RollingUpdate",
                         "pods of the current pod template per role: " + ", ".join(rolling))
    if scaling:
        return Condition("Progressing", True, "Scaling", "pods per role: " + ", ".join(scaling))
    if draining:
        return Condition("Progressing", True, "Draining", f"{draining} pods finish their requests before deletion")
    if links.established < links.desired:
        return Condition("Progressing", True, "Linking", f"{links.established} of {links.desired} links made")
    if unready:
        return Condition("Progressing", True, "PodsNotReady", "waiting for " + ", ".join(unready) + " pods")
    return Condition("Progressing", False, "Converged", "every pod is running and linked")


def degraded(snap: ClusterSnapshot) -> Condition:
    """Something is wrong that waiting does not fix by itself: layouts differ, links fail, workers crash."""
    links = snap.links
    if links.mismatches:
        return Condition("Degraded", True, "LayoutMismatch",
                         "KV layouts differ, so these pods are never linked: " + _first(links.mismatches)
                         + "; scale the old pods down or make model, dtype and block size agree")
    if links.failures:
        return Condition("Degraded", True, "LinkFailed",
                         _first(links.failures) + "; check the decode worker's log and its transfer port")
    if snap.crashing:
        return Condition("Degraded", True, "WorkerCrashing", "worker containers restarted and are not running: "
                         + _first(snap.crashing) + "; see `kubectl logs --previous`")
    return Condition("Degraded", False, "AsExpected", "no failures")


def links_ready(snap: ClusterSnapshot) -> Condition:
    """Every link that should exist is made."""
    links = snap.links
    made = f"{links.established} of {links.desired} links made"
    if links.desired and links.established == links.desired:
        return Condition("LinksReady", True, "AllLinked", made)
    if links.mismatches and not links.desired:
        return Condition("LinksReady", False, "LayoutMismatch", "no two linkable pods share a KV layout")
    if links.failed:
        return Condition("LinksReady", False, "LinkFailed", f"{links.failed} links failed; retried with backoff")
    if not links.desired:
        return Condition("LinksReady", False, "NoPeers", "needs a decode and a prefill of the same KV layout, "
                         "running with their models loaded")
    return Condition("LinksReady", False, "LinksPending", made)


def conditions(spec: ClusterSpec, snap: ClusterSnapshot) -> list[Condition]:
    """In CONDITIONS' order."""
    return [available(snap), progressing(spec, snap), degraded(snap), links_ready(snap)]


def build_status(cluster: str, namespace: str, generation: int, spec: ClusterSpec, snap: ClusterSnapshot,
                 previous: Mapping[str, Any], now: str, owners: Mapping[str, str],
                 ratio: str | None = None, scaler: Scaler | None = None) -> dict[str, Any]:
    """The whole status; a condition keeps its lastTransitionTime while its status holds.
    `spec` holds the counts the roles' `owners` (roles.py) decided, after the ratio band's
    adjustment `ratio` (None: none); `scaler`, the built-in autoscaler once it has decided
    (its reasons per role, and the MetricsAvailable condition)."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    conds = []
    found = conditions(spec, snap)
    if scaler is not None and scaler.decision is not None:
        metrics = scaler.metrics_condition()
        found.append(Condition(METRICS_AVAILABLE, metrics.ok, metrics.reason, metrics.message))
    for c in found:
        status = "True" if c.ok else "False"
        old = before.get(c.type, {})
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        conds.append({"type": c.type, "status": status, "reason": c.reason, "message": c.message,
                      "lastTransitionTime": since or now, "observedGeneration": generation})
    roles, links = snap.roles, snap.links
    return {
        "observedGeneration": generation,
        "prefill": roles["prefill"].status(),
        "decode": roles["decode"].status(),
        # None deletes what the autoscaler wrote while it owned the role (the status is a merge patch).
        "scaling": {**{role: {"owner": owners[role], "desired": spec.role(role).replicas,
                              **(scaler.role_status(role) if owners[role] == AUTOSCALER and scaler is not None
                                 and scaler.decision is not None else dict.fromkeys(ROLE_STATUS_KEYS))}
                       for role in ROLES},
                    "ratio": ratio or ""},
        "links": {"desired": links.desired, "established": links.established, "failed": links.failed},
        "linksSummary": f"{links.established}/{links.desired}",
        "prefillReady": f"{roles['prefill'].ready}/{spec.prefill.replicas}",
        "decodeReady": f"{roles['decode'].ready}/{spec.decode.replicas}",
        "available": conds[0]["status"],
        "endpoint": m.endpoint(cluster, namespace, spec),
        "conditions": conds,
    }


def status_changed(new: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Whether patching `new` (a merge patch, where None deletes a key) would change `current`."""
    return any(_applied(current.get(k)) != _applied(v) for k, v in new.items())


def _applied(value: Any) -> Any:
    """What a merge patch leaves of `value`: its None-valued keys gone, at every depth."""
    if isinstance(value, Mapping):
        return {k: _applied(v) for k, v in value.items() if v is not None}
    return value
