"""The gRPC client side of the PD flow: one cached channel per peer, a
deadline on every call, and gRPC failures turned into the roles' errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg.proto import common_pb2, disagg_pd_pb2 as pb, disagg_pd_pb2_grpc, xllm_service_pb2_grpc
from disagg.workers import tracing
from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.pd import convert
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.errors import (InvalidMessage, PDError, PeerTimeout, PeerUnavailable, RequestRefused,
                                     UnknownRequest, WrongRole)
from disagg.workers.pd.messages import FirstToken, NewRequest, Reservation
from disagg.workers.security.control import control_channel, is_backing_off
from disagg.workers.security.key import ClusterKey

_ERRORS: dict[grpc.StatusCode, type[PDError]] = {
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerTimeout,
    grpc.StatusCode.NOT_FOUND: UnknownRequest,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidMessage,
    grpc.StatusCode.FAILED_PRECONDITION: WrongRole,
}


def rpc_error(peer: str, exc: grpc.aio.AioRpcError) -> PDError:
    """The role error for a failed call to `peer`, with gRPC's reason in it."""
    cls = _ERRORS.get(exc.code(), PeerUnavailable)
    return cls(f"{peer}: {exc.code().name}: {exc.details()}")


class _Coalescer:
    """Outputs bound for one prefill, from every request streaming to it, go
    out together: one Generations call at a time, carrying everything queued
    while the previous one was in flight.

    One call per request per token cost the decode's event loop as much CPU
    as its engine step at 32 concurrent requests (docs/benchmarks.md).
    """

    def __init__(self, send: Callable[[list[RequestOutput]], Awaitable[list[bool]]]) -> None:
        self._send = send
        self._queue: list[tuple[list[RequestOutput], asyncio.Future[list[bool]]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def submit(self, outputs: list[RequestOutput]) -> list[bool]:
        future: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        self._queue.append((outputs, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let the other requests of this engine step queue theirs first
        while self._queue:
            batch = [(outs, f) for outs, f in self._queue if not f.done()]  # skip callers that were cancelled
            self._queue = []
            try:
                tracked = await self._send([o for outs, _ in batch for o in outs])
            except Exception as exc:  # PDError, or a bug: each caller gets it, none waits forever
                for _, f in batch:
                    if not f.done():
                        f.set_exception(exc)
                continue
            start = 0
            for outs, f in batch:
                if not f.done():
                    f.set_result(tracked[start:start + len(outs)])
                start += len(outs)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        for _, f in self._queue:
            f.cancel()
        self._queue = []


# What a peer that did not answer gives: it is not there, or not responding.
_SILENT = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class PeerClients:
    """Every call carries a credential of `key` (None: none, --insecure), over TLS with `tls` (None: plaintext)."""

    def __init__(self, config: PDConfig, key: ClusterKey | None, tls: grpc.ChannelCredentials | None = None) -> None:
        self._config = config
        self._key = key
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._coalescers: dict[str, _Coalescer] = {}
        self._closing: set[asyncio.Task[None]] = set()  # retired channels' close calls

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            limit = self._config.max_message_bytes
            self._channels[address] = control_channel(
                address, self._key,
                [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
                 *convert.METADATA_OPTIONS], self._tls,
            )
        return self._channels[address]

    def renew(self, address: str) -> None:
        """A peer just linked at `address`: drop a cached channel that is backing off
        (`is_backing_off`), or the new incarnation would look dead until the backoff ends."""
        channel = self._channels.get(address)
        if channel is None or not is_backing_off(channel):
            return
        del self._channels[address]
        task = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def add_new_requests(self, decode: str, prefill_name: str, reqs: list[NewRequest]) -> list[Reservation]:
        """The decode's reservations; RequestRefused when the requests' extras pass the metadata bound
        (no decode could take them: never retried)."""
        stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(self._channel(decode))
        msg = pb.DisaggRequests(prefill_name=prefill_name, reqs=[convert.request_to_proto(r) for r in reqs])
        try:
            metadata = convert.sampling_extras_metadata(reqs) + convert.PREFIX_REUSE_METADATA
        except ValueError as exc:
            raise RequestRefused(str(exc)) from exc
        try:
            with tracing.client_call(convert.PD_SERVICE, "AddNewRequests", decode) as trace_context:
                call = stub.AddNewRequests(msg, timeout=self._config.rpc_timeout_s, metadata=metadata + trace_context)
                answer = await call
                trailing = await call.trailing_metadata()
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(decode, exc) from exc
        if len(answer.resps) != len(reqs):
            raise PeerUnavailable(f"{decode} answered {len(answer.resps)} of {len(reqs)} requests")
        try:
            return convert.with_cached_blocks([convert.reservation_from_proto(r) for r in answer.resps],
                                              trailing or ())
        except ValueError as exc:
            raise PeerUnavailable(f"{decode} answered AddNewRequests wrongly: {exc}") from exc

    async def first_generation(self, decode: str, first: FirstToken) -> None:
        stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(self._channel(decode))
        msg = pb.DisaggGenerationsRequests(multi_gens=[convert.first_token_to_proto(first)])
        try:
            with tracing.client_call(convert.PD_SERVICE, "FirstGeneration", decode) as trace_context:
                status = await stub.FirstGeneration(msg, timeout=self._config.first_generation_timeout_s,
                                                    metadata=trace_context)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(decode, exc) from exc
        if not status.ok:
            raise PeerUnavailable(f"{decode} answered FirstGeneration of {first.req_id} with ok=false")

    async def cancel(self, decode: str, req_id: str) -> None:
        """Make a decode free a reservation whose FirstGeneration will never come.

        The protocol has no cancel call: a FirstGeneration without a token is
        invalid, and a decode frees the blocks of any request whose
        FirstGeneration it refuses.
        """
        stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(self._channel(decode))
        msg = pb.DisaggGenerationsRequests(multi_gens=[pb.DisaggGenerationsRequest(req_id=req_id)])
        try:
            await stub.FirstGeneration(msg, timeout=self._config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise rpc_error(decode, exc) from exc

    async def answers(self, address: str, timeout_s: float) -> bool:
        """Whether the worker at `address` answers a gRPC health check within `timeout_s`. Any answer
        but a missed deadline or a lost connection counts: a peer without the health service
        (an xLLM decode says UNIMPLEMENTED) is alive too."""
        stub = health_pb2_grpc.HealthStub(self._channel(address))
        try:
            answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code() not in _SILENT
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    async def generations(self, prefill: str, outputs: list[RequestOutput]) -> list[bool]:
        """Stream outputs to their prefill, together with other requests' (`_Coalescer`); for each, whether it
        still tracks the request."""
        if prefill not in self._coalescers:
            self._coalescers[prefill] = _Coalescer(lambda batch: self._generations(prefill, batch))
        return await self._coalescers[prefill].submit(outputs)

    async def _generations(self, prefill: str, outputs: list[RequestOutput]) -> list[bool]:
        stub = xllm_service_pb2_grpc.XllmRpcServiceStub(self._channel(prefill))
        msg = pb.DisaggStreamGenerations(gens=[convert.output_to_proto(o) for o in outputs])
        try:
            answer = await stub.Generations(msg, timeout=self._config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(prefill, exc) from exc
        statuses: list[common_pb2.Status] = list(answer.all_status)
        if len(statuses) != len(outputs):
            raise PeerUnavailable(f"{prefill} answered {len(statuses)} statuses for {len(outputs)} outputs")
        return [s.ok for s in statuses]

    async def close(self) -> None:
        for coalescer in self._coalescers.values():
            coalescer.close()
        self._coalescers.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await asyncio.gather(*self._closing)
