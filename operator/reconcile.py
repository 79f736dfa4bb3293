"""Desired versus actual, as pure functions: which pods to create, drain or
delete, which links to make or drop, which readiness gates to flip.

The handlers turn a cluster's pods into `PodView`s, call these, and carry
out the actions. Nothing here talks to the cluster or to a worker.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any

from disagg.operator import manifests as m
from disagg.operator.graph import LinkGraph, Observed, Pair
from disagg.operator.links import Endpoint, LinkOp
from disagg.operator.spec import ROLES, ClusterSpec


@dataclass(frozen=True)
class PodView:
    """What the reconcile needs to know about one worker pod."""

    name: str
    uid: str
    role: str
    layout: str
    template: str  # the pod-template-hash label ("" on pods made before it existed)
    ip: str
    phase: str
    running: bool  # the worker container is running now
    containers_ready: bool  # its readiness probe passes
    gate: bool  # the disagg.dev/linked condition is True
    restarts: int
    deleting: bool  # deletionTimestamp is set
    draining_since: float | None  # epoch seconds, from the draining annotation
    created: str  # creationTimestamp (RFC 3339 sorts as text)
    # Its worker said (GET /health) that its model is loaded and its gRPC server
    # up. Not in the pod: the controller asks the worker and fills it in.
    loaded: bool = False

    @property
    def is_gone(self) -> bool:
        """Terminating or finished: its links must go, and it no longer counts."""
        return self.deleting or self.phase in ("Failed", "Succeeded")

    @property
    def is_draining(self) -> bool:
        return self.draining_since is not None

    @property
    def is_active(self) -> bool:
        """Counts towards the role's replicas."""
        return not self.is_gone and not self.is_draining

    @property
    def serving(self) -> bool:
        """Ready and linked: in routing, carrying requests."""
        return self.containers_ready and self.gate

    @property
    def model_loaded(self) -> bool:
        """Its readiness probe passes (which needs the model) or its /health said so.
        A prefill's /ready waits for a linked decode, so only /health tells that
        a prefill can be linked."""
        return self.containers_ready or self.loaded

    @property
    def awaits_model(self) -> bool:
        """A live worker not yet known to have loaded its model: its /health is worth asking."""
        return self.is_active and self.running and bool(self.ip) and not self.model_loaded

    @property
    def can_link(self) -> bool:
        """Worth a link attempt: live, with its model loaded. Before that its gRPC
        server is not up, and every attempt would fail and grow the backoff."""
        return self.is_active and self.running and bool(self.ip) and self.model_loaded

    @property
    def incarnation(self) -> str:
        """"<pod uid>/<restart count>": a restarted worker is a new incarnation."""
        return f"{self.uid}/{self.restarts}"

    @property
    def observed(self) -> tuple[str, str, bool, bool, bool]:
        """What a link attempt's outcome hangs on; when it changes, a failed link
        of this pod is tried again at once, its backoff started afresh."""
        return (self.incarnation, self.ip, self.running, self.containers_ready, self.loaded)

    @property
    def endpoint(self) -> Endpoint:
        assert self.ip, f"pod {self.name} has no IP yet"
        return Endpoint(pod=self.name, incarnation=self.incarnation, ip=self.ip)


def _epoch(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """A PodView from a pod as the API serves it."""
    meta, status = pod["metadata"], pod.get("status") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    conditions = {c["type"]: c.get("status") for c in status.get("conditions") or []}
    containers = [c for c in status.get("containerStatuses") or [] if c.get("name") == m.CONTAINER]
    c = containers[0] if containers else {}
    draining = annotations.get(m.DRAINING_ANNOTATION)
    return PodView(
        name=meta["name"],
        uid=meta.get("uid", ""),
        role=labels.get(m.ROLE_LABEL, ""),
        layout=labels.get(m.LAYOUT_LABEL, ""),
        template=labels.get(m.TEMPLATE_LABEL, ""),
        ip=status.get("podIP") or "",
        phase=status.get("phase") or "Pending",
        running="running" in (c.get("state") or {}),
        containers_ready=bool(c.get("ready")),
        gate=conditions.get(m.LINKED_GATE) == "True",
        restarts=int(c.get("restartCount") or 0),
        deleting=bool(meta.get("deletionTimestamp")),
        draining_since=_epoch(draining) if draining else None,
        created=meta.get("creationTimestamp") or "",
    )


def with_loaded(views: Iterable[PodView], loaded: Set[str]) -> list[PodView]:
    """`views`, marked loaded where their incarnation is in `loaded` (those whose
    /health said so; a restart makes a new incarnation, which is asked again)."""
    return [replace(v, loaded=True) if v.incarnation in loaded else v for v in views]


# ---- pods -------------------------------------------------------------------

MAX_SURGE = 1  # pods above a role's replicas while it rolls to a new template


@dataclass(frozen=True)
class PodPlan:
    create: tuple[tuple[str, str], ...] = ()  # (role, pod name)
    drain: tuple[str, ...] = ()  # pods to start draining (scale-down victims)
    delete: tuple[str, ...] = ()  # finished pods, to be replaced

    @property
    def empty(self) -> bool:
        return not (self.create or self.drain or self.delete)


def surplus(spec: ClusterSpec, views: Sequence[PodView]) -> dict[str, list[PodView]]:
    """Per role with too many active pods, those active pods (the victim candidates)."""
    out = {}
    for role in ROLES:
        active = [v for v in views if v.role == role and v.is_active]
        if len(active) > spec.role(role).replicas:
            out[role] = active
    return out


def pick_victims(candidates: Sequence[PodView], count: int, layout: str, template: str,
                 load: Mapping[str, float]) -> list[str]:
    """The `count` pods whose removal hurts least: an outdated pod template first,
    then an outdated KV layout, then not serving, then least in-flight requests,
    then the newest."""
    def cost(v: PodView) -> tuple[bool, bool, bool, float]:
        return (v.template == template, v.layout == layout, v.serving, load.get(v.name, 0.0))

    # A stable sort of the newest-first list: ties go to the newest pod.
    newest_first = sorted(candidates, key=lambda v: v.created, reverse=True)
    return [v.name for v in sorted(newest_first, key=cost)[:count]]


def plan_pods(spec: ClusterSpec, cluster: str, cluster_uid: str, views: Sequence[PodView],
              load: Mapping[str, float], templates: Mapping[str, str]) -> PodPlan:
    """Converge each role's active pods to its replicas, all of the role's
    current pod template (`templates`); `load` (in-flight requests per pod) is
    needed only for the roles `surplus` names.

    A template change rolls a role one pod at a time, never below its replicas
    in service: one pod above replicas is made from the new template, and an
    outdated pod is drained once a serving pod stands in for it (an outdated
    pod that does not serve may go at once).
    """
    taken = {v.name for v in views}
    create: list[tuple[str, str]] = []
    drain: list[str] = []
    for role in ROLES:
        replicas, template = spec.role(role).replicas, templates[role]
        active = [v for v in views if v.role == role and v.is_active]
        outdated = [v for v in active if v.template != template]
        missing = replicas - (len(active) - len(outdated))
        excess = len(active) - replicas
        if outdated:
            missing = min(missing, replicas + MAX_SURGE - len(active))
            spare = sum(v.serving for v in active) - replicas
            excess = min(excess, sum(not v.serving for v in outdated) + max(0, spare))
        slot = 0
        while missing > 0:
            name = m.pod_name(cluster, cluster_uid, role, slot)
            slot += 1
            if name not in taken:
                create.append((role, name))
                taken.add(name)
                missing -= 1
        if excess > 0:
            drain += pick_victims(active, excess, spec.kv_layout, template, load)
    delete = [v.name for v in views if v.phase in ("Failed", "Succeeded") and not v.deleting]
    return PodPlan(create=tuple(create), drain=tuple(drain), delete=tuple(delete))


# ---- links ------------------------------------------------------------------


@dataclass(frozen=True)
class LinkPlan:
    unlink: tuple[tuple[Pair, tuple[LinkOp, ...]], ...] = ()  # per stale pair, its unlink RPCs
    link: tuple[tuple[Pair, LinkOp], ...] = ()
    desired: frozenset[Pair] = frozenset()
    mismatched: tuple[tuple[str, str, str, str], ...] = ()  # (decode, its layout, prefill, its layout)
    # Per desired pair, its pods as planned: record each link result with it (LinkGraph.record_link).
    observed: Mapping[Pair, Observed] = field(default_factory=dict)


def plan_links(views: Sequence[PodView], graph: LinkGraph, now: float, reassert: bool = False,
               keep: frozenset[str] = frozenset()) -> LinkPlan:
    """Every linkable decode with every linkable prefill of the same KV layout.

    Stale edges (a peer gone, restarted or replaced) are unlinked on whichever
    side is still alive, except edges of the pods in `keep` (draining: their
    drain unlinks them once idle). Missing links are made when their backoff
    allows (or at once when a pod of the pair changed since its last failure);
    `reassert` re-sends existing ones too (they are idempotent); one whose
    re-assert failed is re-sent when its backoff allows, until it succeeds.
    """
    by_name = {v.name: v for v in views}
    decodes = [v for v in views if v.role == "decode" and v.can_link]
    prefills = [v for v in views if v.role == "prefill" and v.can_link]
    desired: dict[Pair, tuple[Endpoint, Endpoint]] = {}
    observed: dict[Pair, Observed] = {}
    mismatched = []
    for d in decodes:
        for p in prefills:
            if d.layout == p.layout:
                desired[(d.name, p.name)] = (d.endpoint, p.endpoint)
                observed[(d.name, p.name)] = (d.observed, p.observed)
            else:
                mismatched.append((d.name, d.layout, p.name, p.layout))

    def alive(ep: Endpoint) -> bool:
        v = by_name.get(ep.pod)
        return v is not None and not v.is_gone and v.running and bool(v.ip) and v.endpoint == ep

    unlink = []
    for pair, edge in graph.edges.items():
        if pair in desired and desired[pair] == (edge.decode, edge.prefill) or keep.intersection(pair):
            continue
        ops = []
        if alive(edge.decode):
            ops.append(LinkOp(link=False, target=edge.decode, payload=edge.prefill))
        if alive(edge.prefill):
            ops.append(LinkOp(link=False, target=edge.prefill, payload=edge.decode))
        unlink.append((pair, tuple(ops)))
    link = [
        (pair, LinkOp(link=True, target=d, payload=p))
        for pair, (d, p) in desired.items()
        if (reassert or not graph.established(pair, d, p) or pair in graph.failures)
        and graph.due(pair, now, observed[pair])
    ]
    return LinkPlan(unlink=tuple(unlink), link=tuple(link), desired=frozenset(desired), mismatched=tuple(mismatched),
                    observed=observed)


def stale_failures(graph: LinkGraph, desired: Iterable[Pair]) -> list[Pair]:
    """Failure records of pairs that are no longer wanted."""
    wanted = set(desired)
    return [pair for pair in graph.failures if pair not in wanted]


# ---- readiness gates --------------------------------------------------------


@dataclass(frozen=True)
class GateFlip:
    pod: str
    linked: bool
    reason: str
    message: str


def plan_gates(views: Sequence[PodView], graph: LinkGraph, desired: frozenset[Pair]) -> list[GateFlip]:
    """The gate goes True once all of a pod's links are made, and stays True
    while at least one holds (a new peer being linked must not take a serving
    pod out of routing); it goes False on drain or when no link is left."""
    flips = []
    for v in views:
        if v.is_gone:
            continue
        peers = [pair for pair in desired if v.name in pair]
        made = [pair for pair in peers if pair in graph.edges]
        if v.is_draining:
            want, reason, message = False, "Draining", "removed from routing before deletion"
        elif peers and len(made) == len(peers):
            want, reason, message = True, "Linked", f"linked to all {len(peers)} peers"
        elif v.gate and made:
            want, reason, message = True, "Linked", f"linked to {len(made)} of {len(peers)} peers"
        else:
            want, reason, message = False, "NotLinked", f"linked to {len(made)} of {len(peers)} peers"
        if want != v.gate:
            flips.append(GateFlip(v.name, want, reason, message))
    return flips
