"""The PD clients: the decode's relay to a prefill (outputs of many requests share one
Generations call), and channels to peers that come back at the same address."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.local import free_port
from disagg.workers.pd.clients import PeerClients, _Coalescer
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.errors import PeerUnavailable


def _out(req_id: str) -> RequestOutput:
    return RequestOutput(req_id, [7], "x", False, None, 3, 1)


class _Prefill:
    """Records each call; answers `tracked` for every request but "gone"; the first call waits for `release`."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail = fail

    async def send(self, outputs: list[RequestOutput]) -> list[bool]:
        self.calls.append([o.request_id for o in outputs])
        if len(self.calls) == 1:
            await asyncio.wait_for(self.release.wait(), 5.0)
        if self.fail:
            raise PeerUnavailable("prefill down")
        return [o.request_id != "gone" for o in outputs]


def test_outputs_queued_during_a_call_go_out_in_the_next_one() -> None:
    async def run() -> None:
        prefill = _Prefill()
        relay = _Coalescer(prefill.send)
        first = asyncio.create_task(relay.submit([_out("a")]))
        await asyncio.sleep(0.01)  # "a" is in flight
        rest = [asyncio.create_task(relay.submit([_out(r)])) for r in ("b", "gone", "c")]
        cancelled = asyncio.create_task(relay.submit([_out("late")]))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        prefill.release.set()
        assert await asyncio.wait_for(first, 5.0) == [True]
        assert await asyncio.wait_for(asyncio.gather(*rest), 5.0) == [[True], [False], [True]]
        assert prefill.calls == [["a"], ["b", "gone", "c"]]  # one call for three requests; none for the cancelled

    asyncio.run(run())


def test_a_failed_call_fails_each_of_its_callers() -> None:
    async def run() -> None:
        prefill = _Prefill(fail=True)
        relay = _Coalescer(prefill.send)
        calls = [asyncio.create_task(relay.submit([_out(r)])) for r in ("a", "b")]
        prefill.release.set()
        for call in calls:
            with pytest.raises(PeerUnavailable, match="prefill down"):
                await asyncio.wait_for(call, 5.0)
        assert prefill.calls == [["a", "b"]]

    asyncio.run(run())


async def _health_server(address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    assert server.add_insecure_port(address)
    await server.start()
    return server


async def test_a_peer_back_at_its_address_answers_at_once_once_renewed() -> None:
    """A pod restarted at its address: the call that failed while it was down left the channel
    backing off, failing every call at once; `renew` on the new link gives a fresh one."""
    address = f"127.0.0.1:{free_port()}"
    clients = PeerClients(PDConfig(), None)
    server = await _health_server(address)
    try:
        assert await clients.answers(address, 2.0)
        await server.stop(None)
        assert not await clients.answers(address, 2.0)  # down: the channel backs off (1 s at first)
        server = await _health_server(address)
        assert not await clients.answers(address, 2.0), "the backing-off channel fails at once"
        clients.renew(address)
        assert await clients.answers(address, 2.0)
        clients.renew(address)  # a channel that works is kept
        assert await clients.answers(address, 2.0)
    finally:
        await server.stop(None)
        await clients.close()
