"""Authenticated control calls: the check every DisaggPDService and
XllmRpcService call (and xLLM's HTTP link routes) passes, and the client side
that signs them.

A call carries `ClusterKey.credential(method)` in the `x-disagg-auth` gRPC
metadata (the `X-Disagg-Auth` header over HTTP); anything else is answered
UNAUTHENTICATED (401) and counted in `disagg_auth_failures_total{path}`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc

from disagg.workers.security.key import AuthError, ClusterKey, CredentialVerifier
from disagg.workers.security.tls import GRPC_CHANNEL_OPTIONS

log = logging.getLogger(__name__)

METADATA_KEY = "x-disagg-auth"
HTTP_HEADER = "X-Disagg-Auth"
REFUSAL = "missing or invalid cluster credential"  # all a refused caller learns
# Open to anyone: the gRPC health check says only SERVING or not, and a Kubernetes gRPC probe cannot sign.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


class ControlGuard:
    """Decides whether a control call may proceed.

    Args:
        key: the cluster key; None = insecure (every call passes).
        allow_anonymous: calls with no credential at all pass (an xLLM peer,
            which cannot send one); a wrong credential is still refused.
        on_failure: called with the path ("grpc", "http-link") of each refusal.
    """

    def __init__(self, key: ClusterKey | None, allow_anonymous: bool = False,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.key = key
        self.allow_anonymous = allow_anonymous
        self._verifier = CredentialVerifier(key) if key is not None else None
        self._on_failure = on_failure

    def refusing_anonymous(self) -> ControlGuard:
        """The same check, with the same memory of used credentials, that refuses a call with no
        credential too: for a port open to clients, where an anonymous peer is a stranger."""
        guard = copy.copy(self)
        guard.allow_anonymous = False
        return guard

    @property
    def insecure(self) -> bool:
        return self._verifier is None

    def allows_http(self, verb: str, url_path: str, headers: Mapping[str, str], path: str) -> bool:
        """Whether an HTTP control call `verb url_path` with these headers may proceed (`allows`)."""
        return self.allows(http_method(url_path, verb), headers.get(HTTP_HEADER), path)

    def allows(self, method: str, credential: str | None, path: str) -> bool:
        """Whether a call of `method` with `credential` may proceed; a refusal is logged and counted."""
        if self._verifier is None or (credential is None and self.allow_anonymous) or method in OPEN_METHODS:
            return True
        try:
            if credential is None:
                raise AuthError("no credential")
            self._verifier.verify(method, credential)
        except AuthError as exc:
            log.warning("refused %s call %s: %s", path, method, exc)
            if self._on_failure is not None:
                self._on_failure(path)
            return False
        return True


async def _refuse(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
    """Never reads `requests`: the body of a refused call is not taken in (a unary handler would
    receive the whole message, up to the size limit, before it could refuse: unsigned 15 MiB
    calls grew a worker by gigabytes)."""
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, before any servicer runs, every call that `guard` does not allow."""

    def __init__(self, guard: ControlGuard) -> None:
        self._guard = guard

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = dict(details.invocation_metadata or ())  # type: ignore[attr-defined]
        credential = metadata.get(METADATA_KEY)
        method: str = details.method  # type: ignore[attr-defined]
        if self._guard.allows(method, credential if isinstance(credential, str) else None, "grpc"):
            return await continuation(details)
        # Refused as a client-streaming call, the same on the wire to a unary caller: the request
        # is neither received whole nor parsed.
        return grpc.stream_unary_rpc_method_handler(_refuse)


class CredentialInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds a fresh credential for the method to every outgoing unary call."""

    def __init__(self, key: ClusterKey) -> None:
        self._key = key

    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else str(details.method)
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(METADATA_KEY, self._key.credential(method))
        signed = grpc.aio.ClientCallDetails(method=details.method, timeout=details.timeout, metadata=metadata,
                                            credentials=details.credentials,
                                            wait_for_ready=details.wait_for_ready)
        return await continuation(signed, request)


# Each channel its own connection: one opened to replace a channel that is backing off must
# not share that channel's connection attempt (gRPC pools them process-wide by default).
_OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


def control_channel(address: str, key: ClusterKey | None, options: Sequence[tuple[str, Any]] = (),
                    tls: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A channel to a worker's gRPC port whose calls carry credentials of `key` (None: none),
    over TLS with `tls` (security/tls.py; None: plaintext)."""
    interceptors = [CredentialInterceptor(key)] if key is not None else None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=[*options, _OWN_CONNECTION], interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls, options=[*options, _OWN_CONNECTION, *GRPC_CHANNEL_OPTIONS],
                                   interceptors=interceptors)


def is_backing_off(channel: grpc.aio.Channel) -> bool:
    """Whether a channel fails every call at once until its reconnect backoff ends.

    A channel whose call failed while its peer was down stays so, even once the peer is
    back (a restarted pod keeps its address), for 1 s after one failure and up to two
    minutes after many: a cache of channels replaces such a one instead of using it.
    """
    return channel.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE


def http_method(path: str, verb: str = "POST") -> str:
    """What an HTTP control credential is bound to: never valid as a gRPC one for the same call,
    nor for another verb on the same path."""
    return f"{verb} {path}"


def http_credential_headers(key: ClusterKey | None, path: str, verb: str = "POST") -> dict[str, str]:
    """Headers for an HTTP control call `verb path` (xLLM's link routes, the admin port's drain)."""
    return {} if key is None else {HTTP_HEADER: key.credential(http_method(path, verb))}
