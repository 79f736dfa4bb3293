"""What one reconcile pass saw of a cluster, counted once: status.py and
metrics.py both read it, so the status and the gauges never disagree.

Taken after the pass has linked (its views carry what /health said), and
frozen: drains running meanwhile change the graph, not the snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from disagg.operator.graph import LinkGraph
from disagg.operator.reconcile import LinkPlan, PodView
from disagg.operator.spec import ROLES


@dataclass(frozen=True)
class RoleCounts:
    """One role's pods. The first five are the status's; the rest only the metrics show."""

    replicas: int  # active: count towards spec replicas
    updated: int  # active, of the role's current pod template
    ready: int  # active and serving (ready and gated in)
    linked: int  # active, with every link it should have made
    draining: int  # draining and not yet terminating
    terminating: int  # terminating or finished
    total: int  # every pod of the role, whatever its state

    def status(self) -> dict[str, int]:
        """The status's per-role object (the CRD's field list)."""
        return {"replicas": self.replicas, "updated": self.updated, "ready": self.ready, "linked": self.linked,
                "draining": self.draining}


@dataclass(frozen=True)
class LinkSummary:
    desired: int  # pairs that should be linked
    established: int  # of those, linked
    failed: int  # of those, whose last attempt failed
    failures: tuple[str, ...]  # per failed pair, what went wrong (sorted by pair)
    mismatches: tuple[str, ...]  # per pair never linked as their KV layouts differ

    @property
    def pending(self) -> int:
        return self.desired - self.established - self.failed


@dataclass(frozen=True)
class ClusterSnapshot:
    views: tuple[PodView, ...]
    roles: Mapping[str, RoleCounts]  # per role in ROLES
    links: LinkSummary
    crashing: tuple[str, ...]  # pods whose worker restarted and is not running now


def _role_counts(mine: Sequence[PodView], template: str, desired: frozenset[tuple[str, str]],
                 graph: LinkGraph) -> RoleCounts:
    active = [v for v in mine if v.is_active]

    def linked(v: PodView) -> bool:
        peers = [pair for pair in desired if v.name in pair]
        return bool(peers) and all(pair in graph.edges for pair in peers)

    return RoleCounts(
        replicas=len(active),
        updated=sum(v.template == template for v in active),
        ready=sum(v.serving for v in active),
        linked=sum(linked(v) for v in active),
        draining=sum(v.is_draining and not v.is_gone for v in mine),
        terminating=sum(v.is_gone for v in mine),
        total=len(mine),
    )


def take_snapshot(views: Sequence[PodView], graph: LinkGraph, plan: LinkPlan,
                  templates: Mapping[str, str]) -> ClusterSnapshot:
    """The pass's counts. `plan`: the pass's link plan; `templates`: per role, the current pod template hash."""
    failed = sorted(p for p in plan.desired if p in graph.failures)
    links = LinkSummary(
        desired=len(plan.desired),
        established=sum(p in graph.edges for p in plan.desired),
        failed=len(failed),
        failures=tuple(f"decode {d} -> prefill {p}: {graph.failures[(d, p)].error}" for d, p in failed),
        mismatches=tuple(f"decode {d} ({dl}) / prefill {p} ({pl})" for d, dl, p, pl in plan.mismatched),
    )
    roles = {r: _role_counts([v for v in views if v.role == r], templates[r], plan.desired, graph) for r in ROLES}
    crashing = tuple(v.name for v in views if v.restarts > 0 and not v.running and not v.is_gone)
    return ClusterSnapshot(views=tuple(views), roles=roles, links=links, crashing=crashing)
