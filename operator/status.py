"""The `DisaggCluster` status, computed from the pods and the link graph.

Written explicitly by the reconcile (never from handler return values), and
only when it changes. Condition reasons are CamelCase, messages say what is
wrong and what to look at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg.operator import manifests as m
from disagg.operator.links import LinkGraph
from disagg.operator.reconcile import LinkPlan, PodView
from disagg.operator.spec import ROLES, ClusterSpec

CONDITIONS = ("Available", "Progressing", "Degraded", "LinksReady")


@dataclass(frozen=True)
class Condition:
    type: str
    ok: bool
    reason: str
    message: str


def _role_counts(role: str, views: Sequence[PodView], graph: LinkGraph, plan: LinkPlan,
                 template: str) -> dict[str, int]:
    mine = [v for v in views if v.role == role]
    active = [v for v in mine if v.is_active]

    def linked(v: PodView) -> bool:
        peers = [pair for pair in plan.desired if v.name in pair]
        return bool(peers) and all(pair in graph.edges for pair in peers)

    return {
        "replicas": len(active),
        "updated": sum(v.template == template for v in active),
        "ready": sum(v.serving for v in active),
        "linked": sum(linked(v) for v in active),
        "draining": sum(v.is_draining and not v.is_gone for v in mine),
    }


def _first(items: Sequence[str], more: int) -> str:
    return ", ".join(items[:3]) + (f" and {more - 3} more" if more > 3 else "")


def conditions(spec: ClusterSpec, views: Sequence[PodView], graph: LinkGraph, plan: LinkPlan,
               counts: Mapping[str, Mapping[str, int]]) -> list[Condition]:
    desired = plan.desired
    established = [p for p in desired if p in graph.edges]
    failed = sorted(p for p in desired if p in graph.failures)
    failures = [f"decode {d} -> prefill {p}: {graph.failures[(d, p)].error}" for d, p in failed]
    mismatches = [f"decode {d} ({dl}) / prefill {p} ({pl})" for d, dl, p, pl in plan.mismatched]
    crashing = [v.name for v in views if v.restarts > 0 and not v.running and not v.is_gone]

    pre, dec = counts["prefill"], counts["decode"]
    if pre["ready"] and dec["linked"]:
        available = Condition("Available", True, "Serving",
                              f"{pre['ready']} prefill and {dec['linked']} decode pods serve requests")
    elif not pre["ready"]:
        available = Condition("Available", False, "NoReadyPrefill",
                              "no prefill pod is ready and linked; see the LinksReady condition and pod events")
    else:
        available = Condition("Available", False, "NoLinkedDecode", "no decode pod is linked to a prefill")

    rolling = [f"{r} {counts[r]['updated']}/{spec.role(r).replicas}" for r in ROLES
               if counts[r]["updated"] < counts[r]["replicas"]]
    scaling = [f"{r} {counts[r]['replicas']}/{spec.role(r).replicas}" for r in ROLES
               if counts[r]["replicas"] != spec.role(r).replicas]
    unready = [r for r in ROLES if counts[r]["ready"] < counts[r]["replicas"]]
    draining = sum(counts[r]["draining"] for r in ROLES)
    if rolling:
        progressing = Condition("Progressing", True, "RollingUpdate",
                                "pods of the current pod template per role: " + ", ".join(rolling))
    elif scaling:
        progressing = Condition("Progressing", True, "Scaling", "pods per role: " + ", ".join(scaling))
    elif draining:
        progressing = Condition("Progressing", True, "Draining", f"{draining} pods finish their requests before deletion")
    elif len(established) < len(desired):
        progressing = Condition("Progressing", True, "Linking", f"{len(established)} of {len(desired)} links made")
    elif unready:
        progressing = Condition("Progressing", True, "PodsNotReady", "waiting for " + ", ".join(unready) + " pods")
    else:
        progressing = Condition("Progressing", False, "Converged", "every pod is running and linked")

    if mismatches:
        degraded = Condition("Degraded", True, "LayoutMismatch",
                             "KV layouts differ, so these pods are never linked: " + _first(mismatches, len(mismatches))
                             + "; scale the old pods down or make model, dtype and block size agree")
    elif failures:
        degraded = Condition("Degraded", True, "LinkFailed",
                             _first(failures, len(failures)) + "; check the decode worker's log and its transfer port")
    elif crashing:
        degraded = Condition("Degraded", True, "WorkerCrashing",
                             "worker containers restarted and are not running: " + _first(crashing, len(crashing))
                             + "; see `kubectl logs --previous`")
    else:
        degraded = Condition("Degraded", False, "AsExpected", "no failures")

    if desired and len(established) == len(desired):
        links = Condition("LinksReady", True, "AllLinked", f"{len(desired)} of {len(desired)} links made")
    elif mismatches and not desired:
        links = Condition("LinksReady", False, "LayoutMismatch", "no two linkable pods share a KV layout")
    elif failures:
        links = Condition("LinksReady", False, "LinkFailed", f"{len(failed)} links failed; retried with backoff")
    elif not desired:
        links = Condition("LinksReady", False, "NoPeers", "needs a decode and a prefill of the same KV layout, "
                           "running with their models loaded")
    else:
        links = Condition("LinksReady", False, "LinksPending", f"{len(established)} of {len(desired)} links made")
    return [available, progressing, degraded, links]


def build_status(cluster: str, namespace: str, generation: int, spec: ClusterSpec, views: Sequence[PodView],
                 graph: LinkGraph, plan: LinkPlan, templates: Mapping[str, str], previous: Mapping[str, Any],
                 now: str) -> dict[str, Any]:
    """The whole status; a condition keeps its lastTransitionTime while its status holds.
    `templates`: per role, the current pod template hash."""
    counts = {r: _role_counts(r, views, graph, plan, templates[r]) for r in ROLES}
    established = sum(p in graph.edges for p in plan.desired)
    failed = sum(p in graph.failures for p in plan.desired)
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    conds = []
    for c in conditions(spec, views, graph, plan, counts):
        status = "True" if c.ok else "False"
        old = before.get(c.type, {})
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        conds.append({"type": c.type, "status": status, "reason": c.reason, "message": c.message,
                      "lastTransitionTime": since or now, "observedGeneration": generation})
    return {
        "observedGeneration": generation,
        "prefill": counts["prefill"],
        "decode": counts["decode"],
        "links": {"desired": len(plan.desired), "established": established, "failed": failed},
        "linksSummary": f"{established}/{len(plan.desired)}",
        "prefillReady": f"{counts['prefill']['ready']}/{spec.prefill.replicas}",
        "decodeReady": f"{counts['decode']['ready']}/{spec.decode.replicas}",
        "available": conds[0]["status"],
        "endpoint": m.endpoint(cluster, namespace, spec),
        "conditions": conds,
    }


def status_changed(new: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    return any(current.get(k) != v for k, v in new.items())
