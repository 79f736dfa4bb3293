"""Desired versus actual: pods to create or drain, links to make or drop, gates to flip."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.operator import manifests as m
from disagg.operator.graph import LinkGraph
from disagg.operator.links import Endpoint, LinkOp, LinkResult
from disagg.operator.reconcile import (
    PodPlan,
    PodView,
    plan_gates,
    plan_links,
    plan_pods,
    pod_view,
    surplus,
    with_loaded,
)
from disagg.operator.spec import ClusterSpec, parse_spec

Pod = Callable[..., dict[str, Any]]


def views_of(*pods: dict[str, Any]) -> list[PodView]:
    return [pod_view(p) for p in pods]


def pods_plan(spec: ClusterSpec, views: list[PodView], load: dict[str, float] | None = None) -> PodPlan:
    return plan_pods(spec, "llm", "uid-1", views, load or {}, m.current_templates(spec))


def link_all(graph: LinkGraph, views: list[PodView]) -> None:
    """Record every planned link as made, as if every RPC succeeded."""
    plan = plan_links(views, graph, now=0.0)
    for pair, op in plan.link:
        graph.record_link(pair, LinkResult(op, True, "", 0.0), now=0.0, observed=plan.observed[pair])


def test_pod_view_reads_the_api_shape(spec: ClusterSpec, served_pod: Pod) -> None:
    v = pod_view(served_pod("decode", "d1", "127.0.0.5", spec, gate=True, restarts=2,
                            draining="2025-01-01T00:00:10Z"))
    assert (v.role, v.ip, v.gate, v.restarts, v.layout) == ("decode", "127.0.0.5", True, 2, spec.kv_layout)
    assert v.running and v.containers_ready and v.is_draining and not v.is_active and not v.can_link
    assert v.endpoint == Endpoint("d1", "uid-d1/2", "127.0.0.5")


def test_scale_up_creates_missing_pods_with_fresh_deterministic_names(make_spec: Callable[..., ClusterSpec],
                                                                      served_pod: Pod) -> None:
    spec = make_spec(prefill=1, decode=3)
    first = m.pod_name("llm", "uid-1", "decode", 0)
    views = views_of(served_pod("decode", first, "127.0.0.2", spec))
    plan = pods_plan(spec, views)
    assert [r for r, _ in plan.create] == ["prefill", "decode", "decode"]
    names = [n for _, n in plan.create]
    assert first not in names and len(set(names)) == 3
    # Same actual state, same plan: a retried reconcile re-creates the same names (and meets 409).
    assert pods_plan(spec, views) == plan


def test_terminating_pods_are_replaced_under_a_new_name(spec: ClusterSpec, served_pod: Pod) -> None:
    old = m.pod_name("llm", "uid-1", "decode", 0)
    views = views_of(served_pod("prefill", "p", "127.0.0.3", spec),
                     served_pod("decode", old, "127.0.0.2", spec, deleting=True))
    plan = pods_plan(spec, views)
    assert plan.create == (("decode", m.pod_name("llm", "uid-1", "decode", 1)),)


def test_scale_down_drains_the_least_busy_and_prefers_outdated_layouts(make_spec: Callable[..., ClusterSpec],
                                                                       served_pod: Pod) -> None:
    spec = make_spec(prefill=1, decode=1)
    views = views_of(served_pod("prefill", "p", "127.0.0.9", spec),
                     served_pod("decode", "busy", "127.0.0.2", spec, gate=True),
                     served_pod("decode", "idle", "127.0.0.3", spec, gate=True))
    assert set(surplus(spec, views)) == {"decode"}
    plan = pods_plan(spec, views, {"busy": 5.0, "idle": 1.0})
    assert plan.drain == ("idle",) and not plan.create
    old = make_spec(decode=1, blockSize=32)
    views.append(pod_view(served_pod("decode", "stale", "127.0.0.4", old, gate=True)))
    plan = pods_plan(spec, views, {"busy": 5.0, "idle": 0.0, "stale": 9.0})
    assert set(plan.drain) == {"stale", "idle"}
    # Draining pods no longer count: nothing more to do while they drain.
    draining = views_of(served_pod("prefill", "p", "127.0.0.9", spec),
                        served_pod("decode", "busy", "127.0.0.2", spec, gate=True),
                        served_pod("decode", "idle", "127.0.0.3", spec, draining="2025-01-01T00:00:00Z"))
    assert pods_plan(spec, draining).empty


def spec_with_decode_args(*args: str, decode: int = 1) -> ClusterSpec:
    return parse_spec({"model": {"source": "m"}, "prefill": {"replicas": 1},
                       "decode": {"replicas": decode, "args": list(args)}})


def test_a_template_change_rolls_one_pod_at_a_time_never_below_replicas(served_pod: Pod) -> None:
    old, new = spec_with_decode_args(decode=2), spec_with_decode_args("--seed", "7", decode=2)
    pods = {"p": served_pod("prefill", "p", "127.0.0.9", new, gate=True),
            "a": served_pod("decode", "a", "127.0.0.2", old, gate=True, created="2025-01-01T00:00:01Z"),
            "b": served_pod("decode", "b", "127.0.0.3", old, gate=True, created="2025-01-01T00:00:02Z")}

    def step(load: dict[str, float] | None = None) -> PodPlan:
        return pods_plan(new, views_of(*pods.values()), load)

    # One pod above replicas, from the new template; nothing drains while it is not serving.
    plan = step()
    assert [r for r, _ in plan.create] == ["decode"] and not plan.drain
    (_, c_name), = plan.create
    pods["c"] = served_pod("decode", c_name, "127.0.0.4", new, ready=False)
    assert step().empty
    # Once it serves, the less busy old pod drains; no second new pod until then.
    pods["c"] = served_pod("decode", c_name, "127.0.0.4", new, gate=True)
    assert step({"a": 3.0, "b": 1.0}) == PodPlan(drain=("b",))
    pods["b"] = served_pod("decode", "b", "127.0.0.3", old, gate=True, draining="2025-01-01T00:01:00Z")
    plan = step()
    assert [r for r, _ in plan.create] == ["decode"] and not plan.drain
    (_, d_name), = plan.create
    pods["d"] = served_pod("decode", d_name, "127.0.0.5", new, gate=True)
    assert step() == PodPlan(drain=("a",))
    del pods["a"], pods["b"]
    assert step().empty


def test_an_outdated_pod_that_does_not_serve_goes_without_waiting(served_pod: Pod) -> None:
    old, new = spec_with_decode_args(), spec_with_decode_args("--seed", "7")
    views = views_of(served_pod("prefill", "p", "127.0.0.9", new, gate=True),
                     served_pod("decode", "crashing", "127.0.0.2", old, ready=False),
                     served_pod("decode", "fresh", "127.0.0.3", new, ready=False))
    assert pods_plan(new, views) == PodPlan(drain=("crashing",))


def test_links_pair_every_decode_with_every_prefill_on_the_decode(make_spec: Callable[..., ClusterSpec],
                                                                  served_pod: Pod) -> None:
    spec = make_spec(prefill=2, decode=2)
    # p1's /ready waits for a link, but its /health said its model is loaded; d2 is still loading.
    views = with_loaded(views_of(served_pod("prefill", "p1", "127.0.0.11", spec, ready=False),
                                 served_pod("prefill", "p2", "127.0.0.12", spec),
                                 served_pod("decode", "d1", "127.0.0.21", spec),
                                 served_pod("decode", "d2", "127.0.0.22", spec, ready=False)), {"uid-p1/0"})
    plan = plan_links(views, LinkGraph(), now=0.0)
    assert plan.desired == {("d1", "p1"), ("d1", "p2")}
    ops = dict(plan.link)
    assert ops[("d1", "p1")] == LinkOp(True, Endpoint("d1", "uid-d1/0", "127.0.0.21"),
                                       Endpoint("p1", "uid-p1/0", "127.0.0.11"))
    info = ops[("d1", "p1")].payload.cluster_info()
    assert info.instance_name == "127.0.0.11:7777"
    assert list(info.cluster_ids) == [(127 << 24 | 11) << 32 | 26000]
    assert list(info.addrs) == ["127.0.0.11:26000"] and info.dp_size == 1


def test_links_are_made_once_then_only_reasserted_on_request(spec: ClusterSpec, served_pod: Pod) -> None:
    views = views_of(served_pod("prefill", "p", "127.0.0.11", spec), served_pod("decode", "d", "127.0.0.21", spec))
    graph = LinkGraph()
    link_all(graph, views)
    assert not plan_links(views, graph, now=1.0).link
    assert len(plan_links(views, graph, now=1.0, reassert=True).link) == 1


def test_a_failed_reassert_keeps_the_link_and_the_gates(spec: ClusterSpec, served_pod: Pod) -> None:
    views = views_of(served_pod("prefill", "p", "127.0.0.11", spec, gate=True),
                     served_pod("decode", "d", "127.0.0.21", spec, gate=True))
    graph = LinkGraph()
    link_all(graph, views)
    plan = plan_links(views, graph, now=60.0, reassert=True)
    ((pair, op),) = plan.link
    graph.record_link(pair, LinkResult(op, False, "DEADLINE_EXCEEDED: busy", 0.0), now=60.0,
                      observed=plan.observed[pair])
    assert graph.established(pair, op.target, op.payload), "a timed-out re-assert says nothing of the link"
    assert not plan_gates(views, graph, plan.desired), "both pods stay routed"
    assert not plan_links(views, graph, now=60.2, reassert=True).link, "tried again after the backoff"
    plan = plan_links(views, graph, now=60.5)
    ((pair, op),) = plan.link  # without waiting for the next re-assert
    graph.record_link(pair, LinkResult(op, True, "", 0.0), now=60.5, observed=plan.observed[pair])
    assert not graph.failures and not plan_links(views, graph, now=61.0).link
    # A worker that restarted is a new incarnation: its failed link is no edge.
    restarted = views_of(served_pod("prefill", "p", "127.0.0.11", spec, gate=True, restarts=1),
                         served_pod("decode", "d", "127.0.0.21", spec, gate=True))
    plan = plan_links(restarted, graph, now=61.0)
    ((pair, op),) = plan.link
    graph.record_link(pair, LinkResult(op, False, "UNAVAILABLE: refused", 0.0), now=61.0,
                      observed=plan.observed[pair])
    assert pair not in graph.edges


def test_a_pod_is_linkable_once_its_worker_has_loaded_its_model(spec: ClusterSpec, served_pod: Pod) -> None:
    loading = views_of(served_pod("prefill", "p", "127.0.0.11", spec, ready=False),
                       served_pod("decode", "d", "127.0.0.21", spec, ready=False))
    # Running, not ready, and /health not asked yet: no link attempt (it would fail and back off).
    assert all(v.awaits_model and not v.can_link for v in loading)
    assert not plan_links(loading, LinkGraph(), now=0.0).desired
    # The decode's readiness probe passes once it has loaded; a prefill's /ready waits for a link.
    decode_ready = views_of(served_pod("prefill", "p", "127.0.0.11", spec, ready=False),
                            served_pod("decode", "d", "127.0.0.21", spec))
    assert not plan_links(decode_ready, LinkGraph(), now=0.0).desired
    both = with_loaded(decode_ready, {"uid-p/0"})
    assert [v.awaits_model for v in both] == [False, False]
    assert [pair for pair, _ in plan_links(both, LinkGraph(), now=0.0).link] == [("d", "p")]
    # A restarted worker is a new incarnation: what its predecessor said no longer counts.
    restarted = with_loaded(views_of(served_pod("prefill", "p", "127.0.0.11", spec, ready=False, restarts=1),
                                     served_pod("decode", "d", "127.0.0.21", spec)), {"uid-p/0"})
    assert restarted[0].awaits_model and not plan_links(restarted, LinkGraph(), now=0.0).desired
    # Draining or terminating pods are not asked.
    assert not pod_view(served_pod("decode", "d", "127.0.0.21", spec, ready=False, deleting=True)).awaits_model


def fail(graph: LinkGraph, views: list[PodView], now: float) -> tuple[str, str]:
    """Plan the single link of `views` at `now` and record it as refused."""
    plan = plan_links(views, graph, now=now)
    ((pair, op),) = plan.link
    graph.record_link(pair, LinkResult(op, False, "UNAVAILABLE: refused", 0.0), now=now, observed=plan.observed[pair])
    return pair


def test_failed_links_back_off(spec: ClusterSpec, served_pod: Pod) -> None:
    views = views_of(served_pod("prefill", "p", "127.0.0.11", spec), served_pod("decode", "d", "127.0.0.21", spec))
    graph = LinkGraph()
    pair = fail(graph, views, now=0.0)
    assert not plan_links(views, graph, now=0.4).link  # backoff: 0.5 s, then 1 s
    fail(graph, views, now=0.5)
    assert graph.failures[pair].attempts == 2
    assert not plan_links(views, graph, now=1.4).link
    assert plan_links(views, graph, now=1.5).link


def test_a_change_of_either_pod_restarts_the_backoff(spec: ClusterSpec, served_pod: Pod) -> None:
    loaded = {"uid-p/0", "uid-p/1"}
    views = with_loaded(views_of(served_pod("prefill", "p", "127.0.0.11", spec, ready=False),
                                 served_pod("decode", "d", "127.0.0.21", spec)), loaded)
    graph = LinkGraph()
    for now in (0.0, 0.5, 1.5):
        pair = fail(graph, views, now=now)
    assert graph.failures[pair].attempts == 3 and not plan_links(views, graph, now=2.0).link  # due at 3.5
    # The prefill turns ready (it was linked to another decode meanwhile): tried at once...
    ready = views_of(served_pod("prefill", "p", "127.0.0.11", spec), served_pod("decode", "d", "127.0.0.21", spec))
    fail(graph, ready, now=2.0)
    # ...and a failure now backs off from the base again.
    assert graph.failures[pair].attempts == 1 and graph.failures[pair].next_due == 2.5
    assert not plan_links(ready, graph, now=2.4).link
    # A restart of the prefill (a new incarnation, loaded again) is a change too.
    restarted = with_loaded(views_of(served_pod("prefill", "p", "127.0.0.11", spec, ready=False, restarts=1),
                                     served_pod("decode", "d", "127.0.0.21", spec)), loaded)
    assert [op.payload.incarnation for _, op in plan_links(restarted, graph, now=2.1).link] == ["uid-p/1"]


def test_dead_or_restarted_peers_are_unlinked_on_the_side_still_alive(spec: ClusterSpec, served_pod: Pod) -> None:
    p, d = served_pod("prefill", "p", "127.0.0.11", spec), served_pod("decode", "d", "127.0.0.21", spec)
    graph = LinkGraph()
    link_all(graph, views_of(p, d))
    dying = views_of(served_pod("prefill", "p", "127.0.0.11", spec, deleting=True), d)
    plan = plan_links(dying, graph, now=0.0)
    ((pair, ops),) = plan.unlink
    assert pair == ("d", "p") and [(o.link, o.target.pod, o.payload.pod) for o in ops] == [(False, "d", "p")]
    assert not plan.link and not plan.desired
    # A restarted decode forgot its links: unlink its old incarnation from the prefill, link it again.
    restarted = views_of(p, served_pod("decode", "d", "127.0.0.21", spec, restarts=1))
    plan = plan_links(restarted, graph, now=0.0)
    assert [o.target.pod for _, ops in plan.unlink for o in ops] == ["p"]
    assert [op.target.incarnation for _, op in plan.link] == ["uid-d/1"]


def test_layout_mismatch_never_links(make_spec: Callable[..., ClusterSpec], served_pod: Pod) -> None:
    new = make_spec(blockSize=32)
    views = views_of(served_pod("prefill", "p", "127.0.0.11", make_spec()), served_pod("decode", "d", "127.0.0.21", new))
    plan = plan_links(views, LinkGraph(), now=0.0)
    assert not plan.link and not plan.desired
    assert [(d, p) for d, _, p, _ in plan.mismatched] == [("d", "p")]


def test_gates_open_when_all_links_are_made_and_close_on_drain(spec: ClusterSpec, served_pod: Pod,
                                                              make_spec: Callable[..., ClusterSpec]) -> None:
    views = views_of(served_pod("prefill", "p", "127.0.0.11", spec), served_pod("decode", "d", "127.0.0.21", spec))
    graph = LinkGraph()
    desired = plan_links(views, graph, now=0.0).desired
    assert plan_gates(views, graph, desired) == []  # nothing linked yet: both stay closed
    link_all(graph, views)
    assert {(f.pod, f.linked) for f in plan_gates(views, graph, desired)} == {("p", True), ("d", True)}
    # A new decode being linked does not take the serving prefill out of routing.
    two = views_of(served_pod("prefill", "p", "127.0.0.11", spec, gate=True),
                   served_pod("decode", "d", "127.0.0.21", spec, gate=True),
                   served_pod("decode", "d2", "127.0.0.22", spec))
    assert plan_gates(two, graph, plan_links(two, graph, now=0.0).desired) == []
    link_all(graph, two)
    drained = views_of(served_pod("prefill", "p", "127.0.0.11", spec, gate=True),
                       served_pod("decode", "d", "127.0.0.21", spec, gate=True, draining="2025-01-01T00:00:00Z"),
                       served_pod("decode", "d2", "127.0.0.22", spec, gate=True))
    flips = plan_gates(drained, graph, plan_links(drained, graph, now=0.0).desired)
    assert [(f.pod, f.linked, f.reason) for f in flips] == [("d", False, "Draining")]
    # With its last decode draining, a prefill cannot serve: it leaves routing too.
    alone = views_of(served_pod("prefill", "p", "127.0.0.11", spec, gate=True),
                     served_pod("decode", "d", "127.0.0.21", spec, gate=True, draining="2025-01-01T00:00:00Z"))
    flips = plan_gates(alone, graph, plan_links(alone, graph, now=0.0).desired)
    assert {(f.pod, f.reason) for f in flips} == {("p", "NotLinked"), ("d", "Draining")}
