"""The link graph (which decode is linked to which prefill) and the async gRPC client that makes links.

Semantics are PROTOCOL.md's: a link is made on the decode, payload = the
prefill's `InstanceClusterInfo`; an unlink is sent to whichever side is still
alive, payload = the other. Links are idempotent on the workers, so the
operator may re-assert them at any time. The graph is the operator's memory
of what it made; it is rebuilt by re-asserting after an operator restart.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from disagg.operator.manifests import GRPC_PORT, TRANSFER_PORT
from disagg.proto import disagg_pd_pb2, disagg_pd_pb2_grpc
from disagg.workers.security.control import control_channel
from disagg.workers.security.key import ClusterKey

Pair = tuple[str, str]  # (decode pod name, prefill pod name)
# What the planner saw of a pair's two pods when it tried to link them
# (reconcile.PodView.observed of each): a failed pair whose pods have changed
# since is due again at once, with its backoff started afresh.
Observed = Hashable

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0


@dataclass(frozen=True)
class Endpoint:
    """One incarnation of a worker, as its peers know it."""

    pod: str
    incarnation: str  # "<pod uid>/<restart count>": a restarted worker has forgotten its links
    ip: str
    grpc_port: int = GRPC_PORT
    transfer_port: int = TRANSFER_PORT

    @property
    def instance_name(self) -> str:
        return f"{self.ip}:{self.grpc_port}"

    def cluster_info(self) -> disagg_pd_pb2.InstanceClusterInfo:
        """One worker rank per pod: each list has one entry."""
        ip_u32 = int(ipaddress.IPv4Address(self.ip))  # the address as a network-order uint32
        return disagg_pd_pb2.InstanceClusterInfo(
            instance_name=self.instance_name,
            cluster_ids=[ip_u32 << 32 | self.transfer_port],
            addrs=[f"{self.ip}:{self.transfer_port}"],
            device_ips=[self.ip],
            ports=[self.transfer_port],
            dp_size=1,
        )


@dataclass(frozen=True)
class LinkOp:
    """One RPC: `LinkInstance`/`UnlinkInstance` on `target` with `payload`'s info."""

    link: bool
    target: Endpoint
    payload: Endpoint

    @property
    def verb(self) -> str:
        return "link" if self.link else "unlink"


@dataclass(frozen=True)
class LinkResult:
    op: LinkOp
    ok: bool
    error: str
    seconds: float


@dataclass(frozen=True)
class Edge:
    decode: Endpoint
    prefill: Endpoint


@dataclass
class Failure:
    attempts: int  # failures in a row while the pair's pods stayed as `observed`
    next_due: float  # monotonic time of the next attempt
    error: str
    observed: Observed


@dataclass
class LinkGraph:
    """Links the operator has made and link attempts that failed, per (decode, prefill) pair."""

    edges: dict[Pair, Edge] = field(default_factory=dict)
    failures: dict[Pair, Failure] = field(default_factory=dict)

    def established(self, pair: Pair, decode: Endpoint, prefill: Endpoint) -> bool:
        """Linked, and with these incarnations (a restarted worker needs linking again)."""
        return self.edges.get(pair) == Edge(decode, prefill)

    def due(self, pair: Pair, now: float, observed: Observed) -> bool:
        """Never failed, backed off long enough, or its pods changed since the failure
        (a worker that has just loaded its model or restarted deserves a try now)."""
        f = self.failures.get(pair)
        return f is None or now >= f.next_due or f.observed != observed

    def next_due(self) -> float | None:
        return min((f.next_due for f in self.failures.values()), default=None)

    def record_link(self, pair: Pair, result: LinkResult, now: float, observed: Observed) -> None:
        """The outcome of a link attempt made while the pair's pods were as `observed`."""
        op = result.op
        if result.ok:
            self.edges[pair] = Edge(decode=op.target, prefill=op.payload)
            self.failures.pop(pair, None)
            return
        self.edges.pop(pair, None)
        before = self.failures.get(pair)
        # The backoff grows only while nothing changes; a change starts it again from the base.
        attempts = before.attempts + 1 if before is not None and before.observed == observed else 1
        delay = min(BACKOFF_BASE_S * 2 ** (attempts - 1), BACKOFF_CAP_S)
        self.failures[pair] = Failure(attempts=attempts, next_due=now + delay, error=result.error, observed=observed)

    def forget(self, pairs: Iterable[Pair]) -> None:
        for pair in pairs:
            self.edges.pop(pair, None)
            self.failures.pop(pair, None)

    def peers_of(self, pod: str) -> list[Pair]:
        return [pair for pair in self.edges if pod in pair]


class LinkClient:
    """gRPC `LinkInstance`/`UnlinkInstance` with a deadline per call, many calls at once.

    Channels are cached per target address; `close()` releases them. A failed
    call is not retried here: the graph schedules the retry with backoff, so
    no handler ever sleeps.
    """

    def __init__(self, timeout_s: float = 5.0, concurrency: int = 64, key: ClusterKey | None = None) -> None:
        """`key`: the cluster key every call is signed with (None: the workers run --insecure)."""
        self.timeout_s = timeout_s
        self._key = key
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._limit = asyncio.Semaphore(concurrency)
        self.calls = 0  # RPCs sent, for the benchmark

    def _stub(self, target: Endpoint) -> disagg_pd_pb2_grpc.DisaggPDServiceStub:
        address = target.instance_name
        channel = self._channels.get(address)
        if channel is None:
            channel = control_channel(address, self._key)
            self._channels[address] = channel
        return disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)

    async def call(self, op: LinkOp) -> LinkResult:
        stub = self._stub(op.target)
        method = stub.LinkInstance if op.link else stub.UnlinkInstance
        began = time.monotonic()
        async with self._limit:
            self.calls += 1
            try:
                status = await method(op.payload.cluster_info(), timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                return LinkResult(op, False, f"{e.code().name}: {e.details()}", time.monotonic() - began)
        error = "" if status.ok else f"{op.target.instance_name} answered ok=false"
        return LinkResult(op, status.ok, error, time.monotonic() - began)

    async def run(self, ops: Sequence[LinkOp]) -> list[LinkResult]:
        """All `ops` in parallel, results in the same order."""
        return list(await asyncio.gather(*(self.call(op) for op in ops)))

    def forget(self, addresses: Iterable[str]) -> None:
        """Drop channels of workers that are gone (their addresses may be reused)."""
        for address in addresses:
            channel = self._channels.pop(address, None)
            if channel is not None:
                asyncio.ensure_future(channel.close())

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels))
