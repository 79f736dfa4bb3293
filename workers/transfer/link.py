"""Listening, the link handshake and the session table, shared by every transport.

A transport subclass only says what its handshake carries (`_hello_extras`,
`_accept_extras`) and how a session is built over the handshaken sockets
(`_open_session`).

The listener's resources are bounded against whoever can reach the port: at
most `max_pending` connections are handshaking or parked (waiting for the
other connections of their session) at once; a handshake has one deadline
for all its reads; a parked connection is closed when its session is not
complete within `io_timeout`; and a failing accept() (EMFILE) pauses the loop
instead of ending it. When every slot is taken, a new connection drops the
oldest handshake that has not proven the key yet and takes its slot, so a
stranger holding idle connections cannot keep a peer's link out (a key
holder's handshake takes milliseconds); with every slot held by proven
connections, the new one is closed at accept.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from disagg.workers.transfer.access import BlockAccess
from disagg.workers.transfer.base import (
    KVLayout,
    KVTransport,
    LinkRefusedError,
    PeerInfo,
    TransferError,
    TransferSession,
    TransferTimeout,
)
from disagg.workers.security.key import AuthError, ClusterKey
from disagg.workers.security.tls import TLS_SERVER_NAME, TlsFiles
from disagg.workers.transfer.handshake import (
    Challenge,
    Hello,
    Reply,
    bound_fields,
    initiate,
    recv_hello,
    recv_proof,
    send_challenge,
    send_reply,
)
from disagg.workers.transfer.wire import ChecksumKind, checksum_preference, supported_checksums

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 64
_ACCEPT_RETRY_S = 0.1  # pause after a failed accept(), e.g. out of file descriptors
_EVICTED_SLOT_WAIT_S = 1.0  # for a dropped handshake's thread to give its slot back
AUTH_REFUSAL = "authentication failed"  # all an initiator without the key learns


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" -> (host, port), with a clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"transfer address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _peer_of(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "a peer that already left"
    return f"{host}:{port}"


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
        key: ClusterKey | None = None,
        on_auth_failure: Callable[[], None] | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        access: BlockAccess | None = None,
        accepts_links: bool = True,
        tls: TlsFiles | None = None,
    ) -> None:
        """
        Args:
            num_connections: sockets per session this side opens in `connect`.
            io_timeout: bound on any single socket wait inside a frame, and on a whole handshake.
            checksums: kinds this side accepts, best first. None: the acceptor
                picks by `checksum_preference` per connection (none on loopback
                and TLS links, xxh3 or crc32 elsewhere), and the initiator
                offers every kind, leaving the choice to it.
            key: the cluster key both ends of a link must prove; None: no authentication.
            on_auth_failure: called for each handshake refused for its proof.
            max_pending: connections handshaking or parked at once; more are closed at accept.
            access: the grants every WRITE/READ frame of a peer is checked against
                (None: any block of the pool, as for a bare transport).
            accepts_links: False refuses every handshaken link this side did not open
                (a decode: KV comes only on the links it opened, to the prefills it named).
            tls: mutual TLS on every connection, opened and accepted (None: plaintext).
        """
        super().__init__(pool, layout, instance_name, grpc_address)
        if not 1 <= num_connections <= 64:
            raise ValueError(f"num_connections must be in 1..64, got {num_connections}")
        self.num_connections = num_connections
        self.io_timeout = io_timeout
        self.checksums = list(checksums) if checksums is not None else None
        if self.checksums == []:
            raise ValueError("at least one checksum kind is needed (ChecksumKind.NONE turns checking off)")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self._key = key
        self._tls = tls
        self._accepts_links = accepts_links
        if access is not None:
            self.access = access
        self._on_auth_failure = on_auth_failure
        self._pending_slots = threading.BoundedSemaphore(max_pending)
        # Handshakes not yet past the key's proof, oldest first: what a full listener drops.
        self._unproven: dict[object, tuple[float, socket.socket]] = {}
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

    def connect(self, address: str, timeout: float, expect_name: str | None = None) -> TransferSession:
        host, port = parse_address(address)
        session_id = uuid.uuid4().hex
        deadline = time.monotonic() + timeout
        socks: list[socket.socket] = []
        try:
            answers: list[tuple[Reply, Challenge]] = []
            for index in range(self.num_connections):
                sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
                if self._tls is not None:  # the TLS handshake runs here, under the connection's timeout
                    sock = self._tls.client_context().wrap_socket(sock, server_hostname=TLS_SERVER_NAME)
                socks.append(sock)
                hello = Hello(
                    self.identity, self.name, session_id, index, self.num_connections,
                    [int(kind) for kind in self._offered], self._hello_extras() if index == 0 else {},
                )
                answers.append(initiate(sock, hello, self._key, deadline,
                                        lambda challenge: self._unwanted(address, challenge.name, expect_name)))
        except TimeoutError as exc:
            self._close_all(socks)
            raise TransferTimeout(f"transfer peer {address} did not answer within {timeout:.1f}s") from exc
        except (OSError, TransferError):
            self._close_all(socks)
            raise
        except Exception as exc:  # noqa: BLE001 - an answer no handshake rule foresaw: still closed, still ours
            self._close_all(socks)
            raise TransferError(f"transfer peer {address} answered a malformed handshake: {exc!r}") from exc
        refused = next((reply for reply, _ in answers if not reply.ok), None)
        reply, _ = answers[0]
        reason = None
        if refused is not None:
            reason = refused.reason
        elif reply.checksum not in {int(kind) for kind in self._offered}:
            reason = f"it chose checksum kind {reply.checksum}, which was not offered"
        if reason is not None:
            self._close_all(socks)
            raise LinkRefusedError(f"{address} refused the link: {reason}")
        peer = reply.peer
        assert peer is not None, "an accepting REPLY names the acceptor"
        session = self._open_session(peer, socks, reply.checksum, reply.extras, initiator=True)
        self._register(session)
        return session

    def _unwanted(self, address: str, acceptor: str, expect_name: str | None) -> str | None:
        """Why the acceptor at `address`, named `acceptor`, is not this link's peer, or None. Asked
        of its CHALLENGE, before the proof: a refused link must not replace the acceptor's session
        with this worker (a wrong name in a LinkInstance would cut a healthy link)."""
        if acceptor == self.instance_name:
            return f"{address} refused the link: a worker cannot link to itself"
        if expect_name is not None and acceptor != expect_name:
            # A link names an instance: the data path must lead to that one, not whoever answers there.
            return f"{address} refused the link: it is {acceptor!r}, not the {expect_name!r} the link names"
        return None

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
            # Closed sessions go from the table here, so peers that come and go under new names
            # (pods replaced in a long-lived cluster) do not pile up in it.
            for name in [name for name, known in self._sessions.items() if not known.is_open]:
                del self._sessions[name]
            self._sessions[session.peer.name] = session
            self._cond.notify_all()
        if old is not None and old is not session:
            old.close()  # a re-link replaces the previous data path

    def _accept_loop(self) -> None:
        assert self._listener is not None, "started by start()"
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return  # the listener was closed
                logger.warning("transfer accept failed (%s); retrying", exc)
                time.sleep(_ACCEPT_RETRY_S)
                continue
            if not self._pending_slots.acquire(blocking=False) and not self._evict_for(sock):
                logger.warning("transfer listener full: closing a connection at accept")
                sock.close()
                continue
            threading.Thread(target=self._serve_handshake, args=(sock,), daemon=True).start()

    def _evict_for(self, newcomer: socket.socket) -> bool:
        """Drop the oldest handshake that has not proven the key, and take its slot for `newcomer`;
        False when every slot is held by proven connections (or the slot did not come back)."""
        with self._cond:
            if not self._unproven:
                return False
            started, victim = self._unproven.pop(next(iter(self._unproven)))  # kept in arrival order
        logger.warning("transfer listener full: dropped an unproven handshake of %.1f s for %s",
                       time.monotonic() - started, _peer_of(newcomer))
        with contextlib.suppress(OSError):  # its thread fails its next read and gives the slot back
            victim.shutdown(socket.SHUT_RDWR)
        return self._pending_slots.acquire(timeout=_EVICTED_SLOT_WAIT_S)

    def _track_unproven(self, token: object, sock: socket.socket | None) -> None:
        """`sock` (None: no longer) is the handshake `token`'s socket a full listener may drop."""
        with self._cond:
            if sock is None:
                self._unproven.pop(token, None)
            else:
                started = self._unproven.get(token, (time.monotonic(), sock))[0]
                self._unproven[token] = (started, sock)

    def _refusal(self, hello: Hello) -> str | None:
        if not self._accepts_links:
            return f"{self.instance_name} opens its links itself and accepts none"
        if hello.peer.name == self.instance_name:
            return "a worker cannot link to itself"
        if hello.transport != self.name:
            return f"transport {hello.transport!r} requested, this worker serves {self.name!r}"
        return self.layout.mismatch_reason(hello.peer.layout)

    def _authenticated(self, sock: socket.socket, hello: Hello, deadline: float) -> Challenge | None:
        """Challenge the initiator; the challenge when its proof holds, else None (refused and counted)."""
        challenge = Challenge(secrets.token_hex(16), self.instance_name)
        send_challenge(sock, challenge)
        proof = recv_proof(sock, deadline)
        if self._key is None:
            return challenge
        try:
            self._key.check_proof(proof, "initiator", *bound_fields(hello, challenge))
        except AuthError as exc:
            logger.warning("refused a transfer connection claiming to be %s: %s", hello.peer.name, exc)
            if self._on_auth_failure is not None:
                self._on_auth_failure()
            send_reply(sock, Reply(False, AUTH_REFUSAL))
            return None
        return challenge

    def _serve_handshake(self, sock: socket.socket) -> None:
        """Handshake one accepted connection, within one deadline; holds a pending slot until parked or closed."""
        deadline = time.monotonic() + self.io_timeout
        token = object()
        try:
            self._track_unproven(token, sock)
            if self._tls is not None:
                sock = self._secured(sock, deadline)
                self._track_unproven(token, sock)  # the TLS socket now owns the descriptor
            hello = recv_hello(sock, deadline)
            challenge = self._authenticated(sock, hello, deadline)
            self._track_unproven(token, None)
            if challenge is None:
                sock.close()
                self._pending_slots.release()
                return
            reason = self._refusal(hello)
            extras: dict[str, Any] = {}
            if reason is None and hello.conn_index == 0:
                try:
                    extras = self._accept_extras(hello)
                except TransferError as exc:
                    reason = str(exc)
            checksum = next((k for k in self._accepted(sock) if int(k) in hello.checksums), None)
            if reason is None and checksum is None:
                reason = f"no common checksum in {hello.checksums}"
            if reason is not None:
                logger.warning("refused link from %s: %s", hello.peer.name, reason)
                send_reply(sock, Reply(False, reason))
                sock.close()
                self._pending_slots.release()
                return
            assert checksum is not None, "checked above"
            proof = self._key.proof("acceptor", *bound_fields(hello, challenge)) if self._key is not None else ""
            send_reply(sock, Reply(True, "", self.identity, int(checksum), extras, proof))
        except Exception as exc:  # noqa: BLE001 - whatever a stranger's bytes raise, the slot comes back
            logger.warning("transfer handshake failed: %s", exc)
            self._track_unproven(token, None)
            sock.close()
            self._pending_slots.release()
            return
        self._collect(hello, sock, int(checksum))

    @property
    def _offered(self) -> list[ChecksumKind]:
        return self.checksums if self.checksums is not None else [*supported_checksums(), ChecksumKind.NONE]

    def _accepted(self, sock: socket.socket) -> list[ChecksumKind]:
        """The checksum kinds this side takes on an accepted connection, best first."""
        if self.checksums is not None:
            return self.checksums
        return checksum_preference(sock.getpeername()[0], tls=self._tls is not None)

    def _secured(self, sock: socket.socket, deadline: float) -> socket.socket:
        """`sock` after the server side of the TLS handshake; a peer without a certificate from
        the cluster's CA fails it (counted as an authentication failure)."""
        assert self._tls is not None, "called with TLS on"
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            return self._tls.server_context().wrap_socket(sock, server_side=True)
        except ssl.SSLError:
            if self._on_auth_failure is not None:
                self._on_auth_failure()
            raise

    def _collect(self, hello: Hello, sock: socket.socket, checksum: int) -> None:
        """Group the connections of one session; open it once all have arrived.

        A parked connection keeps its pending slot until its session opens or
        expires (`io_timeout` after its first connection).
        """
        with self._cond:
            if self._closed:
                group: dict[int, tuple[Hello, socket.socket]] = {hello.conn_index: (hello, sock)}
                self._release(group)
                return
            if hello.session_id not in self._pending:
                self._pending[hello.session_id] = (time.monotonic(), {})
                timer = threading.Timer(self.io_timeout, self._expire, (hello.session_id,))
                timer.daemon = True
                timer.start()
            _, group = self._pending[hello.session_id]
            old = group.get(hello.conn_index)
            group[hello.conn_index] = (hello, sock)
            if old is not None:  # the same connection index twice: keep the newest
                self._release({0: old})
            if len(group) < hello.num_conns:
                return
            del self._pending[hello.session_id]
        if sorted(group) != list(range(hello.num_conns)):  # its connections disagree on their count
            self._release(group)
            return
        for _ in group:
            self._pending_slots.release()
        first = group[0][0]
        socks = [group[i][1] for i in range(hello.num_conns)]
        session = self._open_session(first.peer, socks, checksum, first.extras, initiator=False)
        self._register(session)
        if self.on_link is not None:
            self.on_link(session)

    def _expire(self, session_id: str) -> None:
        """Close the parked connections of a session that did not complete in time."""
        with self._cond:
            entry = self._pending.pop(session_id, None)
        if entry is not None:
            logger.warning("transfer session %s incomplete after %.1fs: closed", session_id, self.io_timeout)
            self._release(entry[1])

    def _release(self, group: dict[int, tuple[Hello, socket.socket]]) -> None:
        for _, sock in group.values():
            sock.close()
            self._pending_slots.release()

    @staticmethod
    def _close_all(socks: list[socket.socket]) -> None:
        for sock in socks:
            sock.close()
