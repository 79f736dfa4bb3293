"""One reconcile pass of a DisaggCluster: read the state, plan with reconcile.py, act.

A `ClusterController` holds what the operator remembers about one cluster
between passes (the link graph, running drains): ephemeral state, rebuilt
after a restart by re-asserting links. Facts (pods, gates, the draining
annotation, the status) live in the API. Passes of one cluster never overlap.
What a pass sees it passes along explicitly, and counts once in a
`ClusterSnapshot` that both the status and the metrics read.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import httpx
import kopf

from disagg.operator import manifests as m
from disagg.operator.cluster_key import every_worker_holds, plan_key
from disagg.operator.drain import drain, in_flight
from disagg.operator.health import key_fingerprint, model_loaded
from disagg.operator.crd import ROLE_KIND, ROLE_PLURAL
from disagg.operator.kube import KindNotServed, KubeApi, require_controlled
from disagg.operator.graph import LinkGraph
from disagg.operator.link_client import LinkClient
from disagg.operator.links import LinkOp
from disagg.operator.metrics import OperatorMetrics
from disagg.operator.reconcile import (
    LinkPlan,
    PodView,
    plan_gates,
    plan_links,
    plan_pods,
    stale_failures,
    surplus,
    with_loaded,
)
from disagg.operator.settings import OperatorSettings
from disagg.operator.roles import (
    RoleCount,
    apply_ratio,
    child_name,
    child_object,
    child_status,
    decide_count,
    read_child,
    rolling,
)
from disagg.operator.scaler import Scaler
from disagg.operator.snapshot import ClusterSnapshot, take_snapshot
from disagg.operator.spec import DNS_LABEL, MAX_CLUSTER_NAME, ROLES, ClusterSpec, parse_spec
from disagg.operator.status import build_status, invalid_spec_status, status_changed
from disagg.workers.security.key import ClusterKey
from disagg.workers.security.tls import CA_FILE, CERT_FILE, KEY_FILE, channel_credentials

log = logging.getLogger(__name__)


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Deps:
    """The operator-wide clients every controller shares (kept in kopf's memo)."""

    settings: OperatorSettings
    kube: KubeApi
    links: LinkClient
    http: httpx.AsyncClient
    metrics: OperatorMetrics
    # (object, type, reason, message): kopf.event in the operator, a recorder in tests.
    post_event: Callable[[kopf.Body, str, str, str], None] = lambda body, kind, reason, message: kopf.event(
        body, type=kind, reason=reason, message=message)


@dataclass(frozen=True)
class RoleState:
    """A role's count for one pass, and its DisaggRole as the pass left it (None: its CRD is not installed)."""

    count: RoleCount
    generation: int | None = None
    status: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ClusterController:
    namespace: str
    name: str
    deps: Deps
    graph: LinkGraph = field(default_factory=LinkGraph)
    drains: dict[str, asyncio.Task[bool]] = field(default_factory=dict)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    last_reassert: float = 0.0
    service_generation: int | None = None
    reported: set[tuple[str, ...]] = field(default_factory=set)  # Events already posted, not to repeat them
    loaded: set[str] = field(default_factory=set)  # incarnations whose /health said their model is loaded
    # The latest pass's snapshot: drains outlive their pass and unlink the peers it saw.
    latest: ClusterSnapshot | None = None
    # The cluster key the link calls are signed with (None: the workers run --insecure), and its
    # text as last read: what a deleted Secret is rotated away from (cluster_key.py).
    key: ClusterKey | None = None
    known_key: str | None = None
    # The link calls' mutual TLS, from spec.security.tlsSecretName's Secret, and the items it was built from.
    tls: grpc.ChannelCredentials | None = None
    tls_items: tuple[bytes, bytes, bytes] | None = None
    # Per role, the built-in autoscaler's latest count: a role named here is owned by the autoscaler
    # (roles.decide_count). The one place a recommendation enters the pass.
    recommended: dict[str, int] = field(default_factory=dict)
    scaler: Scaler | None = None  # while spec.scaling.autoscaler is set
    scaled: dict[str, int] = field(default_factory=dict)  # the autoscaled roles' counts after the band, last pass

    def wake(self) -> None:
        self.wakeup.set()

    def _event(self, body: kopf.Body, kind: str, reason: str, message: str,
               key: tuple[str, ...] | None = None) -> None:
        if key is not None:
            if key in self.reported:
                return
            self.reported.add(key)
        self.deps.post_event(body, kind, reason, message)

    async def reconcile(self, body: kopf.Body, views: Iterable[PodView]) -> float:
        """One pass; returns how long until the next one is due."""
        spec = parse_spec(body.get("spec") or {})
        if len(self.name) > MAX_CLUSTER_NAME or not re.search(DNS_LABEL, self.name):
            # Refused at apply by the CRD installed with this operator; an older one let it in.
            raise kopf.PermanentError(f"the name must be a DNS-1035 label ({DNS_LABEL}) of at most {MAX_CLUSTER_NAME} "
                                      "characters: it names the Service")
        generation = int(body["metadata"].get("generation") or 0)
        if self.service_generation != generation:
            await self.deps.kube.apply_service(self.namespace, m.prefill_service(body, spec))
            self.service_generation = generation
        templates = m.current_templates(spec, *self._security_contexts)
        pods = list(views)
        await self._keep_key(body, spec, pods)
        await self._keep_tls(body, spec)
        in_rollout = {role: rolling(pods, role, templates[role]) for role in ROLES}
        await self._autoscale(body, spec, pods, in_rollout)
        roles = {role: await self._keep_role(body, spec, role, in_rollout[role]) for role in ROLES}
        band = apply_ratio(spec.scaling, {role: state.count for role, state in roles.items()}, in_rollout)
        if band.reason is not None:
            self._event(body, "Normal" if band.satisfied else "Warning",
                        "RatioBand" if band.satisfied else "RatioBandUnsatisfiable", f"ratio band: {band.reason}",
                        key=("RatioBand", band.reason))
        else:  # the next clamp is reported again, even with the same reason
            self.reported = {k for k in self.reported if k[0] != "RatioBand"}
        self.deps.metrics.export_band(self.namespace, self.name, {
            role: band.counts[role].desired - state.count.desired for role, state in roles.items()}, band.satisfied)
        roles = {role: replace(state, count=band.counts[role]) for role, state in roles.items()}
        self.scaled = {role: state.count.desired for role, state in roles.items() if role in self.recommended}
        # From here on the pass plans and reports with the counts the roles' owners decided, banded.
        spec = spec.with_replicas({role: state.count.desired for role, state in roles.items()})
        await self._scale(body, spec, templates, pods)
        pods = await self._observe_models(pods)
        plan = await self._link(body, pods)
        for flip in plan_gates(pods, self.graph, plan.desired):
            await self.deps.kube.set_pod_condition(self.namespace, flip.pod, {
                "type": m.LINKED_GATE, "status": "True" if flip.linked else "False",
                "reason": flip.reason, "message": flip.message, "lastTransitionTime": _now_iso()})
        # Counted before any await below: a drain that runs meanwhile changes the graph, not this pass's counts.
        snap = self.latest = take_snapshot(pods, self.graph, plan, templates)
        self._start_drains(body, spec, snap.views)
        owners = {role: state.count.owner for role, state in roles.items()}
        status = build_status(self.name, self.namespace, generation, spec, snap, body.get("status") or {}, _now_iso(),
                              owners, band.reason, self.scaler)
        if status_changed(status, body.get("status") or {}):
            await self.deps.kube.patch_status(self.namespace, self.name, status)
        for role, state in roles.items():
            if state.generation is None:
                continue
            child = child_status(self.name, role, state.count, snap.roles[role], state.generation)
            if status_changed(child, state.status):
                await self.deps.kube.patch_status(self.namespace, child_name(self.name, role), child, ROLE_PLURAL)
        self.deps.metrics.export(self.namespace, self.name, snap)
        due = self.graph.next_due()
        resync = self.deps.settings.resync_s
        if self.scaler is not None:
            resync = min(resync, self.deps.settings.autoscaler_interval_s)
        if any(v.awaits_model for v in snap.views):
            resync = min(resync, self.deps.settings.health_poll_s)
        return resync if due is None else max(0.05, min(resync, due - time.monotonic()))

    async def report_invalid_spec(self, body: kopf.Body, message: str) -> None:
        """The spec cannot be acted on (what the schema cannot refuse): say so in the status and in
        one Event per generation and reason, not one per pass. Nothing else changes until the spec does."""
        previous = body.get("status") or {}
        generation = int(body["metadata"].get("generation") or 0)
        self._event(body, "Warning", "InvalidSpec", message, key=("InvalidSpec", str(generation), message))
        status = invalid_spec_status(previous, generation, message, _now_iso())
        if status_changed(status, previous):
            await self.deps.kube.patch_status(self.namespace, self.name, status)

    async def _autoscale(self, body: kopf.Body, spec: ClusterSpec, views: Sequence[PodView],
                         in_rollout: Mapping[str, bool]) -> None:
        """When due, the built-in autoscaler's counts into `recommended` (scaler.py); nothing without it.
        Its decision holds the band (what it reports is what the pass will do); apply_ratio then
        finds the counts inside the band already."""
        auto = spec.scaling.autoscaler
        if auto is None:
            self.scaler, self.recommended, self.scaled = None, {}, {}
            return
        settings = self.deps.settings
        if self.scaler is None:
            self.scaler = Scaler(settings.autoscaler_window_s, settings.autoscaler_interval_s)
            scaling = (body.get("status") or {}).get("scaling") or {}  # what a previous operator reported
            self.scaler.last_scale_time.update({role: scaling[role]["lastScaleTime"] for role in ROLES
                                                if (scaling.get(role) or {}).get("lastScaleTime")})
        now = time.monotonic()
        if not self.scaler.due(now):
            return
        # Where the roles are: the counts the last pass scaled them to; at first (a restarted operator,
        # or the autoscaler taking over) the roles' own, so that nothing shrinks past the window.
        current = {role: self.scaled[role] if role in self.scaled else await self._role_replicas(body, spec, role)
                   for role in ROLES}
        decision = await self.scaler.run(self.deps.http, auto, spec.scaling.ratio, views, current, in_rollout, now)
        self.recommended = {role: d.desired for role, d in decision.roles.items()}
        for role, d in decision.roles.items():
            if d.acted:
                self._event(body, "Normal", "AutoscalerScaled", f"{role}: {d.current} -> {d.desired} pods: {d.reason}")
        condition = self.scaler.metrics_condition()
        if condition.ok:  # the next episode of missing metrics is reported again
            self.reported = {k for k in self.reported if k[0] != "AutoscalerHolding"}
        else:
            self._event(body, "Warning", "AutoscalerHolding", condition.message,
                        key=("AutoscalerHolding", condition.reason))
        self.deps.metrics.export_autoscaler(self.namespace, self.name, decision, self.scaler.latency_p90_s)

    async def _role_replicas(self, body: kopf.Body, spec: ClusterSpec, role: str) -> int:
        """The role's size as its DisaggRole says (what a scaler last set), else the cluster's spec."""
        obj = await self._read_role(body, role)
        return spec.role(role).replicas if obj is None else read_child(obj).replicas

    async def _read_role(self, body: kopf.Body, role: str) -> dict[str, Any] | None:
        """The role's DisaggRole; None when missing, NotOurs when another owns that name."""
        obj = await self.deps.kube.read_object(self.namespace, ROLE_PLURAL, child_name(self.name, role))
        if obj is not None:
            require_controlled(ROLE_KIND, obj["metadata"], body["metadata"]["uid"])
        return obj

    async def _keep_role(self, body: kopf.Body, spec: ClusterSpec, role: str, in_rollout: bool) -> RoleState:
        """Decide the role's count (roles.decide_count) and keep its DisaggRole: made when missing,
        its spec.replicas written back where the owner is not an external scaler."""
        name = child_name(self.name, role)
        obj = await self._read_role(body, role)
        count = decide_count(self.name, role, spec.role(role).scaling, spec.role(role).replicas,
                             None if obj is None else read_child(obj), in_rollout, self.recommended.get(role))
        if count.event is not None:
            self._event(body, *count.event)
        if count.write is not None and obj is not None:
            obj = await self.deps.kube.patch_object(self.namespace, ROLE_PLURAL, name,
                                                    {"spec": {"replicas": count.write}})
        elif count.write is not None:
            try:
                obj = await self.deps.kube.create_object(self.namespace, ROLE_PLURAL,
                                                         child_object(body, role, count.write))
            except KindNotServed:
                self._event(body, "Warning", "DisaggRoleNotInstalled", "the DisaggRole CRD is not installed "
                            "(kubectl apply -f deploy/crds/disagg.dev_disaggroles.yaml): the roles have no /scale "
                            "until it is", key=("DisaggRoleNotInstalled",))
                return RoleState(count)
            if obj is None:  # made meanwhile by someone else: the next pass reads it
                return RoleState(count)
        assert obj is not None
        return RoleState(count, int(obj["metadata"].get("generation") or 0), obj.get("status") or {})

    async def _keep_key(self, body: kopf.Body, spec: ClusterSpec, views: Sequence[PodView]) -> None:
        """Make the cluster key's Secret, take a rotation's next step once every worker
        has the current one, and sign the link calls with the key it holds."""
        if spec.security.insecure:
            self.key = None
            return
        name = m.key_secret_name(self.name)
        found = await self.deps.kube.read_secret(self.namespace, name, body["metadata"]["uid"])
        current, rotation = (None, None) if found is None else (
            found[0].get(m.KEY_ITEM, b"").decode(errors="replace"), found[1].get(m.ROTATION_ANNOTATION))
        settled = current is not None and rotation is not None and await self._workers_hold(current, views)
        plan = plan_key(current, rotation, self.known_key, settled)
        if plan.text is not None:
            secret = m.key_secret(body, plan.text, plan.rotation)
            if plan.create:
                if not await self.deps.kube.create_secret(self.namespace, secret):
                    return  # made meanwhile by someone else: the next pass reads it
            else:
                await self.deps.kube.patch_secret(self.namespace, name, {
                    "metadata": {"annotations": {m.ROTATION_ANNOTATION: plan.rotation}},
                    "stringData": secret["stringData"]})
            current = plan.text
        if plan.event is not None:
            self._event(body, *plan.event)
        assert current is not None
        try:
            key = ClusterKey(current.encode())
        except ValueError as e:
            self._event(body, "Warning", "InvalidClusterKey", f"Secret {name} holds no usable key ({e}); "
                        "the workers and the operator keep the previous one", key=("InvalidClusterKey", current))
            return
        self.known_key = current
        if self.key is None:
            self.key = key
        else:  # the same object: the link client's open channels sign with the new text
            self.key.replace(current.encode())

    async def _keep_tls(self, body: kopf.Body, spec: ClusterSpec) -> None:
        """The link calls' TLS credentials from the workers' TLS Secret (read each pass: cert-manager renews it)."""
        name = spec.security.tls_secret_name
        if name is None:
            self.tls = self.tls_items = None
            return
        found = await self.deps.kube.read_secret(self.namespace, name)
        items = None if found is None else tuple(found[0].get(item, b"") for item in (CERT_FILE, KEY_FILE, CA_FILE))
        if items is None or not all(items):
            self._event(body, "Warning", "TLSSecretMissing", f"Secret {name} (spec.security.tlsSecretName) is "
                        f"missing or lacks one of {CERT_FILE}, {KEY_FILE}, {CA_FILE}: workers cannot start and "
                        "links cannot be made until it exists", key=("TLSSecretMissing", name))
            return
        if items != self.tls_items:
            self.tls_items = (items[0], items[1], items[2])
            self.tls = channel_credentials(*self.tls_items)

    async def _workers_hold(self, text: str, views: Sequence[PodView]) -> bool:
        """Whether every running worker reports the keys of `text` (terminating ones too: they still serve)."""
        asking = [v for v in views if v.running and v.ip]
        answers = await asyncio.gather(*(key_fingerprint(self.deps.http, v.ip) for v in asking))
        return every_worker_holds(ClusterKey(text.encode()).fingerprint(), answers)

    @property
    def _security_contexts(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """The operator's defaults for every worker pod (pod level, container level)."""
        return self.deps.settings.worker_pod_security_context, self.deps.settings.worker_security_context

    async def _scale(self, body: kopf.Body, spec: ClusterSpec, templates: Mapping[str, str],
                     views: Sequence[PodView]) -> None:
        candidates = [v for vs in surplus(spec, views).values() for v in vs if v.ip]
        counts = await asyncio.gather(*(in_flight(self.deps.http, v.ip) for v in candidates))
        load = {v.name: c for v, c in zip(candidates, counts) if c is not None}
        plan = plan_pods(spec, self.name, body["metadata"]["uid"], views, load, templates)
        for role, name in plan.create:
            pod = m.worker_pod(body, role, name, spec, *self._security_contexts)
            await self.deps.kube.create_pod(self.namespace, pod)
        for name in plan.drain:
            await self.deps.kube.annotate_pod(self.namespace, name, {m.DRAINING_ANNOTATION: _now_iso()})
            self._event(body, "Normal", "Draining",
                        f"pod {name} leaves routing and finishes its requests before deletion")
        by_name = {v.name: v for v in views}
        for name in plan.delete:
            await self.deps.kube.delete_pod(self.namespace, name, by_name[name].uid)

    async def _observe_models(self, views: Sequence[PodView]) -> list[PodView]:
        """`views`, marked loaded where /health says so. Asks each worker still loading its model,
        so that it is linked as soon as it can be (and not tried before, which would only grow its backoff)."""
        self.loaded &= {v.incarnation for v in views}
        asking = [v for v in views if v.awaits_model and v.incarnation not in self.loaded]
        answers = await asyncio.gather(*(model_loaded(self.deps.http, v.ip) for v in asking))
        self.loaded.update(v.incarnation for v, ok in zip(asking, answers) if ok)
        return with_loaded(views, self.loaded)

    async def _link(self, body: kopf.Body, views: Sequence[PodView]) -> LinkPlan:
        now = time.monotonic()
        reassert = now - self.last_reassert >= self.deps.settings.reassert_s
        # A draining pod keeps its links until its drain unlinks it; once gone, its edges are stale.
        draining = frozenset(v.name for v in views if v.is_draining and not v.is_gone)
        plan = plan_links(views, self.graph, now, reassert=reassert, keep=draining)
        unlink_results, link_results = await self.deps.links.run_pairs(plan.unlink, plan.link, self.key, self.tls)
        self.deps.metrics.observe_links(unlink_results + link_results)
        self.graph.forget(pair for pair, _ in plan.unlink)
        self.graph.forget(stale_failures(self.graph, plan.desired))
        for (pair, op), result in zip(plan.link, link_results):
            self.graph.record_link(pair, result, time.monotonic(), plan.observed[pair])
            if not result.ok:
                log.info("link %s failed: %s", pair, result.error)
                self._event(body, "Warning", "LinkFailed", f"decode {pair[0]} could not link prefill {pair[1]}: "
                            f"{result.error}", key=("LinkFailed", *pair, op.target.incarnation, op.payload.incarnation))
        if reassert:
            self.last_reassert = now
        for d, dl, p, pl in plan.mismatched:
            self._event(body, "Warning", "LayoutMismatch", f"decode {d} (KV layout {dl}) and prefill {p} "
                        f"(KV layout {pl}) are not linked: model, dtype or block size differ",
                        key=("LayoutMismatch", d, p))
        return plan

    def _start_drains(self, body: kopf.Body, spec: ClusterSpec, views: Sequence[PodView]) -> None:
        present = {v.name for v in views}
        for name in [n for n, t in self.drains.items() if n not in present and t.done()]:
            del self.drains[name]
        for v in views:
            task = self.drains.get(v.name)
            # A finished drain has deleted its pod (the index may not show it yet); a failed one is retried.
            retry = task is not None and task.done() and (task.cancelled() or not task.result())
            # The gate is False in the API before the drain starts, so routing has begun to move away.
            if v.is_draining and not v.is_gone and not v.gate and (task is None or retry):
                self.drains[v.name] = asyncio.create_task(self._drain(body, v, spec), name=f"drain-{v.name}")

    async def _drain(self, body: kopf.Body, pod: PodView, spec: ClusterSpec) -> bool:
        """drain.py's steps, then unlink from every live peer, then delete; False when it failed."""
        assert pod.draining_since is not None, f"pod {pod.name} is not draining"
        try:
            await self._drain_and_delete(body, pod, pod.draining_since, spec)
        except Exception:  # noqa: BLE001 - a task's error is nobody's to catch: log it, let the next pass retry
            log.exception("drain of pod %s failed; the next pass retries it", pod.name)
            self.wake()
            return False
        return True

    async def _drain_and_delete(self, body: kopf.Body, pod: PodView, since: float, spec: ClusterSpec) -> None:
        outcome = await drain(pod.endpoint, self.deps.http, deadline=since + spec.drain_timeout_s,
                              grace_s=self.deps.settings.drain_grace_s, poll_s=self.deps.settings.metrics_poll_s,
                              key=self.key)
        # Peers as the latest pass saw them (a peer may have come or gone during the wait).
        assert self.latest is not None, "a drain starts after its pass took a snapshot"
        peers = [v.endpoint for v in self.latest.views
                 if v.role != pod.role and v.running and v.ip and not v.is_gone]
        ops = [op for peer in peers for op in (LinkOp(False, peer, pod.endpoint), LinkOp(False, pod.endpoint, peer))]
        results = await self.deps.links.run(ops, self.key, self.tls)
        self.deps.metrics.observe_links(results)
        failed = {r.op.target.pod for r in results if not r.ok} | {r.op.payload.pod for r in results if not r.ok}
        # An edge whose unlink failed stays known: once the pod is gone, the pass unlinks the peer's side again.
        self.graph.forget(pair for pair in self.graph.peers_of(pod.name) if not failed.intersection(pair))
        await self.deps.kube.delete_pod(self.namespace, pod.name, pod.uid)
        self.deps.metrics.drain_seconds.observe(time.time() - since)
        if outcome.idle:
            self._event(body, "Normal", "Drained", f"pod {pod.name} finished its requests in "
                        f"{outcome.seconds:.1f} s; unlinked from {len(peers)} peers and deleted")
        else:
            self.deps.metrics.drain_timeouts.inc()
            self._event(body, "Warning", "DrainTimeout", f"pod {pod.name} still had requests after "
                        f"{spec.drain_timeout_s} s; unlinked and deleted (raise spec.drain.timeoutSeconds to wait longer)")
        self.wake()

    async def stop(self) -> None:
        for task in self.drains.values():
            task.cancel()
        await asyncio.gather(*self.drains.values(), return_exceptions=True)
