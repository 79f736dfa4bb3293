"""Which decode takes a prefill's request: the linked decodes, their load, and
the reservation of blocks on one of them (AddNewRequests), with backoff.

The least loaded live decode is asked first; a 404 (no free blocks) moves on
to the next, and when all answered 404 the round is retried after a growing
delay, bounded in total by `reserve_timeout_s`. This is where a per-request
choice between handing off and serving locally will sit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.clients import PeerClients
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.errors import DecodeFailed, NoDecodeAvailable, PDError, PromptNeverFits, RequestRefused
from disagg.workers.pd.links import PeerTable
from disagg.workers.pd.messages import Admission, NewRequest, Reservation
from disagg.workers.transfer import TransferSession

log = logging.getLogger(__name__)

NO_DECODE = "no decode instance is linked to this prefill"


@dataclass(frozen=True)
class Route:
    """A request's reservation on a decode."""

    decode: str  # the decode's instance name
    address: str  # its gRPC address
    block_ids: list[int]  # the reserved blocks, in prompt order
    num_cached_blocks: int = 0  # the leading ones the decode already holds: their KV is not sent


class DecodeRouter:
    """The decodes linked to this prefill, and how many requests each has from us."""

    def __init__(self, clients: PeerClients, metrics: WorkerMetrics, config: PDConfig, instance_name: str,
                 on_lost: Callable[[str, str], Awaitable[None]]) -> None:
        self._clients = clients
        self._config = config
        self._name = instance_name
        self._on_lost = on_lost
        self.peers = PeerTable(metrics, self._lost)
        self._addresses: dict[str, str] = {}  # decode name -> its gRPC address
        self._load: dict[str, int] = {}  # decode name -> requests routed there and not done
        self._full_until: dict[str, float] = {}  # decode name -> when its last "no free blocks" expires
        self._releases: set[asyncio.Task[None]] = set()  # reservations nobody waits for any more, being freed

    def add(self, session: TransferSession) -> None:
        """A decode linked to us (its handshake named its gRPC address)."""
        name = session.peer.name
        self._addresses[name] = session.peer.grpc_address
        self._load.setdefault(name, 0)
        self._clients.renew(session.peer.grpc_address)
        self.peers.add(name, session)

    def has_live(self) -> bool:
        return any(self.peers.is_live(name) for name in self.peers.names())

    def has_room(self) -> bool:
        """Whether a live decode did not answer "no free blocks" within the last `backoff_max_s`."""
        now = time.monotonic()
        return any(self.peers.is_live(n) and self._full_until.get(n, 0.0) <= now for n in self.peers.names())

    def address(self, decode: str) -> str | None:
        return self._addresses.get(decode)

    def session(self, decode: str) -> TransferSession | None:
        """The data path to a decode, if open."""
        session = self.peers.get(decode)
        return session if session is not None and session.is_open else None

    async def reserve(self, request: NewRequest, num_blocks: int) -> Route:
        """Blocks for `request` on a decode; counts it in that decode's load until `done`.

        Raises NoDecodeAvailable (none linked, or none with free blocks in time),
        PromptNeverFits, RequestRefused, or DecodeFailed (a wrong answer).
        """
        deadline = time.monotonic() + self._config.reserve_timeout_s
        delay = self._config.backoff_initial_s
        reason = NO_DECODE
        while True:
            live = [n for n in self.peers.names() if self.peers.is_live(n)]
            if not live:
                raise NoDecodeAvailable(reason)
            now = time.monotonic()
            # Those that said "no room" lately are asked last: a draining decode says so until it is unlinked.
            for name in sorted(live, key=lambda n: (self._full_until.get(n, 0.0) > now, self._load.get(n, 0))):
                address = self._addresses[name]
                # Counted while asked, so that a burst of requests spreads over the decodes.
                self._load[name] = self._load.get(name, 0) + 1
                asking = asyncio.ensure_future(self._clients.add_new_requests(address, self._name, [request]))
                try:
                    # Shielded: a call cut off may still reserve on the decode, for no one to free.
                    [answer] = await asyncio.shield(asking)
                except PDError as exc:
                    self.done(name)
                    reason = f"decode {name} failed AddNewRequests: {exc}"
                    continue
                except BaseException:  # cancelled (the client went away): not routed there after all
                    self.done(name)
                    self._release_when_answered(asking, address, request.req_id)
                    raise
                if answer.status is Admission.OK and len(answer.block_ids) == num_blocks:
                    return Route(name, address, answer.block_ids, answer.num_cached_blocks)
                self.done(name)
                if answer.status is Admission.OK:
                    raise DecodeFailed(f"decode {name} reserved {len(answer.block_ids)} blocks, not {num_blocks}")
                if answer.status is Admission.TOO_LARGE:
                    raise PromptNeverFits(f"the prompt of {len(request.prompt_token_ids)} tokens can never fit "
                                          f"the KV cache of decode {name}")
                if answer.status is Admission.REFUSED:
                    raise RequestRefused(f"decode {name} refused the request (500)")
                self._full_until[name] = time.monotonic() + self._config.backoff_max_s
                reason = f"no decode had free KV blocks within {self._config.reserve_timeout_s:.0f} s"
            if time.monotonic() + delay > deadline:
                raise NoDecodeAvailable(reason)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self._config.backoff_max_s)

    def _release_when_answered(self, asking: asyncio.Future[list[Reservation]], address: str, req_id: str) -> None:
        """Free the reservation an abandoned AddNewRequests makes, once it answers (bounded by
        its RPC deadline); until then the decode would hold the blocks for its reservation TTL."""
        async def release() -> None:
            try:
                [answer] = await asking
            except Exception:  # noqa: BLE001 - no answer: nothing reserved that this side knows of
                return
            if answer.status is Admission.OK:
                try:
                    await self._clients.cancel(address, req_id)
                except PDError as exc:
                    log.info("could not free the abandoned reservation of %s: %s", req_id, exc)

        task = asyncio.ensure_future(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def done(self, decode: str) -> None:
        """A request routed to `decode` is over."""
        if self._load.get(decode, 0) > 0:
            self._load[decode] -= 1

    async def cancel(self, route: Route, req_id: str) -> None:
        """Free a reservation the decode never got the first token for (best effort;
        a decode that went away has freed it itself)."""
        if route.decode not in self._addresses:
            return
        try:
            await self._clients.cancel(route.address, req_id)
        except PDError as exc:
            log.info("could not cancel %s on %s: %s", req_id, route.decode, exc)

    async def _lost(self, name: str, reason: str) -> None:
        self._addresses.pop(name, None)
        self._load.pop(name, None)
        self._full_until.pop(name, None)
        await self._on_lost(name, reason)
