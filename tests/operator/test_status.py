"""Status and conditions from pods and the link graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.operator import manifests as m
from disagg.operator.graph import LinkGraph
from disagg.operator.links import LinkResult
from disagg.operator.reconcile import LinkPlan, PodView, plan_links, pod_view
from disagg.operator.snapshot import take_snapshot
from disagg.operator.spec import ClusterSpec
from disagg.operator.status import build_status, status_changed

NOW = "2025-01-01T00:00:00Z"
OWNERS = {"prefill": "static", "decode": "static"}


def status_of(generation: int, spec: ClusterSpec, views: list[PodView], graph: LinkGraph, plan: LinkPlan,
              previous: dict[str, Any], now: str) -> dict[str, Any]:
    snap = take_snapshot(views, graph, plan, m.current_templates(spec))
    return build_status("llm", "ns", generation, spec, snap, previous, now, OWNERS)


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_serving_cluster_reports_available_and_links(spec: ClusterSpec, served_pod: Callable[..., Any]) -> None:
    views = [pod_view(served_pod("prefill", "p", "127.0.0.11", spec, gate=True)),
             pod_view(served_pod("decode", "d", "127.0.0.21", spec, gate=True))]
    graph = LinkGraph()
    plan = plan_links(views, graph, now=0.0)
    for pair, op in plan.link:
        graph.record_link(pair, LinkResult(op, True, "", 0.0), now=0.0, observed=plan.observed[pair])
    status = status_of(3, spec, views, graph, plan, {}, NOW)
    assert status["observedGeneration"] == 3
    assert status["prefill"] == {"replicas": 1, "updated": 1, "ready": 1, "linked": 1, "draining": 0}
    assert status["links"] == {"desired": 1, "established": 1, "failed": 0}
    assert (status["prefillReady"], status["decodeReady"], status["linksSummary"]) == ("1/1", "1/1", "1/1")
    assert conditions(status) == {"Available": ("True", "Serving"), "Progressing": ("False", "Converged"),
                                  "Degraded": ("False", "AsExpected"), "LinksReady": ("True", "AllLinked")}
    assert status["endpoint"] == "http://llm.ns.svc:8000/v1"
    # Unchanged conditions keep their transition time.
    again = status_of(3, spec, views, graph, plan, status, "2025-01-01T01:00:00Z")
    assert again == status


def test_link_failures_and_layout_mismatches_are_degraded_with_reasons(
        spec: ClusterSpec, make_spec: Callable[..., ClusterSpec], served_pod: Callable[..., Any]) -> None:
    views = [pod_view(served_pod("prefill", "p", "127.0.0.11", spec)),
             pod_view(served_pod("decode", "d", "127.0.0.21", spec))]
    graph = LinkGraph()
    plan = plan_links(views, graph, now=0.0)
    ((pair, op),) = plan.link
    graph.record_link(pair, LinkResult(op, False, "UNAVAILABLE: connection refused", 0.0), now=0.0,
                      observed=plan.observed[pair])
    status = status_of(1, spec, views, graph, plan, {}, NOW)
    c = conditions(status)
    assert c["Degraded"] == ("True", "LinkFailed") and c["LinksReady"] == ("False", "LinkFailed")
    assert c["Available"] == ("False", "NoReadyPrefill")
    assert "connection refused" in status["conditions"][2]["message"]
    assert status["links"]["failed"] == 1

    views.append(pod_view(served_pod("decode", "d2", "127.0.0.22", make_spec(blockSize=32))))
    plan = plan_links(views, graph, now=10.0)
    c = conditions(status_of(2, spec, views, graph, plan, {}, NOW))
    assert c["Degraded"] == ("True", "LayoutMismatch")
    # d2 was made from another spec: it is rolled away (the template hash tells).
    assert c["Progressing"] == ("True", "RollingUpdate")
    assert status_of(2, spec, views, graph, plan, {}, NOW)["decode"]["updated"] == 1


def test_the_status_says_who_owns_each_count_and_counts_against_it(spec: ClusterSpec,
                                                                   served_pod: Callable[..., Any]) -> None:
    """An external owner's count (3 decodes) replaces spec.decode.replicas in the status and its conditions."""
    views = [pod_view(served_pod("decode", "d", "127.0.0.21", spec))]
    decided = spec.with_replicas({"decode": 3})
    snap = take_snapshot(views, LinkGraph(), LinkPlan(), m.current_templates(decided))
    status = build_status("llm", "ns", 1, decided, snap, {}, NOW, {"prefill": "static", "decode": "external"})
    gone = dict.fromkeys(["outcome", "hold", "reason", "lastScaleTime"])  # a merge patch deletes them
    assert status["scaling"] == {"prefill": {"owner": "static", "desired": 1, **gone},
                                 "decode": {"owner": "external", "desired": 3, **gone}, "ratio": ""}
    assert status["decodeReady"] == "0/3"
    assert conditions(status)["Progressing"] == ("True", "Scaling")


def test_the_autoscalers_fields_leave_the_status_with_it_and_the_status_then_settles() -> None:
    """Once another owner takes a role, the autoscaler's fields are deleted (None in a merge patch),
    and a status stored without them is the same status: no patch on every pass."""
    stored = {"scaling": {"decode": {"owner": "autoscaler", "desired": 2, "outcome": "scale-down", "hold": "",
                                     "reason": "idle", "lastScaleTime": NOW}, "ratio": ""}}
    new = {"scaling": {"decode": {"owner": "static", "desired": 2, "outcome": None, "hold": None, "reason": None,
                                  "lastScaleTime": None}, "ratio": ""}}
    assert status_changed(new, stored)
    after_patch = {"scaling": {"decode": {"owner": "static", "desired": 2}, "ratio": ""}}
    assert not status_changed(new, after_patch)
