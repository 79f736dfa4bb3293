"""The peer table: who this worker is linked to, over which transfer session.

A link is made on the decode (LinkInstance with the prefill's info opens the
data path and sends the handshake); the prefill learns its decodes from the
accepted handshakes. Either side watches its sessions: a broken session (the
peer died or closed it) drops the peer as an unlink would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from disagg.proto import disagg_pd_pb2 as pb
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.convert import cluster_id, rank0_transfer_address
from disagg.workers.transfer import TransferSession
from disagg.workers.transfer.link import parse_address

log = logging.getLogger(__name__)

# How often sessions are checked for a dead peer: bounds how late a lost
# peer's requests are failed.
WATCH_INTERVAL_S = 0.2


@dataclass(frozen=True)
class InstanceInfo:
    """The part of an `InstanceClusterInfo` a link needs (one worker rank per instance)."""

    name: str  # "<ip>:<grpc port>": also the peer's gRPC address
    transfer_address: str  # "<ip>:<transfer port>" of rank 0

    @classmethod
    def from_proto(cls, msg: pb.InstanceClusterInfo) -> InstanceInfo:
        """ValueError unless the message names the instance and rank 0's transfer endpoint."""
        if not msg.instance_name:
            raise ValueError("instance_name is empty")
        address = rank0_transfer_address(msg.addrs, msg.cluster_ids)
        if address is None:
            raise ValueError(f"instance {msg.instance_name}: neither addrs nor cluster_ids names a transfer endpoint")
        try:
            parse_address(address)
        except ValueError as exc:
            raise ValueError(f"instance {msg.instance_name}: {exc}") from None
        return cls(msg.instance_name, address)

    def to_proto(self) -> pb.InstanceClusterInfo:
        host, _, port = self.transfer_address.rpartition(":")
        return pb.InstanceClusterInfo(
            instance_name=self.name, cluster_ids=[cluster_id(self.transfer_address)], addrs=[self.transfer_address],
            device_ips=[host], ports=[int(port)], dp_size=1,
        )  # fmt: skip


class PeerTable:
    """Linked peers by instance name; lives on the event loop's thread.

    `on_lost(name, reason)` runs when a peer goes: unlinked, or its session broke.
    """

    def __init__(self, metrics: WorkerMetrics, on_lost: Callable[[str, str], Awaitable[None]]) -> None:
        self._sessions: dict[str, TransferSession] = {}
        self._metrics = metrics
        self._on_lost = on_lost
        self._watcher: asyncio.Task[None] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def names(self) -> list[str]:
        return list(self._sessions)

    def get(self, name: str) -> TransferSession | None:
        return self._sessions.get(name)

    def is_live(self, name: str) -> bool:
        session = self._sessions.get(name)
        return session is not None and session.is_open

    def add(self, name: str, session: TransferSession) -> None:
        old = self._sessions.get(name)
        self._sessions[name] = session
        if old is not None and old is not session:
            old.close()
        self._metrics.set_links(len(self._sessions))
        log.info("linked %s", name)

    async def remove(self, name: str, reason: str) -> bool:
        """Drop a peer and fail its requests (on_lost). False if it was not linked.

        NOTE: the data path closes before on_lost frees the requests' blocks, so
        that no late write of the peer can land in a block already reused.
        """
        session = self._sessions.pop(name, None)
        if session is None:
            return False
        self._metrics.set_links(len(self._sessions))
        log.info("unlinked %s: %s", name, reason)
        session.close()
        await self._on_lost(name, reason)
        return True

    def start_watching(self) -> None:
        assert self._watcher is None, "the peer watcher runs once"
        self._watcher = asyncio.create_task(self._watch(), name="peer-watch")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for name in list(self._sessions):
            await self.remove(name, "this worker is shutting down")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for name in [n for n, s in self._sessions.items() if not s.is_open]:
                await self.remove(name, "its transfer session broke (the peer died or closed it)")
