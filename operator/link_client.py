"""The async gRPC client that makes and drops links (`LinkInstance`/`UnlinkInstance`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

import grpc

from disagg.operator.links import Endpoint, LinkOp, LinkResult
from disagg.proto import disagg_pd_pb2_grpc
from disagg.workers.security.control import control_channel, is_backing_off
from disagg.workers.security.key import ClusterKey

K = TypeVar("K", bound=Hashable)  # what groups ops: a (decode, prefill) pair
Credentials = tuple[ClusterKey | None, grpc.ChannelCredentials | None]  # what a channel signs with, its TLS


class LinkClient:
    """gRPC `LinkInstance`/`UnlinkInstance` with a deadline per call, many calls at once.

    Channels are cached per target address; `close()` releases them, and one
    that is backing off is replaced (a restarted pod keeps its address). A failed
    call is not retried here: the graph schedules the retry with backoff, so
    no handler ever sleeps.
    """

    def __init__(self, timeout_s: float = 5.0, concurrency: int = 64) -> None:
        self.timeout_s = timeout_s
        # Per address, the key its channel signs with and the TLS it uses (a cluster's key object
        # is updated in place on rotation, so the channel follows it).
        self._channels: dict[str, tuple[Credentials, grpc.aio.Channel]] = {}
        self._limit = asyncio.Semaphore(concurrency)
        self.calls = 0  # RPCs sent, for the benchmark

    def _stub(self, target: Endpoint, credentials: Credentials) -> disagg_pd_pb2_grpc.DisaggPDServiceStub:
        address = target.instance_name
        cached = self._channels.get(address)
        if cached is None or any(a is not b for a, b in zip(cached[0], credentials)) or is_backing_off(cached[1]):
            if cached is not None:
                asyncio.ensure_future(cached[1].close())
            key, tls = credentials
            cached = self._channels[address] = (credentials, control_channel(address, key, tls=tls))
        return disagg_pd_pb2_grpc.DisaggPDServiceStub(cached[1])

    async def call(self, op: LinkOp, key: ClusterKey | None = None, tls: grpc.ChannelCredentials | None = None
                   ) -> LinkResult:
        """`key`: the cluster key the call is signed with (None: the workers run --insecure);
        `tls`: the channel's mutual TLS (None: plaintext)."""
        stub = self._stub(op.target, (key, tls))
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

    async def run(self, ops: Sequence[LinkOp], key: ClusterKey | None = None,
                  tls: grpc.ChannelCredentials | None = None) -> list[LinkResult]:
        """All `ops` in parallel, signed with `key` (over `tls`), results in the same order."""
        return list(await asyncio.gather(*(self.call(op, key, tls) for op in ops)))

    async def run_pairs(self, unlink: Sequence[tuple[K, Sequence[LinkOp]]], link: Sequence[tuple[K, LinkOp]],
                        key: ClusterKey | None = None, tls: grpc.ChannelCredentials | None = None
                        ) -> tuple[list[LinkResult], list[LinkResult]]:
        """Unlinks and links of many pairs in parallel, but a pair's link only once its unlinks are done;
        the results of each, in order (of `unlink`'s ops flattened, and of `link`).

        A worker knows its peers by address, which a restarted pod keeps: an unlink of the pair's old
        incarnation that landed after the new link would drop the new link.
        """
        unlinks = {pair: asyncio.ensure_future(self.run(ops, key, tls)) for pair, ops in unlink}

        async def after_unlinks(pair: K, op: LinkOp) -> LinkResult:
            if pair in unlinks:
                await unlinks[pair]
            return await self.call(op, key, tls)

        link_results = await asyncio.gather(*(after_unlinks(pair, op) for pair, op in link))
        return [r for task in unlinks.values() for r in await task], list(link_results)

    def forget(self, addresses: Iterable[str]) -> None:
        """Drop channels of workers that are gone (their addresses may be reused)."""
        for address in addresses:
            cached = self._channels.pop(address, None)
            if cached is not None:
                asyncio.ensure_future(cached[1].close())

    async def close(self) -> None:
        channels, self._channels = [c for _, c in self._channels.values()], {}
        await asyncio.gather(*(c.close() for c in channels))
