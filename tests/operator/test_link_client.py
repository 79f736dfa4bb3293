"""The operator's link client against a real gRPC server on loopback: the order of a pass's RPCs,
and a worker restarted at its address."""

from __future__ import annotations

import asyncio
import time

import grpc

from disagg.operator.link_client import LinkClient
from disagg.operator.links import Endpoint, LinkOp
from disagg.proto import common_pb2, disagg_pd_pb2, disagg_pd_pb2_grpc
from disagg.workers.local import free_port

UNLINK_S = 0.5  # how long the worker takes to answer an unlink


class _Recorder(disagg_pd_pb2_grpc.DisaggPDServiceServicer):
    """A worker's link calls, as (method, payload's instance name, start, end)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, float]] = []

    async def LinkInstance(self, request: disagg_pd_pb2.InstanceClusterInfo, context: grpc.aio.ServicerContext
                           ) -> common_pb2.Status:
        now = time.monotonic()
        self.calls.append(("link", request.instance_name, now, now))
        return common_pb2.Status(ok=True)

    async def UnlinkInstance(self, request: disagg_pd_pb2.InstanceClusterInfo, context: grpc.aio.ServicerContext
                             ) -> common_pb2.Status:
        began = time.monotonic()
        await asyncio.sleep(UNLINK_S)
        self.calls.append(("unlink", request.instance_name, began, time.monotonic()))
        return common_pb2.Status(ok=True)


def test_a_pairs_link_waits_for_its_unlinks_and_other_pairs_do_not() -> None:
    """A restarted decode keeps its address: the unlink of its old incarnation (sent to the prefill)
    must be answered before the new one is linked, or the prefill would drop the new link."""

    async def run() -> tuple[dict[tuple[str, str], tuple[float, float]], list[bool], list[bool]]:
        recorder = _Recorder()
        server = grpc.aio.server()
        disagg_pd_pb2_grpc.add_DisaggPDServiceServicer_to_server(recorder, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = LinkClient(timeout_s=5.0)
        try:
            # Every op goes to the one server, at the prefill's address; the payloads tell them apart.
            prefill = Endpoint("p-0", "uid-p/0", "127.0.0.1", grpc_port=port)
            old_decode = Endpoint("d-0", "uid-d/0", "127.0.0.2", grpc_port=port)
            new_decode = Endpoint("d-0", "uid-d/1", "127.0.0.2", grpc_port=port)
            other_decode = Endpoint("d-1", "uid-e/0", "127.0.0.3", grpc_port=port)
            unlinks, links = await client.run_pairs(
                [(("d-0", "p-0"), [LinkOp(False, prefill, old_decode)])],
                [(("d-0", "p-0"), LinkOp(True, prefill, new_decode)),
                 (("d-1", "p-0"), LinkOp(True, prefill, other_decode))])
            pods = {e.instance_name: e.pod for e in (old_decode, other_decode)}
            calls = {(method, pods[name]): (began, ended) for method, name, began, ended in recorder.calls}
            return calls, [r.ok for r in unlinks], [r.ok for r in links]
        finally:
            await client.close()
            await server.stop(None)

    calls, unlinks_ok, links_ok = asyncio.run(run())
    assert unlinks_ok == [True] and links_ok == [True, True]
    unlink_began, unlink_ended = calls[("unlink", "d-0")]
    assert unlink_ended - unlink_began >= UNLINK_S * 0.9
    assert calls[("link", "d-0")][0] >= unlink_ended, "the restarted decode was linked before its old self was unlinked"
    assert calls[("link", "d-1")][0] < unlink_ended, "a pair with nothing to unlink waited for another pair's unlink"


def test_a_worker_back_at_its_address_is_linked_at_once() -> None:
    """A link that failed while the worker was down left its channel backing off, failing every
    call at once; the next call, once the worker is back, gets a fresh channel and goes through."""

    async def serve(address: str) -> grpc.aio.Server:
        server = grpc.aio.server()
        disagg_pd_pb2_grpc.add_DisaggPDServiceServicer_to_server(_Recorder(), server)
        assert server.add_insecure_port(address)
        await server.start()
        return server

    async def run() -> list[bool]:
        port = free_port()
        decode = Endpoint("d-0", "uid-d/0", "127.0.0.1", grpc_port=port)
        link = LinkOp(True, decode, Endpoint("p-0", "uid-p/0", "127.0.0.2", grpc_port=port))
        client = LinkClient(timeout_s=5.0)
        server = await serve(f"127.0.0.1:{port}")
        try:
            results = [(await client.call(link)).ok]
            await server.stop(None)
            results.append((await client.call(link)).ok)  # down
            server = await serve(f"127.0.0.1:{port}")
            results.append((await client.call(link)).ok)  # back, well within the channel's 1 s backoff
            return results
        finally:
            await client.close()
            await server.stop(None)

    assert asyncio.run(run()) == [True, False, True]
