"""The gRPC edge of a PD worker: `DisaggPDService` (and, on the prefill,
`XllmRpcService.Generations`) over asyncio gRPC, plus xLLM's HTTP JSON form
of the link calls.

Protobuf is converted to the roles' types here; each role error maps to one
status code. A role registers only the handlers it has (`Handlers`); a
DisaggPDService method it lacks answers FAILED_PRECONDITION, and
XllmRpcService is served only by a role that takes Generations.
MultiGenerations and SendPullSignal (xLLM's online/offline co-location)
answer UNIMPLEMENTED and the server keeps serving.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from fastapi import FastAPI, Request
from grpc_health.v1 import health, health_pb2_grpc
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from disagg.proto import common_pb2, disagg_pd_pb2 as pb, disagg_pd_pb2_grpc, xllm_service_pb2_grpc
from disagg.proto.vocabulary import DESCRIBE_METHOD, InstanceInfo
from disagg.workers import tracing
from disagg.workers.engine.async_engine import EngineError
from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.http.edge import read_body
from disagg.workers.pd import convert, errors
from disagg.workers.pd.messages import Admission, FirstToken, NewRequest, Reservation
from disagg.workers.security.control import REFUSAL, AuthInterceptor, ControlGuard

log = logging.getLogger(__name__)

T = TypeVar("T")

# Each role error answers with exactly one gRPC status code.
STATUS_CODES: dict[type[errors.PDError], grpc.StatusCode] = {
    errors.InvalidMessage: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnknownRequest: grpc.StatusCode.NOT_FOUND,
    errors.WrongRole: grpc.StatusCode.FAILED_PRECONDITION,
    errors.LinkRefused: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PeerUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.PeerTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# ...and the same errors over HTTP.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
}


class Intake(Protocol):
    """A decode's handlers of a prefill's requests."""

    async def add_requests(self, prefill_name: str, reqs: list[NewRequest], reuse_prefix: bool = False
                           ) -> list[Reservation]:
        """Reserve blocks for each request; one answer per request, in order. `reuse_prefix`:
        the prefill skips blocks already held here, so cached prefix blocks may be shared."""
        ...

    async def first_generation(self, first: FirstToken) -> None:
        """Take in the KV (PULL) and start generating after the first token."""
        ...

    async def refuse_first(self, req_id: str, reason: str) -> None:
        """A malformed FirstGeneration: free the request it names, then raise InvalidMessage."""
        ...


LinkHandler = Callable[[InstanceInfo], Awaitable[None]]
UnlinkHandler = Callable[[str], Awaitable[None]]  # by instance name: an unlink needs nothing else


@dataclass(frozen=True)
class Handlers:
    """What one role serves over gRPC; None for what it lacks."""

    role: str  # named in the refusal of a method the role lacks
    unlink: UnlinkHandler
    link: LinkHandler | None = None  # links are made on the decode
    intake: Intake | None = None  # AddNewRequests and FirstGeneration (a decode)
    generations: Callable[[list[RequestOutput]], Awaitable[list[bool]]] | None = None  # a prefill

    def require_link(self) -> LinkHandler:
        if self.link is None:
            raise errors.WrongRole(f"this is a {self.role} instance; links are made on the decode: "
                                   "call LinkInstance on it with this instance's info")
        return self.link

    def require_intake(self, method: str) -> Intake:
        if self.intake is None:
            raise errors.WrongRole(f"this is a {self.role} instance; {method} goes to a decode")
        return self.intake


def status_code(exc: errors.PDError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


async def _answer(context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[T]]) -> T:
    """Run a role call; a role error aborts the RPC with its status code and reason."""
    try:
        return await call()
    except errors.PDError as exc:
        await context.abort(status_code(exc), str(exc))
        raise AssertionError("context.abort raises") from exc
    except EngineError as exc:  # the engine is stopped or stuck: another instance may serve
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise AssertionError("context.abort raises") from exc


class DisaggPDServicer(disagg_pd_pb2_grpc.DisaggPDServiceServicer):
    def __init__(self, handlers: Handlers) -> None:
        self._handlers = handlers

    async def AddNewRequests(self, request: pb.DisaggRequests, context: grpc.aio.ServicerContext) -> pb.DisaggResponses:
        intake = await _answer(context, self._require_intake("AddNewRequests"))
        reqs: list[NewRequest] = []
        answers: dict[int, Reservation] = {}
        for i, msg in enumerate(request.reqs):
            try:
                reqs.append(convert.request_from_proto(msg))
            except ValueError as exc:  # one bad request is answered 500; the others go on
                log.warning("AddNewRequests: %s", exc)
                answers[i] = Reservation(msg.req_id, Admission.REFUSED, [])
        if not request.prefill_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefill_name is empty")
        metadata = context.invocation_metadata() or ()
        try:
            reqs = convert.with_sampling_extras(reqs, metadata)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reuse = convert.wants_prefix_reuse(metadata)
        with tracing.server_call(convert.PD_SERVICE, "AddNewRequests", metadata):  # the admission
            reserved = iter(await _answer(context, lambda: intake.add_requests(request.prefill_name, reqs, reuse)))
            ordered = [answers[i] if i in answers else next(reserved) for i in range(len(request.reqs))]
            if tracing.is_enabled():
                tracing.annotate({"disagg.admission": [int(r.status) for r in ordered],
                                  tracing.KV_BLOCKS: sum(len(r.block_ids) for r in ordered)})
        context.set_trailing_metadata(convert.cached_blocks_metadata(ordered))
        return pb.DisaggResponses(resps=[convert.reservation_to_proto(r) for r in ordered])

    async def FirstGeneration(self, request: pb.DisaggGenerationsRequests,
                              context: grpc.aio.ServicerContext) -> common_pb2.Status:
        intake = await _answer(context, self._require_intake("FirstGeneration"))
        if not request.multi_gens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "multi_gens is empty")
        with tracing.server_call(convert.PD_SERVICE, "FirstGeneration", context.invocation_metadata()):
            refusals: list[errors.PDError] = []
            for msg in request.multi_gens:  # each on its own: a bad one neither stops nor strands the rest
                try:
                    await _start_first(intake, msg)
                except errors.PDError as exc:
                    refusals.append(exc)
        if refusals:  # the first one's code; every reason, so the caller knows which requests run
            await context.abort(status_code(refusals[0]), "; ".join(str(exc) for exc in refusals))
        return common_pb2.Status(ok=True)

    async def MultiGenerations(self, request: pb.DisaggGenerationsRequests,
                               context: grpc.aio.ServicerContext) -> common_pb2.Status:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "MultiGenerations (online/offline co-location) is not supported by this worker")
        raise AssertionError("context.abort raises")

    async def SendPullSignal(self, request: pb.PullSignal, context: grpc.aio.ServicerContext) -> common_pb2.Status:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "SendPullSignal (online/offline co-location) is not supported by this worker")
        raise AssertionError("context.abort raises")

    async def LinkInstance(self, request: pb.InstanceClusterInfo, context: grpc.aio.ServicerContext) -> common_pb2.Status:
        await _answer(context, lambda: _link(self._handlers, request, True))
        return common_pb2.Status(ok=True)

    async def UnlinkInstance(self, request: pb.InstanceClusterInfo,
                             context: grpc.aio.ServicerContext) -> common_pb2.Status:
        await _answer(context, lambda: _link(self._handlers, request, False))
        return common_pb2.Status(ok=True)


    def _require_intake(self, method: str) -> Callable[[], Awaitable[Intake]]:
        async def intake() -> Intake:
            return self._handlers.require_intake(method)

        return intake


class XllmRpcServicer(xllm_service_pb2_grpc.XllmRpcServiceServicer):
    """Where a decode streams the tokens of the requests this prefill owns."""

    def __init__(self, generations: Callable[[list[RequestOutput]], Awaitable[list[bool]]]) -> None:
        self._generations = generations

    async def Generations(self, request: pb.DisaggStreamGenerations, context: grpc.aio.ServicerContext) -> pb.StatusSet:
        outputs = await _answer(context, lambda: _parse_outputs(request))
        tracked = await _answer(context, lambda: self._generations(outputs))
        return pb.StatusSet(all_status=[common_pb2.Status(ok=ok) for ok in tracked])


async def _link(handlers: Handlers, msg: pb.InstanceClusterInfo, link: bool) -> None:
    """LinkInstance needs the peer's transfer endpoint; UnlinkInstance only its name."""
    if link:
        await handlers.require_link()(_instance_info(msg))
    elif not msg.instance_name:
        raise errors.InvalidMessage("bad InstanceClusterInfo: instance_name is empty")
    else:
        await handlers.unlink(msg.instance_name)


async def _start_first(intake: Intake, msg: pb.DisaggGenerationsRequest) -> None:
    try:
        first = convert.first_token_from_proto(msg)
    except ValueError as exc:
        await intake.refuse_first(msg.req_id, str(exc))
    else:
        await intake.first_generation(first)


async def _parse_outputs(msg: pb.DisaggStreamGenerations) -> list[RequestOutput]:
    try:
        return [convert.output_from_proto(gen) for gen in msg.gens]
    except ValueError as exc:
        raise errors.InvalidMessage(str(exc)) from exc


def _instance_info(msg: pb.InstanceClusterInfo) -> InstanceInfo:
    try:
        return InstanceInfo.from_proto(msg)
    except ValueError as exc:
        raise errors.InvalidMessage(f"bad InstanceClusterInfo: {exc}") from exc


def build_grpc_server(handlers: Handlers, address: str, max_message_bytes: int, guard: ControlGuard,
                      identity: InstanceInfo, tls: grpc.ServerCredentials | None = None) -> grpc.aio.Server:
    """An asyncio gRPC server of a role's handlers on `address` (not started); `guard` checks every call
    first; `DESCRIBE_METHOD` answers `identity`. With `tls` the port serves mutual TLS only (a
    plaintext client fails its connection)."""
    server = grpc.aio.server(interceptors=[AuthInterceptor(guard), StrictDecoding()], options=[
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # gRPC's default SO_REUSEPORT would let a second worker share a taken port, the kernel
        # splitting link calls between the two: a taken port must fail the start instead.
        ("grpc.so_reuseport", 0),
        *convert.METADATA_OPTIONS,
    ])
    disagg_pd_pb2_grpc.add_DisaggPDServiceServicer_to_server(DisaggPDServicer(handlers), server)
    if handlers.generations is not None:
        xllm_service_pb2_grpc.add_XllmRpcServiceServicer_to_server(XllmRpcServicer(handlers.generations), server)
    # grpc.health.v1: what a prefill's liveness watch (and a Kubernetes gRPC probe) asks.
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_generic_rpc_handlers((_describe_handler(identity.to_proto()),))
    if tls is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, tls)
    return server


class _Malformed:
    """A request whose bytes did not parse as its message (what `StrictDecoding` answers)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class StrictDecoding(grpc.aio.ServerInterceptor):
    """A unary request that does not parse is INVALID_ARGUMENT with the parser's reason; gRPC
    would answer UNKNOWN, naming a Python exception class, and log a traceback per call.
    (Every control method is unary; a call the AuthInterceptor refuses is never parsed.)"""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary
        method: str = details.method  # type: ignore[attr-defined]

        def deserialize(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError as exc:
                return _Malformed(str(exc))

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the {method} request is not a valid message: {request.reason}")
            answer = behavior(request, context)
            return await answer if inspect.isawaitable(answer) else answer

        return grpc.unary_unary_rpc_method_handler(checked, request_deserializer=deserialize,
                                                   response_serializer=handler.response_serializer)


def _describe_handler(identity: pb.InstanceClusterInfo) -> grpc.GenericRpcHandler:
    async def describe(request: pb.InstanceClusterInfo, context: grpc.aio.ServicerContext) -> pb.InstanceClusterInfo:
        return identity

    service, _, method = DESCRIBE_METHOD.strip("/").partition("/")
    return grpc.method_handlers_generic_handler(service, {method: grpc.unary_unary_rpc_method_handler(
        describe, request_deserializer=pb.InstanceClusterInfo.FromString,
        response_serializer=pb.InstanceClusterInfo.SerializeToString)})


def add_link_routes(app: FastAPI, role: Callable[[], Handlers | None], guard: ControlGuard) -> None:
    """xLLM's HTTP form: `POST /xllm.proto.DisaggPDService/{LinkInstance,UnlinkInstance}`
    with a JSON InstanceClusterInfo; answers a JSON Status (`{"ok": true}`), or
    `{"ok": false, "error": {...}}` with an HTTP error status and the reason.

    `role` returns None while the model loads (answered 503); a call `guard`
    refuses is answered 401.
    """

    async def handle(request: Request, link: bool) -> JSONResponse:
        if not guard.allows_http(request.method, request.url.path, request.headers, "http-link"):
            return _http_error(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        current = role()
        if current is None:
            return _http_error(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        try:
            msg = json_format.Parse(await read_body(request), pb.InstanceClusterInfo())
        except (json_format.ParseError, ValueError) as exc:
            return _http_error(grpc.StatusCode.INVALID_ARGUMENT, f"bad InstanceClusterInfo: {exc}")
        try:
            await _link(current, msg, link)
        except errors.PDError as exc:
            return _http_error(status_code(exc), str(exc))
        return JSONResponse({"ok": True})

    @app.post("/xllm.proto.DisaggPDService/LinkInstance")
    async def link_instance(request: Request) -> JSONResponse:
        return await handle(request, True)

    @app.post("/xllm.proto.DisaggPDService/UnlinkInstance")
    async def unlink_instance(request: Request) -> JSONResponse:
        return await handle(request, False)


def _http_error(code: grpc.StatusCode, message: str) -> JSONResponse:
    status = HTTP_STATUS.get(code, 500)
    body = {"ok": False, "error": {"message": message, "type": code.name.lower(), "code": status}}
    return JSONResponse(body, status_code=status)
