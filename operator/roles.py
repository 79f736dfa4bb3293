"""The `DisaggRole` children, and who owns a role's pod count.

A CRD exposes `/scale` for one replicas path only, so each role of a
DisaggCluster gets a child object, `<cluster>-<role>`, whose `/scale` an HPA,
KEDA or `kubectl scale` use. Pure: the child's manifest and status, and
`decide_count`, the precedence between the cluster's `spec.<role>.replicas`,
the child's `spec.replicas` and the built-in autoscaler (docs/autoscaling.md,
"Who owns a role's replica count"). The controller reads and writes the
children and plans its pods with the counts decided here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import kopf

from disagg.operator import manifests as m
from disagg.operator.crd import GROUP, ROLE_KIND, VERSION
from disagg.operator.ratio import Counts, apply_band
from disagg.operator.reconcile import PodView
from disagg.operator.scaling import MAX_REPLICAS, ScalingSpec
from disagg.operator.snapshot import RoleCounts
from disagg.operator.spec import AUTOSCALER, EXTERNAL, STATIC

# An HPA parks a target whose count is 0 (it never scales up from there), so a
# role handed to an external scaler starts at one pod at least (LWS KEP-849).
EXTERNAL_MIN_START = 1


def child_name(cluster: str, role: str) -> str:
    return f"{cluster}-{role}"


def selector(cluster: str, role: str) -> str:
    """The role's pods as a label selector string: what an HPA reads from `/scale`."""
    return f"{m.CLUSTER_LABEL}={cluster},{m.ROLE_LABEL}={role}"


def child_object(owner: Mapping[str, Any], role: str, replicas: int) -> m.Obj:
    """The DisaggRole of `role`, owned (controller=true) by the DisaggCluster `owner`."""
    cluster = owner["metadata"]["name"]
    child: m.Obj = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": ROLE_KIND,
        "metadata": {"name": child_name(cluster, role),
                     "labels": {m.CLUSTER_LABEL: cluster, m.ROLE_LABEL: role,
                                "app.kubernetes.io/managed-by": "disagg-operator"}},
        "spec": {"replicas": replicas},
    }
    kopf.adopt(child, owner=kopf.Body(cast(kopf.RawBody, dict(owner))))
    return child


@dataclass(frozen=True)
class Child:
    """What a pass read of a role's DisaggRole."""

    replicas: int  # its spec.replicas: what a scaler (or the operator) last wrote
    owner: str | None  # its status.owner as the operator last wrote it; None before its first status
    desired: int | None  # its status.desired: the count the operator last scaled to
    generation: int
    observed: int | None  # its status.observedGeneration: the generation the operator last wrote or saw

    @property
    def scaled_by_others(self) -> bool:
        """Its spec changed since the operator last wrote or saw it: a scaler (or a person) wrote it."""
        return self.observed is not None and self.generation != self.observed


def read_child(obj: Mapping[str, Any]) -> Child:
    status = obj.get("status") or {}
    return Child(replicas=int((obj.get("spec") or {}).get("replicas") or 0), owner=status.get("owner"),
                 desired=status.get("desired"), generation=int(obj["metadata"].get("generation") or 0),
                 observed=status.get("observedGeneration"))


@dataclass(frozen=True)
class RoleCount:
    """A role's count for this pass, who set it, and what to write back."""

    owner: str  # static, external or autoscaler
    desired: int  # the count the pass scales the role to
    write: int | None  # the child's spec.replicas to write (None: leave it as it is)
    message: str  # why `desired` is what it is, for the child's status
    event: tuple[str, str, str] | None = None  # (type, reason, message), for the cluster


def decide_count(cluster: str, role: str, mode: str, cluster_replicas: int, child: Child | None,
                 rolling: bool, recommended: int | None = None) -> RoleCount:
    """The precedence, first match wins:

    1. `recommended` (the built-in autoscaler owns the role): its count; the
       child shows it, and a scaler's write to the child is set back.
    2. `mode` external: the child's spec.replicas. A role that just became
       external keeps its current size, at least EXTERNAL_MIN_START.
    3. `mode` static: the cluster's spec.<role>.replicas, copied into the
       child; a scaler's write to the child is set back, with an Event.

    Whoever asks, a role in a rollout (`rolling`) is never shrunk mid-way: a
    lower count waits at the previous one until the rollout ends.
    """
    name = child_name(cluster, role)
    previous = None if child is None else child.owner
    event: tuple[str, str, str] | None = None
    if recommended is not None:
        owner, asked = AUTOSCALER, recommended
        message = "the built-in autoscaler sets the count (spec.scaling.autoscaler)"
    elif mode == EXTERNAL:
        owner = EXTERNAL
        if child is not None and previous == EXTERNAL:
            asked = child.replicas
        else:  # just handed over: keep the size the role had
            asked = max(EXTERNAL_MIN_START, cluster_replicas if child is None else child.replicas)
        message = (f"spec.replicas of this object sets the count (HPA, KEDA, kubectl scale); "
                   f"spec.{role}.replicas of DisaggCluster {cluster} is ignored")
    else:
        assert mode == STATIC, f"unknown scaling mode {mode!r}"
        owner, asked = STATIC, cluster_replicas
        message = f"spec.{role}.replicas of DisaggCluster {cluster} sets the count (spec.{role}.scaling: static)"
    if child is not None and child.scaled_by_others and child.replicas != asked and previous == owner != EXTERNAL:
        event = ("Warning", "ScaleOverridden",
                 f"DisaggRole {name} was scaled to {child.replicas}, but {owner} owns the {role} count: set back to "
                 f"{asked}" + (f"; set spec.{role}.scaling: external to let HPA, KEDA or kubectl scale set it"
                               if owner == STATIC else ""))
    elif previous is not None and previous != owner:
        event = ("Normal", "ScalingOwnerChanged", f"the {role} count is now set by {owner} (was {previous}): "
                 f"{asked} pods")
    write = asked if child is None or child.replicas != asked else None
    desired = asked
    if rolling and child is not None and child.desired is not None and asked < child.desired:
        desired = child.desired
        message += f"; the scale-down to {asked} waits for the rollout in progress to end"
    return RoleCount(owner=owner, desired=desired, write=write, message=message, event=event)


def rolling(views: Sequence[PodView], role: str, template: str) -> bool:
    """A rollout of the role is in progress: some active pod is not of its current template."""
    return any(v.role == role and v.is_active and v.template != template for v in views)


@dataclass(frozen=True)
class Banded:
    counts: Mapping[str, RoleCount]  # per role, with the band's adjustment in desired and message
    reason: str | None  # what the band changed and why; None when the owners' counts were inside it
    satisfied: bool = True  # False: no counts within the limits fit, the owners' counts are kept


def apply_ratio(scaling: ScalingSpec, counts: Mapping[str, RoleCount], rolling: Mapping[str, bool]) -> Banded:
    """spec.scaling.ratio over the counts the owners decided, whoever they are (ratio.apply_band).
    Growth is capped by the autoscaler's maxReplicas (else the spec's bound); a role is never
    shrunk below the autoscaler's minReplicas, nor below its count during a rollout."""
    if scaling.ratio is None:
        return Banded(counts, None)
    auto = scaling.autoscaler

    def limit(role: str, which: str) -> int:
        floor = counts[role].desired if which == "min" and rolling[role] else 0
        if auto is None:
            return floor if which == "min" else MAX_REPLICAS
        bounds = auto.bounds["prefill" if role == "prefill" else "decode"]
        return max(floor, bounds.min_replicas) if which == "min" else bounds.max_replicas

    result = apply_band(scaling.ratio, Counts(counts["prefill"].desired, counts["decode"].desired),
                        max_counts=Counts(limit("prefill", "max"), limit("decode", "max")),
                        floor=Counts(limit("prefill", "min"), limit("decode", "min")))
    if result.reason is None:
        return Banded(counts, None)
    banded = {role: count if getattr(result.counts, role) == count.desired else
              replace(count, desired=getattr(result.counts, role), message=f"{count.message}; ratio band: "
                                                                             f"{result.reason}")
              for role, count in counts.items()}
    return Banded(banded, result.reason, result.satisfied)


def child_status(cluster: str, role: str, count: RoleCount, pods: RoleCounts, generation: int) -> dict[str, Any]:
    """The DisaggRole's status: `replicas` and `selector` are what `/scale` reports."""
    return {"observedGeneration": generation, "replicas": pods.replicas, "ready": pods.ready,
            "desired": count.desired, "selector": selector(cluster, role), "owner": count.owner,
            "message": count.message}
