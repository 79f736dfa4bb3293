"""How fast the operator links pods: real workers on a 2x2 cluster, and the
link manager alone on clusters of growing size.

Real workers (`--real-repeats`, 0 skips it): the test control plane and local
kubelet (disagg.testing) run `disagg serve` on a tiny random model; the
operator's controller runs in this process, paced as the operator's daemon
paces it: a pass runs when a pod changed (the pod list, read at 20 Hz, stands
for the operator's pod watch) or when the delay the last pass asked for has
run out. Printed: the time from a worker having loaded its model (its /ready
no longer says "the model is loading"; a prefill's /ready then waits for a
link) to its readiness gate being True, median and p99 over every pod; and
the Kubernetes API calls, link RPCs and worker HTTP calls (GET /health of
workers still loading) per reconcile pass while the cluster comes up.

Scale (the stand-ins): each decode is a minimal stand-in `DisaggPDService` server that records
LinkInstance calls (used only for this scale measurement; the e2e tests use
real workers) on its own loopback address. The operator's real planner
(reconcile.plan_links) and gRPC client (link_client.LinkClient) link every decode
with every prefill, in passes, until the graph is complete.

    .venv/bin/python benchmarks/bench_operator.py --real-repeats 3 --sizes 2 5 10 20 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import grpc
import httpx
import kopf
from kubernetes import client, config

from disagg.operator import crd
from disagg.operator import manifests as m
from disagg.operator.controller import ClusterController, Deps
from disagg.operator.graph import LinkGraph
from disagg.operator.kube import KubeApi
from disagg.operator.link_client import LinkClient
from disagg.operator.metrics import OperatorMetrics
from disagg.operator.reconcile import PodView, plan_links, pod_view
from disagg.operator.settings import OperatorSettings
from disagg.operator.spec import ROLES
from disagg.testing.cluster import LocalCluster, create_namespace
from disagg.testing.kubectl import install_crd
from disagg.testing.tiny_model import build_tiny_model
from disagg.proto import common_pb2, disagg_pd_pb2, disagg_pd_pb2_grpc


class Recorder(disagg_pd_pb2_grpc.DisaggPDServiceServicer):
    def __init__(self) -> None:
        self.linked: set[str] = set()

    async def LinkInstance(self, request: disagg_pd_pb2.InstanceClusterInfo, context: object) -> common_pb2.Status:
        self.linked.add(request.instance_name)
        return common_pb2.Status(ok=True)


def view(role: str, i: int, ip: str) -> PodView:
    return PodView(name=f"{role}-{i}", uid=f"u-{role}-{i}", role=role, layout="L", template="T", ip=ip,
                   phase="Running", running=True, containers_ready=True, gate=False, restarts=0, deleting=False,
                   draining_since=None, created="")


async def link_cluster(n: int, base: int) -> tuple[float, int, int]:
    """Seconds, passes and RPCs to link n decodes with n prefills."""
    servers, recorders = [], []
    for i in range(n):
        server = grpc.aio.server()
        rec = Recorder()
        disagg_pd_pb2_grpc.add_DisaggPDServiceServicer_to_server(rec, server)
        server.add_insecure_port(f"127.{base}.0.{i + 1}:7777")
        await server.start()
        servers.append(server)
        recorders.append(rec)
    views = [view("decode", i, f"127.{base}.0.{i + 1}") for i in range(n)]
    views += [view("prefill", i, f"127.{base}.1.{i + 1}") for i in range(n)]
    client, graph = LinkClient(timeout_s=5.0), LinkGraph()
    began, passes = time.perf_counter(), 0
    while True:
        plan = plan_links(views, graph, time.monotonic())
        if not plan.link:
            break
        passes += 1
        results = await client.run([op for _, op in plan.link])
        for (pair, _), result in zip(plan.link, results):
            graph.record_link(pair, result, time.monotonic(), plan.observed[pair])
    seconds = time.perf_counter() - began
    assert len(graph.edges) == n * n and all(len(r.linked) == n for r in recorders), "not fully linked"
    await client.close()
    await asyncio.gather(*(s.stop(None) for s in servers))
    return seconds, passes, client.calls


# ---- real workers ----------------------------------------------------------

SETTLE_S = 300.0


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class PodClock:
    """Polls every worker pod (20 Hz) for when its model was loaded and when its gate went True."""

    def __init__(self, core: client.CoreV1Api, namespace: str) -> None:
        self.core, self.namespace = core, namespace
        self.loaded: dict[str, float] = {}
        self.linked: dict[str, float] = {}
        self.roles: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=1.0) as http:
            while not self._stop.wait(0.05):
                items = self.core.list_namespaced_pod(self.namespace, label_selector=m.CLUSTER_LABEL,
                                                      _request_timeout=10).items
                now = time.monotonic()
                for pod in items:
                    assert pod.metadata is not None and pod.status is not None, "the API serves both"
                    name, ip = str(pod.metadata.name), pod.status.pod_ip
                    self.roles[name] = (pod.metadata.labels or {}).get(m.ROLE_LABEL, "")
                    gate = any(c.type == m.LINKED_GATE and c.status == "True" for c in pod.status.conditions or [])
                    if gate and name not in self.linked:
                        self.linked[name] = now
                    if ip and name not in self.loaded:
                        try:
                            r = http.get(f"http://{ip}:{m.HTTP_PORT}/ready")
                        except httpx.HTTPError:
                            continue
                        if r.status_code == 200 or "loading" not in r.text:
                            self.loaded[name] = time.monotonic()

    def stop(self) -> list[float]:
        """Seconds from linkable (its model loaded, and a peer's) to linked, per pod."""
        self._stop.set()
        self._thread.join(timeout=10)
        out = []
        for name, linked in self.linked.items():
            peers = [t for n, t in self.loaded.items() if self.roles[n] != self.roles[name]]
            if name in self.loaded and peers:
                out.append(linked - max(self.loaded[name], min(peers)))
        return out


async def bring_up(cluster: LocalCluster, api: client.ApiClient, model: Path, prefill: int,
                   decode: int) -> tuple[list[float], list[tuple[int, int, int]], int]:
    """Create a DisaggCluster and reconcile until every pod is linked: (linkable-to-linked
    seconds per pod, (API calls, link RPCs, worker HTTP calls) of each pass, failed link RPCs)."""
    kube_admin = cluster.kube(admin=True)
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    create_namespace(kube_admin, namespace)
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    body = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": "llm"},
            "spec": {"model": {"source": str(model), "servedName": "tiny"}, "image": "local",
                     "prefill": {"replicas": prefill}, "decode": {"replicas": decode},
                     "engine": {"device": "cpu", "dtype": "float32", "blockSize": 4, "numKvBlocks": 128,
                                "maxNumSeqs": 4}}}
    custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, body, _request_timeout=10)
    kube = KubeApi(api)
    http_calls = 0

    async def count(_: httpx.Request) -> None:
        nonlocal http_calls
        http_calls += 1

    deps = Deps(settings=OperatorSettings(metrics_port=0), kube=kube, links=LinkClient(timeout_s=3.0),
                http=httpx.AsyncClient(timeout=2.0, event_hooks={"request": [count]}), metrics=OperatorMetrics(),
                post_event=lambda *_: None)
    controller = ClusterController(namespace, "llm", deps)
    clock = PodClock(core, namespace)
    passes: list[tuple[int, int, int]] = []  # (API calls, link RPCs, worker HTTP calls) per pass
    seen: list[tuple[str, str]] = []  # (name, resourceVersion) of the pods at the last pass
    delay, last, deadline = 0.0, 0.0, time.monotonic() + SETTLE_S
    try:
        while len(clock.linked) < prefill + decode:
            assert time.monotonic() < deadline, "the cluster did not link in time"
            pods = await asyncio.to_thread(core.list_namespaced_pod, namespace, label_selector=m.CLUSTER_LABEL,
                                           _request_timeout=10)
            items = api.sanitize_for_serialization(pods.items)
            versions = sorted((p["metadata"]["name"], p["metadata"]["resourceVersion"]) for p in items)
            if versions == seen and time.monotonic() - last < delay:
                await asyncio.sleep(0.05)  # no pod event, and the daemon would still be waiting
                continue
            seen = versions
            obj = await asyncio.to_thread(custom.get_namespaced_custom_object, crd.GROUP, crd.VERSION, namespace,
                                          crd.PLURAL, "llm", _request_timeout=10)
            views = [pod_view(p) for p in items]
            calls, rpcs, gets = kube.calls, deps.links.calls, http_calls
            delay = await controller.reconcile(kopf.Body(cast(kopf.RawBody, obj)), views)
            last = time.monotonic()
            # The pod list counts as one call: it stands for the operator's pod index (a watch).
            passes.append((kube.calls - calls + 1, deps.links.calls - rpcs, http_calls - gets))
    finally:
        seconds = clock.stop()
        await controller.stop()
        await deps.links.close()
        await deps.http.aclose()
        kube_admin.delete(f"/api/v1/namespaces/{namespace}")
        kube_admin.close()
    failed = deps.metrics.registry.get_sample_value("disagg_operator_link_operations_total",
                                                     {"operation": "link", "result": "error"})
    return seconds, passes, int(failed or 0)


async def real_workers(repeats: int, prefill: int, decode: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, LocalCluster() as cluster, \
            config.new_client_from_config(config_file=str(cluster.admin_kubeconfig)) as api:
        kube = cluster.kube(admin=True)
        for build in crd.FILES.values():  # the DisaggRole too: the operator makes one per role
            install_crd(kube, build())
        kube.close()
        model = build_tiny_model("llama", Path(tmp) / "tiny-llama")
        samples: list[float] = []
        passes: list[tuple[int, int, int]] = []
        failed = 0
        for _ in range(repeats):
            seconds, each, f = await bring_up(cluster, api, model, prefill, decode)
            samples, passes, failed = samples + seconds, passes + each, failed + f
        # A pass acted when it wrote to the API or sent a link RPC (beyond the pod list, the reads of the
        # DisaggRoles, one per role, and /health reads).
        acting = [(c, r) for c, r, _ in passes if c > 1 + len(ROLES) or r]
        calls, rpcs = [c for c, _ in acting], [r for _, r in acting]
        gets = [g for _, _, g in passes]
        print(f"real workers, {prefill}x{decode}, {repeats} bring-ups, {len(samples)} pods, "
              f"{repeats * prefill * decode} links:")
        print(f"  linkable (own model and a peer's loaded) -> gate True: median {statistics.median(samples):.3f} s, "
              f"p99 {percentile(samples, 0.99):.3f} s")
        print(f"  {len(passes)} passes, {len(acting)} of them acted; per acting pass: API calls median "
              f"{statistics.median(calls):.0f} max {max(calls)}, link RPCs median {statistics.median(rpcs):.0f} "
              f"max {max(rpcs)}; in all {sum(calls)} API calls, {sum(rpcs)} link RPCs ({failed} failed), "
              f"{sum(gets)} GET /health (max {max(gets)} in a pass); an idle pass: 1 call (the pod list)")


# ---- the link manager alone, at scale ----------------------------------------


async def main(sizes: list[int], repeats: int) -> None:
    print(f"{'size':>7} {'links':>6} {'median s':>9} {'p99 s':>8} {'passes':>6} {'RPCs':>5}")
    for k, n in enumerate(sizes):
        runs = [await link_cluster(n, 100 + (k * repeats + r) % 100) for r in range(repeats)]
        times = sorted(t for t, _, _ in runs)
        p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
        print(f"{n:>3}x{n:<3} {n * n:>6} {statistics.median(times):>9.4f} {p99:>8.4f} {runs[0][1]:>6} {runs[0][2]:>5}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 5, 10, 20])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--real-repeats", type=int, default=3, help="2x2 bring-ups with real workers (0: none)")
    args = p.parse_args()
    if args.real_repeats:
        asyncio.run(real_workers(args.real_repeats, 2, 2))
    asyncio.run(main(args.sizes, args.repeats))
