"""How fast the operator's link manager links clusters of growing size.

Each decode is a minimal stand-in `DisaggPDService` server that records
LinkInstance calls (used only for this scale measurement; the e2e tests use
real workers) on its own loopback address. The operator's real planner
(reconcile.plan_links) and gRPC client (links.LinkClient) link every decode
with every prefill, in passes, until the graph is complete.

    .venv/bin/python benchmarks/bench_operator.py --sizes 2 5 10 20 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc

from disagg.operator.links import LinkClient, LinkGraph
from disagg.operator.reconcile import PodView, plan_links
from disagg.proto import common_pb2, disagg_pd_pb2, disagg_pd_pb2_grpc


class Recorder(disagg_pd_pb2_grpc.DisaggPDServiceServicer):
    def __init__(self) -> None:
        self.linked: set[str] = set()

    async def LinkInstance(self, request: disagg_pd_pb2.InstanceClusterInfo, context: object) -> common_pb2.Status:
        self.linked.add(request.instance_name)
        return common_pb2.Status(ok=True)


def view(role: str, i: int, ip: str) -> PodView:
    return PodView(name=f"{role}-{i}", uid=f"u-{role}-{i}", role=role, layout="L", ip=ip, phase="Running",
                   running=True, containers_ready=True, gate=False, restarts=0, deleting=False,
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
            graph.record_link(pair, result, time.monotonic())
    seconds = time.perf_counter() - began
    assert len(graph.edges) == n * n and all(len(r.linked) == n for r in recorders), "not fully linked"
    await client.close()
    await asyncio.gather(*(s.stop(None) for s in servers))
    return seconds, passes, client.calls


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
    args = p.parse_args()
    asyncio.run(main(args.sizes, args.repeats))
