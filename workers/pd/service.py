"""The gRPC edge of a PD worker: `DisaggPDService` (and, on the prefill,
`XllmRpcService.Generations`) over asyncio gRPC, plus xLLM's HTTP JSON form
of the link calls.

Protobuf is converted to the roles' types here; each role error maps to one
status code. MultiGenerations and SendPullSignal (xLLM's online/offline
co-location) answer UNIMPLEMENTED and the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from google.protobuf import json_format

from disagg.proto import common_pb2, disagg_pd_pb2 as pb, disagg_pd_pb2_grpc, xllm_service_pb2_grpc
from disagg.proto.vocabulary import InstanceInfo
from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.pd import convert, errors
from disagg.workers.pd.messages import Admission, FirstToken, NewRequest, Reservation
from disagg.workers.security.control import HTTP_HEADER, REFUSAL, AuthInterceptor, ControlGuard, http_method

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


class PDRole(Protocol):
    """What the service needs of a role; both roles have every method, and
    the ones of the other role raise WrongRole."""

    async def link(self, info: InstanceInfo) -> None: ...

    async def unlink(self, info: InstanceInfo) -> None: ...

    async def add_requests(self, prefill_name: str, reqs: list[NewRequest]) -> list[Reservation]: ...

    async def first_generation(self, first: FirstToken) -> None: ...

    async def refuse_first(self, req_id: str, reason: str) -> None: ...

    async def generations(self, outputs: list[RequestOutput]) -> list[bool]: ...


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


class DisaggPDServicer(disagg_pd_pb2_grpc.DisaggPDServiceServicer):
    def __init__(self, role: PDRole) -> None:
        self._role = role

    async def AddNewRequests(self, request: pb.DisaggRequests, context: grpc.aio.ServicerContext) -> pb.DisaggResponses:
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
        try:
            reqs = convert.with_sampling_extras(reqs, context.invocation_metadata() or ())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reserved = iter(await _answer(context, lambda: self._role.add_requests(request.prefill_name, reqs)))
        ordered = [answers[i] if i in answers else next(reserved) for i in range(len(request.reqs))]
        return pb.DisaggResponses(resps=[convert.reservation_to_proto(r) for r in ordered])

    async def FirstGeneration(self, request: pb.DisaggGenerationsRequests,
                              context: grpc.aio.ServicerContext) -> common_pb2.Status:  # fmt: skip
        if not request.multi_gens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "multi_gens is empty")
        for msg in request.multi_gens:
            try:
                first = convert.first_token_from_proto(msg)
            except ValueError as exc:
                await _answer(context, lambda: self._role.refuse_first(msg.req_id, str(exc)))
                continue
            await _answer(context, lambda: self._role.first_generation(first))
        return common_pb2.Status(ok=True)

    async def MultiGenerations(self, request: pb.DisaggGenerationsRequests,
                               context: grpc.aio.ServicerContext) -> common_pb2.Status:  # fmt: skip
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "MultiGenerations (online/offline co-location) is not supported by this worker")
        raise AssertionError("context.abort raises")

    async def SendPullSignal(self, request: pb.PullSignal, context: grpc.aio.ServicerContext) -> common_pb2.Status:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "SendPullSignal (online/offline co-location) is not supported by this worker")
        raise AssertionError("context.abort raises")

    async def LinkInstance(self, request: pb.InstanceClusterInfo, context: grpc.aio.ServicerContext) -> common_pb2.Status:
        info = await _answer(context, lambda: _parse_info(request))
        await _answer(context, lambda: self._role.link(info))
        return common_pb2.Status(ok=True)

    async def UnlinkInstance(self, request: pb.InstanceClusterInfo,
                             context: grpc.aio.ServicerContext) -> common_pb2.Status:  # fmt: skip
        info = await _answer(context, lambda: _parse_info(request))
        await _answer(context, lambda: self._role.unlink(info))
        return common_pb2.Status(ok=True)


class XllmRpcServicer(xllm_service_pb2_grpc.XllmRpcServiceServicer):
    """Where a decode streams the tokens of the requests this prefill owns."""

    def __init__(self, role: PDRole) -> None:
        self._role = role

    async def Generations(self, request: pb.DisaggStreamGenerations, context: grpc.aio.ServicerContext) -> pb.StatusSet:
        outputs = [convert.output_from_proto(gen) for gen in request.gens]
        tracked = await _answer(context, lambda: self._role.generations(outputs))
        return pb.StatusSet(all_status=[common_pb2.Status(ok=ok) for ok in tracked])


async def _parse_info(msg: pb.InstanceClusterInfo) -> InstanceInfo:
    try:
        return InstanceInfo.from_proto(msg)
    except ValueError as exc:
        raise errors.InvalidMessage(f"bad InstanceClusterInfo: {exc}") from exc


def build_grpc_server(role: PDRole, address: str, max_message_bytes: int, serves_generations: bool,
                      guard: ControlGuard) -> grpc.aio.Server:  # fmt: skip
    """An asyncio gRPC server of the role on `address` (not started); `guard` checks every call first."""
    server = grpc.aio.server(interceptors=[AuthInterceptor(guard)], options=[
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ])  # fmt: skip
    disagg_pd_pb2_grpc.add_DisaggPDServiceServicer_to_server(DisaggPDServicer(role), server)
    if serves_generations:
        xllm_service_pb2_grpc.add_XllmRpcServiceServicer_to_server(XllmRpcServicer(role), server)
    server.add_insecure_port(address)
    return server


def add_link_routes(app: FastAPI, role: Callable[[], PDRole | None], guard: ControlGuard) -> None:
    """xLLM's HTTP form: `POST /xllm.proto.DisaggPDService/{LinkInstance,UnlinkInstance}`
    with a JSON InstanceClusterInfo; answers a JSON Status (`{"ok": true}`), or
    `{"ok": false, "error": {...}}` with an HTTP error status and the reason.

    `role` returns None while the model loads (answered 503); a call `guard`
    refuses is answered 401.
    """

    async def handle(request: Request, link: bool) -> JSONResponse:
        if not guard.allows(http_method(request.url.path), request.headers.get(HTTP_HEADER), "http-link"):
            return _http_error(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        current = role()
        if current is None:
            return _http_error(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        try:
            msg = json_format.Parse(await request.body(), pb.InstanceClusterInfo())
            info = InstanceInfo.from_proto(msg)
        except (json_format.ParseError, ValueError) as exc:
            return _http_error(grpc.StatusCode.INVALID_ARGUMENT, f"bad InstanceClusterInfo: {exc}")
        try:
            await (current.link(info) if link else current.unlink(info))
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
