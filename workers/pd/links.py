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

from disagg.workers.metrics import WorkerMetrics
from disagg.workers.transfer import TransferSession

log = logging.getLogger(__name__)

# How often sessions are checked for a dead peer: bounds how late a lost
# peer's requests are failed.
WATCH_INTERVAL_S = 0.2


class PeerTable:
    """Linked peers by instance name; lives on the event loop's thread.

    `on_lost(name, reason)` runs when a peer goes: unlinked, or its session broke.
    """

    def __init__(self, metrics: WorkerMetrics, on_lost: Callable[[str, str], Awaitable[None]]) -> None:
        self._sessions: dict[str, TransferSession] = {}
        self._unhealthy: set[str] = set()  # linked, but not answering health checks (liveness.py)
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
        """Linked, its data path open, and answering health checks: requests may go there."""
        session = self._sessions.get(name)
        return session is not None and session.is_open and name not in self._unhealthy

    def set_healthy(self, name: str, healthy: bool) -> bool:
        """Record a peer's health; True when that changed it."""
        if name not in self._sessions or (name not in self._unhealthy) == healthy:
            return False
        if healthy:
            self._unhealthy.discard(name)
        else:
            self._unhealthy.add(name)
        self._metrics.peers_unhealthy.set(len(self._unhealthy))
        return True

    def add(self, name: str, session: TransferSession) -> None:
        old = self._sessions.get(name)
        self._sessions[name] = session
        if old is not None and old is not session:
            old.close()
        self._metrics.set_links(len(self._sessions))
        log.info("linked %s", name)

    async def remove(self, name: str, reason: str, only: TransferSession | None = None) -> bool:
        """Drop a peer and fail its requests (on_lost). False if it was not linked (over `only`, if given:
        a peer that linked again meanwhile keeps its new session).

        NOTE: the data path closes before on_lost frees the requests' blocks, so
        that no late write of the peer can land in a block already reused.
        """
        session = self._sessions.get(name)
        if session is None or only is not None and session is not only:
            return False
        del self._sessions[name]
        self._unhealthy.discard(name)
        self._metrics.peers_unhealthy.set(len(self._unhealthy))
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
            # Each removal awaits on_lost, during which a peer may link again under the same name.
            for name, broken in [(n, s) for n, s in self._sessions.items() if not s.is_open]:
                await self.remove(name, "its transfer session broke (the peer died or closed it)", only=broken)
