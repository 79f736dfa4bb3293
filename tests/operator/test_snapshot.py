"""The pass snapshot: its counts, each condition read from it, and the status and metrics agreeing on them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from disagg.operator import manifests as m
from disagg.operator.graph import LinkGraph
from disagg.operator.links import LinkResult
from disagg.operator.metrics import OperatorMetrics
from disagg.operator.reconcile import LinkPlan, PodView, plan_links, pod_view
from disagg.operator.snapshot import ClusterSnapshot, LinkSummary, RoleCounts, take_snapshot
from disagg.operator.spec import ROLES, ClusterSpec
from disagg.operator.status import available, build_status, degraded, links_ready, progressing, status_changed

NOW = "2025-01-01T00:00:00Z"
OWNERS = {"prefill": "static", "decode": "static"}


def link(graph: LinkGraph, plan: LinkPlan, errors: dict[tuple[str, str], str], now: float = 0.0) -> None:
    """Record each planned link as the pass would: failed where `errors` names the pair."""
    for pair, op in plan.link:
        error = errors.get(pair, "")
        graph.record_link(pair, LinkResult(op, not error, error, 0.0), now, plan.observed[pair])


@pytest.fixture
def mixed(make_spec: Callable[..., ClusterSpec], served_pod: Callable[..., Any]) -> tuple[ClusterSpec, list[PodView]]:
    """One prefill serving and one draining; decodes: serving, unlinked, terminating, crashing, of another layout."""
    spec = make_spec(prefill=1, decode=2)
    crashed = served_pod("decode", "d-crash", "127.0.0.24", spec, ready=False, restarts=2)
    crashed["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
    pods = [served_pod("prefill", "p", "127.0.0.11", spec, gate=True),
            served_pod("prefill", "p-old", "127.0.0.12", spec, draining="2025-01-01T00:05:00Z"),
            served_pod("decode", "d", "127.0.0.21", spec, gate=True),
            served_pod("decode", "d-new", "127.0.0.22", spec),
            served_pod("decode", "d-gone", "127.0.0.23", spec, deleting=True),
            crashed,
            served_pod("decode", "d-other", "127.0.0.25", make_spec(prefill=1, decode=2, blockSize=32))]
    return spec, [pod_view(p) for p in pods]


def snapshot_of(spec: ClusterSpec, views: list[PodView]) -> ClusterSnapshot:
    graph = LinkGraph()
    plan = plan_links(views, graph, now=0.0)
    link(graph, plan, {("d-new", "p"): "UNAVAILABLE: connection refused"})
    return take_snapshot(views, graph, plan, m.current_templates(spec))


def test_snapshot_counts_each_role_and_the_links(mixed: tuple[ClusterSpec, list[PodView]]) -> None:
    snap = snapshot_of(*mixed)
    # p has a failed link to d-new, so it is not linked; p-old drains.
    assert snap.roles["prefill"] == RoleCounts(replicas=1, updated=1, ready=1, linked=0, draining=1, terminating=0,
                                               total=2)
    # d-gone is terminating; d-other is of another pod template; only d is serving and linked.
    assert snap.roles["decode"] == RoleCounts(replicas=4, updated=3, ready=1, linked=1, draining=0, terminating=1,
                                              total=5)
    assert snap.links.desired == 2 and snap.links.established == 1 and snap.links.failed == 1
    assert snap.links.pending == 0
    assert snap.links.failures == ("decode d-new -> prefill p: UNAVAILABLE: connection refused",)
    assert len(snap.links.mismatches) == 1 and snap.links.mismatches[0].startswith("decode d-other (")
    assert snap.crashing == ("d-crash",)
    assert [v.name for v in snap.views] == [v.name for v in mixed[1]]


def test_status_and_metrics_show_the_same_counts(mixed: tuple[ClusterSpec, list[PodView]]) -> None:
    spec, views = mixed
    snap = snapshot_of(spec, views)
    status = build_status("llm", "ns", 1, spec, snap, {}, NOW, OWNERS)
    metrics = OperatorMetrics()
    metrics.export("ns", "llm", snap)

    def gauge(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value("disagg_operator_" + name, {"namespace": "ns", "cluster": "llm",
                                                                              **labels})

    # p's gate is True but its link to d-new failed: linked counts links, in both.
    assert (status["prefill"]["linked"], status["decode"]["linked"]) == (0, 1)
    for role in ROLES:
        for state, n in status[role].items():
            assert gauge("pods", role=role, state=state) == n, (role, state)
        assert gauge("pods", role=role, state="total") == sum(v.role == role for v in views)
    for state in ("established", "failed"):
        assert gauge("links", state=state) == status["links"][state]
    assert gauge("links", state="pending") == 0 and gauge("links", state="mismatched") == 1


def test_a_deleted_clusters_series_are_dropped_and_the_others_kept(mixed: tuple[ClusterSpec, list[PodView]]) -> None:
    """Dashboards would show a deleted cluster at its last values for as long as the operator runs."""
    spec, views = mixed
    metrics = OperatorMetrics()
    for cluster in ("llm", "other"):
        metrics.export("ns", cluster, snapshot_of(spec, views))
        metrics.export_band("ns", cluster, {"prefill": 1, "decode": 0}, True)
    metrics.forget("ns", "llm")
    kept = {(s.labels.get("cluster"), family.name) for family in metrics.registry.collect() for s in family.samples}
    assert ("other", "disagg_operator_pods") in kept and ("other", "disagg_operator_ratio_band_satisfiable") in kept
    assert not [name for cluster, name in kept if cluster == "llm"]


def roles(prefill: RoleCounts, decode: RoleCounts) -> dict[str, RoleCounts]:
    return {"prefill": prefill, "decode": decode}


def counts(replicas: int = 1, updated: int | None = None, ready: int | None = None, linked: int | None = None,
           draining: int = 0) -> RoleCounts:
    """A role's counts; the unnamed ones as in a converged role."""
    def given(n: int | None) -> int:
        return replicas if n is None else n

    return RoleCounts(replicas=replicas, updated=given(updated), ready=given(ready), linked=given(linked),
                      draining=draining, terminating=0, total=replicas + draining)


def links(desired: int = 1, established: int | None = None, failed: int = 0, mismatches: int = 0) -> LinkSummary:
    return LinkSummary(desired=desired, established=desired - failed if established is None else established,
                       failed=failed, failures=tuple(f"decode d{i} -> prefill p: refused" for i in range(failed)),
                       mismatches=tuple(f"decode x{i} (a) / prefill p (b)" for i in range(mismatches)))


def snap(prefill: RoleCounts | None = None, decode: RoleCounts | None = None, link: LinkSummary | None = None,
         crashing: tuple[str, ...] = ()) -> ClusterSnapshot:
    return ClusterSnapshot(views=(), roles=roles(prefill or counts(), decode or counts()), links=link or links(),
                           crashing=crashing)


@pytest.mark.parametrize("case, ok, reason", [
    (snap(), True, "Serving"),
    (snap(prefill=counts(ready=0)), False, "NoReadyPrefill"),
    (snap(decode=counts(linked=0)), False, "NoLinkedDecode"),
])
def test_available(case: ClusterSnapshot, ok: bool, reason: str) -> None:
    c = available(case)
    assert (c.type, c.ok, c.reason) == ("Available", ok, reason)


@pytest.mark.parametrize("case, reason, says", [
    (snap(decode=counts(replicas=2, updated=1)), "RollingUpdate", "decode 1/1"),
    (snap(prefill=counts(replicas=0)), "Scaling", "prefill 0/1"),
    (snap(decode=counts(draining=1)), "Draining", "1 pods"),
    (snap(link=links(desired=2, established=1)), "Linking", "1 of 2"),
    (snap(prefill=counts(ready=0)), "PodsNotReady", "prefill"),
    (snap(), "Converged", "every pod"),
])
def test_progressing_names_the_first_thing_still_moving(spec: ClusterSpec, case: ClusterSnapshot, reason: str,
                                                        says: str) -> None:
    c = progressing(spec, case)
    assert (c.type, c.ok, c.reason) == ("Progressing", reason != "Converged", reason)
    assert says in c.message


@pytest.mark.parametrize("case, reason, says", [
    (snap(link=links(mismatches=4, failed=1), crashing=("w",)), "LayoutMismatch", "x2 (a) / prefill p (b) and 1 more"),
    (snap(link=links(failed=1), crashing=("w",)), "LinkFailed", "decode d0 -> prefill p: refused"),
    (snap(crashing=("w",)), "WorkerCrashing", "w"),
    (snap(), "AsExpected", "no failures"),
])
def test_degraded_names_the_worst_failure(case: ClusterSnapshot, reason: str, says: str) -> None:
    c = degraded(case)
    assert (c.type, c.ok, c.reason) == ("Degraded", reason != "AsExpected", reason)
    assert says in c.message


@pytest.mark.parametrize("case, ok, reason", [
    (snap(link=links(desired=3)), True, "AllLinked"),
    (snap(link=links(desired=0, mismatches=1)), False, "LayoutMismatch"),
    (snap(link=links(desired=2, failed=1)), False, "LinkFailed"),
    (snap(link=links(desired=0)), False, "NoPeers"),
    (snap(link=links(desired=2, established=1)), False, "LinksPending"),
])
def test_links_ready(case: ClusterSnapshot, ok: bool, reason: str) -> None:
    c = links_ready(case)
    assert (c.type, c.ok, c.reason) == ("LinksReady", ok, reason)


def test_an_operator_restart_writes_no_status(spec: ClusterSpec, served_pod: Callable[..., Any]) -> None:
    """A restarted operator has an empty graph; its first pass re-asserts the links
    before it counts, so the status it computes equals the one in the API."""
    views = [pod_view(served_pod("prefill", "p", "127.0.0.11", spec, gate=True)),
             pod_view(served_pod("decode", "d", "127.0.0.21", spec, gate=True))]
    templates = m.current_templates(spec)
    written: dict[str, Any] = {}
    for now, later in ((0.0, NOW), (3600.0, "2025-01-01T01:00:00Z")):  # the same pods, before and after the restart
        graph = LinkGraph()
        plan = plan_links(views, graph, now=now)
        link(graph, plan, {})
        status = build_status("llm", "ns", 1, spec, take_snapshot(views, graph, plan, templates), written, later,
                              OWNERS)
        if not written:
            written = status
    assert not status_changed(status, written)


def test_the_planners_import_no_grpc() -> None:
    """reconcile.py, the snapshot and the status are pure: they must not pull in the gRPC client."""
    code = ("import sys, disagg.operator.reconcile, disagg.operator.snapshot, disagg.operator.status; "
            "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
