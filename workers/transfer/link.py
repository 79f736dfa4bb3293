"""Listening, the link handshake and the session table, shared by every transport.

A transport subclass only says what its handshake carries (`_hello_extras`,
`_accept_extras`) and how a session is built over the handshaken sockets
(`_open_session`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from disagg.workers.transfer.base import (
    KVLayout,
    KVTransport,
    LinkRefusedError,
    PeerInfo,
    TransferError,
    TransferSession,
    TransferTimeout,
)
from disagg.workers.transfer.handshake import Hello, Reply, recv_hello, recv_reply, send_hello, send_reply
from disagg.workers.transfer.wire import ChecksumKind, supported_checksums

logger = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" -> (host, port), with a clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"transfer address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


class LinkedTransport(KVTransport):
    """A KVTransport whose links start with the handshake over `num_connections` TCP sockets."""

    def __init__(
        self,
        pool: torch.Tensor,
        layout: KVLayout,
        instance_name: str,
        grpc_address: str,
        num_connections: int = 4,
        io_timeout: float = 30.0,
        checksums: Sequence[ChecksumKind] | None = None,
    ) -> None:
        """
        Args:
            num_connections: sockets per session this side opens in `connect`.
            io_timeout: bound on any single socket wait inside a frame or handshake.
            checksums: kinds this side accepts, best first (default: all it can
                compute; ChecksumKind.NONE only when asked for, e.g. to measure its cost).
        """
        super().__init__(pool, layout, instance_name, grpc_address)
        if not 1 <= num_connections <= 64:
            raise ValueError(f"num_connections must be in 1..64, got {num_connections}")
        self.num_connections = num_connections
        self.io_timeout = io_timeout
        self.checksums = list(checksums) if checksums is not None else supported_checksums()
        if not self.checksums:
            raise ValueError("at least one checksum kind is needed (ChecksumKind.NONE turns checking off)")
        self._listener: socket.socket | None = None
        self._sessions: dict[str, TransferSession] = {}
        # session id -> (first seen, {connection index: (its hello, its socket)})
        self._pending: dict[str, tuple[float, dict[int, tuple[Hello, socket.socket]]]] = {}
        self._cond = threading.Condition()
        self._closed = False

    # ---- transport hooks ---------------------------------------------------

    def _hello_extras(self) -> dict[str, Any]:
        """Fields this transport adds to the HELLO it sends."""
        return {}

    def _accept_extras(self, hello: Hello) -> dict[str, Any]:
        """Fields this transport adds to an accepting REPLY; raise TransferError to refuse."""
        return {}

    @abstractmethod
    def _open_session(
        self, peer: PeerInfo, socks: list[socket.socket], checksum: int, extras: dict[str, Any], initiator: bool
    ) -> TransferSession:
        """Build a session over handshaken sockets (ordered by connection index).

        Args:
            extras: the other side's handshake extras.
            initiator: True on the side that connected (the decode).
        """

    # ---- KVTransport -------------------------------------------------------

    def start(self, host: str, port: int) -> str:
        assert self._listener is None, "start() called twice"
        listener = socket.create_server((host, port), backlog=128)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name=f"{self.name}-accept", daemon=True).start()
        bound_host, bound_port = listener.getsockname()[:2]
        return f"{bound_host}:{bound_port}"

    def connect(self, address: str, timeout: float) -> TransferSession:
        host, port = parse_address(address)
        session_id = uuid.uuid4().hex
        socks: list[socket.socket] = []
        try:
            replies = []
            for index in range(self.num_connections):
                sock = socket.create_connection((host, port), timeout=timeout)
                socks.append(sock)
                hello = Hello(
                    self.identity, self.name, session_id, index, self.num_connections,
                    [int(kind) for kind in self.checksums], self._hello_extras() if index == 0 else {},
                )
                send_hello(sock, hello)
            replies = [recv_reply(sock, timeout) for sock in socks]
        except TimeoutError as exc:
            self._close_all(socks)
            raise TransferTimeout(f"transfer peer {address} did not answer within {timeout:.1f}s") from exc
        except (OSError, TransferError):
            self._close_all(socks)
            raise
        refused = next((reply for reply in replies if not reply.ok), None)
        if refused is not None:
            self._close_all(socks)
            raise LinkRefusedError(f"{address} refused the link: {refused.reason}")
        peer = replies[0].peer
        assert peer is not None, "an accepting REPLY names the acceptor"
        session = self._open_session(peer, socks, replies[0].checksum, replies[0].extras, initiator=True)
        self._register(session)
        return session

    def session(self, peer_name: str, timeout: float) -> TransferSession:
        with self._cond:
            if not self._cond.wait_for(lambda: self._live(peer_name) is not None, timeout):
                raise TransferTimeout(f"no transfer session from {peer_name!r} within {timeout:.1f}s")
            live = self._live(peer_name)
            assert live is not None, "checked by wait_for"
            return live

    def peers(self) -> dict[str, PeerInfo]:
        with self._cond:
            return {name: s.peer for name, s in self._sessions.items() if s.is_open}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            sessions = list(self._sessions.values())
            self._sessions.clear()
            pending = [sock for _, group in self._pending.values() for _, sock in group.values()]
            self._pending.clear()
        if self._listener is not None:
            self._listener.close()
        for session in sessions:
            session.close()
        self._close_all(pending)

    # ---- internals ---------------------------------------------------------

    def _live(self, peer_name: str) -> TransferSession | None:
        found = self._sessions.get(peer_name)
        return found if found is not None and found.is_open else None

    def _register(self, session: TransferSession) -> None:
        with self._cond:
            old = self._sessions.get(session.peer.name)
            self._sessions[session.peer.name] = session
            self._cond.notify_all()
        if old is not None and old is not session:
            old.close()  # a re-link replaces the previous data path

    def _accept_loop(self) -> None:
        assert self._listener is not None, "started by start()"
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            threading.Thread(target=self._serve_handshake, args=(sock,), daemon=True).start()

    def _refusal(self, hello: Hello) -> str | None:
        if hello.transport != self.name:
            return f"transport {hello.transport!r} requested, this worker serves {self.name!r}"
        return self.layout.mismatch_reason(hello.peer.layout)

    def _serve_handshake(self, sock: socket.socket) -> None:
        try:
            hello = recv_hello(sock, self.io_timeout)
            reason = self._refusal(hello)
            extras: dict[str, Any] = {}
            if reason is None and hello.conn_index == 0:
                try:
                    extras = self._accept_extras(hello)
                except TransferError as exc:
                    reason = str(exc)
            if reason is not None:
                logger.warning("refused link from %s: %s", hello.peer.name, reason)
                send_reply(sock, Reply(False, reason))
                sock.close()
                return
            checksum = next((k for k in self.checksums if int(k) in hello.checksums), None)
            if checksum is None:
                send_reply(sock, Reply(False, f"no common checksum in {hello.checksums}"))
                sock.close()
                return
            send_reply(sock, Reply(True, "", self.identity, int(checksum), extras))
        except (OSError, TransferError) as exc:
            logger.warning("transfer handshake failed: %s", exc)
            sock.close()
            return
        self._collect(hello, sock, int(checksum))

    def _collect(self, hello: Hello, sock: socket.socket, checksum: int) -> None:
        """Group the connections of one session; open it once all have arrived."""
        now = time.monotonic()
        with self._cond:
            for stale in [sid for sid, (t, _) in self._pending.items() if now - t > self.io_timeout]:
                self._close_all([s for _, s in self._pending.pop(stale)[1].values()])
            _, group = self._pending.setdefault(hello.session_id, (now, {}))
            group[hello.conn_index] = (hello, sock)
            if len(group) < hello.num_conns:
                return
            del self._pending[hello.session_id]
        first = group[0][0]
        socks = [group[i][1] for i in range(hello.num_conns)]
        session = self._open_session(first.peer, socks, checksum, first.extras, initiator=False)
        self._register(session)
        if self.on_link is not None:
            self.on_link(session)

    @staticmethod
    def _close_all(socks: list[socket.socket]) -> None:
        for sock in socks:
            sock.close()
