"""Which blocks of the local pool each linked peer may touch, request by request.

The roles grant and revoke (the decode: the blocks it reserved for a
prefill's request, writable by that prefill until its first token arrives;
the prefill: the prompt blocks it holds for a request handed to a decode,
readable by that decode until they are released); the transport's reader
threads check every WRITE and READ frame against the grants of the peer
that sent it, so a peer never touches the rest of the pool.

A grant is checked when a frame's bytes start to move, and they may move for a
while after it. So the blocks a frame moves stay in use until it has moved
them, and whoever frees a request's blocks after revoking its grant first waits
until they are unused (`wait_unused`): otherwise a late write would land in
blocks already handed to another request, or a late read would carry its KV.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum


logger = logging.getLogger(__name__)


class Access(Enum):
    WRITE = "write"  # the peer stores KV into these blocks (a WRITE frame's destination)
    READ = "read"  # the peer reads KV from these blocks (a READ frame's source)


@dataclass(frozen=True)
class _Grant:
    peer: str
    access: Access
    blocks: tuple[int, ...]


class BlockAccess:
    """Grants of local blocks to peers, by request id. Thread-safe.

    Invariant: `_counts[(peer, access)][block]` is the number of live grants
    naming that block, so a block shared by two requests (a prefix-cache hit)
    stays granted until both are revoked.
    """

    def __init__(self, enforce: bool = True, on_refused: Callable[[], None] | None = None) -> None:
        """
        Args:
            enforce: False lets every in-pool block through (a bare transport, e.g. in benchmarks).
            on_refused: called for each frame refused for touching ungranted blocks.
        """
        self.enforce = enforce
        self._on_refused = on_refused
        self._grants: dict[str, _Grant] = {}
        self._counts: dict[tuple[str, Access], Counter[int]] = {}
        self._in_use: Counter[int] = Counter()  # frames moving each block now; a block no frame moves is absent
        self._lock = threading.Lock()
        self._unused = threading.Condition(self._lock)

    def allow(self, peer: str, req_id: str, blocks: Sequence[int], access: Access) -> None:
        """Let `peer` touch `blocks` for `req_id` (replacing what `req_id` was granted before)."""
        self.revoke(req_id)
        grant = _Grant(peer, access, tuple(int(b) for b in blocks))
        with self._lock:
            self._grants[req_id] = grant
            self._counts.setdefault((peer, access), Counter()).update(grant.blocks)

    def revoke(self, req_id: str) -> tuple[int, ...]:
        """End `req_id`'s grant; the blocks it covered (a frame may still be moving some). Idempotent."""
        with self._lock:
            grant = self._grants.pop(req_id, None)
            if grant is None:
                return ()
            counts = self._counts[(grant.peer, grant.access)]
            counts.subtract(grant.blocks)
            for block in grant.blocks:
                if counts[block] <= 0:
                    del counts[block]
        return grant.blocks

    def use(self, peer: str, access: Access, blocks: Sequence[int]) -> str | None:
        """`refusal`; when allowed, the blocks are in use until `done_with(blocks)`."""
        error = self.refusal(peer, access, blocks)
        if error is None:
            with self._lock:
                self._in_use.update(blocks)
        return error

    def done_with(self, blocks: Sequence[int]) -> None:
        with self._unused:
            for block in blocks:
                self._in_use[block] -= 1
                if self._in_use[block] <= 0:
                    del self._in_use[block]
            self._unused.notify_all()

    def in_use(self, blocks: Iterable[int]) -> bool:
        with self._lock:
            return self._moving(blocks)

    def wait_unused(self, blocks: Sequence[int], timeout: float) -> bool:
        """Block until no frame moves any of `blocks`; False when one still does after `timeout` s."""
        with self._unused:
            return self._unused.wait_for(lambda: not self._moving(blocks), timeout)

    def _moving(self, blocks: Iterable[int]) -> bool:
        return any(b in self._in_use for b in blocks)  # under the lock

    def refusal(self, peer: str, access: Access, blocks: Iterable[int]) -> str | None:
        """Why `peer` may not touch `blocks` this way (counted), or None when it may."""
        if not self.enforce:
            return None
        with self._lock:
            counts = self._counts.get((peer, access), Counter())
            denied = [b for b in blocks if counts[b] <= 0]
        if not denied:
            return None
        if self._on_refused is not None:
            self._on_refused()
        # NOTE: the reason names only the peer's own request, never what the refused blocks hold.
        return f"{access.value} of {len(denied)} blocks not granted to {peer}"

    def granted(self) -> int:
        """Live grants (for tests and leak checks)."""
        with self._lock:
            return len(self._grants)


async def revoke_settled(access: BlockAccess, req_id: str, timeout: float) -> bool:
    """Revoke `req_id`'s grant, then wait (off the event loop, at most `timeout` s) until no frame
    moves its blocks any more; False when one still does (the caller closes that peer's link
    before it frees them)."""
    blocks = access.revoke(req_id)
    if blocks and access.in_use(blocks) and not await asyncio.to_thread(access.wait_unused, blocks, timeout):
        logger.warning("request %s: a frame still moves its blocks after %.0f s", req_id, timeout)
        return False
    return True
