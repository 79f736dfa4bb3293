"""A prefill's watch on its decodes' liveness, and on its streams' progress.

A dead decode breaks its transfer session and is dropped at once (links.py);
a hung one (stopped, deadlocked, swapping) keeps its TCP connections open and
would stall its streams silently. So the prefill asks every linked decode's
gRPC health service (grpc.health.v1) each `health_interval_s`: after
`health_failures` misses in a row the decode is marked unhealthy, no new
request is routed to it, and the streams it holds fail at once (a stream can
be moved elsewhere only from the tokens it has, which is the relay's job);
when it answers again it takes requests again, still linked.

The same loop ends handed-off streams that got no token for
`stream_idle_timeout_s`: their decode dropped them without being able to say
so (say, its Generations call to this prefill failed while the prefill was
paused), and the client must not wait forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from disagg.workers.pd.clients import PeerClients
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.links import PeerTable
from disagg.workers.pd.relay import TokenRelay

log = logging.getLogger(__name__)


class LivenessWatch:
    def __init__(self, peers: PeerTable, address_of: Callable[[str], str | None], clients: PeerClients,
                 relay: TokenRelay, config: PDConfig) -> None:
        self._peers = peers
        self._address_of = address_of
        self._clients = clients
        self._relay = relay
        self._config = config
        self._misses: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        assert self._task is None, "the liveness watch runs once"
        self._task = asyncio.create_task(self._run(), name="liveness-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_interval_s)
            names = self._peers.names()
            answers = await asyncio.gather(*(self._answers(name) for name in names))
            for name, ok in zip(names, answers):
                self._record(name, ok)
            self._misses = {n: m for n, m in self._misses.items() if n in names}
            self._relay.fail_idle(self._config.stream_idle_timeout_s)

    async def _answers(self, name: str) -> bool:
        address = self._address_of(name)
        return address is not None and await self._clients.answers(address, self._config.health_timeout_s)

    def _record(self, name: str, ok: bool) -> None:
        self._misses[name] = 0 if ok else self._misses.get(name, 0) + 1
        if ok and self._peers.set_healthy(name, True):
            log.info("decode %s answers health checks again: routing to it", name)
        elif self._misses[name] == self._config.health_failures and self._peers.set_healthy(name, False):
            seconds = self._config.health_failures * self._config.health_interval_s
            reason = f"stopped answering health checks for {seconds:.0f} s (hung)"
            log.warning("decode %s %s: no new requests go there, its streams fail", name, reason)
            self._relay.fail_decode(name, "hung", reason)

