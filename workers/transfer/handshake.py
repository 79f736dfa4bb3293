"""The link handshake: the first bytes on every transfer connection.

The decode opens the data path to a prefill; on each of its connections:

    initiator (decode)                      acceptor (prefill)
    HELLO     name, gRPC address, layout,
              transport, connection i of n,
              checksums, nonce_i        -->
                                        <-- CHALLENGE  nonce_a, acceptor name
    PROOF     proof_i                   -->
                                        <-- REPLY      ok (with proof_a, layout) or a refusal

where proof_x = ClusterKey.proof(side, nonce_i, nonce_a, initiator name,
acceptor name, session id, i): each side shows it holds the cluster key,
bound to this connection of this link, and nothing else. Until the
initiator's proof checks out the acceptor reveals nothing but its name (a
refusal then only says "authentication failed"); after it, a refusal has a
reason (a layout mismatch is never a silent garbage decode). Without a key
(--insecure) the proofs are empty and not checked. Every message is

    <4s H B B I>  magic "DKVH", version, kind, reserved, body length
    body          UTF-8 JSON object, at most MAX_BODY_BYTES

and the whole exchange has one deadline, not one per read. Transports add
their own fields under "extras" (e.g. a CUDA IPC handle).
"""

from __future__ import annotations

import json
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg.workers.security.key import AuthError, ClusterKey
from disagg.workers.transfer.base import KVLayout, LinkRefusedError, PeerInfo, TransferError, TransferTimeout

MAGIC = b"DKVH"
VERSION = 2
PREFIX = struct.Struct("<4sHBBI")
MAX_BODY_BYTES = 1 << 20
_HELLO = 1
_REPLY = 2
_CHALLENGE = 3
_PROOF = 4


class HandshakeError(TransferError):
    """A malformed or unexpected handshake message."""


@dataclass(frozen=True)
class Hello:
    """Sent by the side that opens the link (the decode), once per connection."""

    peer: PeerInfo
    transport: str
    session_id: str  # groups the connections of one session
    conn_index: int
    num_conns: int
    checksums: list[int]  # wire.ChecksumKind values, best first
    extras: dict[str, Any] = field(default_factory=dict)
    nonce: str = field(default_factory=lambda: secrets.token_hex(16))

    def to_json(self) -> dict[str, Any]:
        return {
            "nonce": self.nonce,
            "name": self.peer.name,
            "grpc_address": self.peer.grpc_address,
            "layout": self.peer.layout.to_dict(),
            "transport": self.transport,
            "session_id": self.session_id,
            "conn_index": self.conn_index,
            "num_conns": self.num_conns,
            "checksums": self.checksums,
            "extras": self.extras,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Hello:
        try:
            hello = cls(
                PeerInfo(str(body["name"]), str(body["grpc_address"]), KVLayout.from_dict(body["layout"])),
                str(body["transport"]),
                str(body["session_id"]),
                int(body["conn_index"]),
                int(body["num_conns"]),
                [int(kind) for kind in body["checksums"]],
                dict(body.get("extras", {})),
                str(body["nonce"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(1e400)
            raise HandshakeError(f"malformed HELLO: {exc}") from exc
        if not 0 <= hello.conn_index < hello.num_conns <= 64:
            raise HandshakeError(f"HELLO connection {hello.conn_index} of {hello.num_conns} is out of range")
        return hello


@dataclass(frozen=True)
class Reply:
    """The accepting side's answer; `peer` is the acceptor when ok."""

    ok: bool
    reason: str = ""
    peer: PeerInfo | None = None
    checksum: int = 0  # the wire.ChecksumKind both sides will use
    extras: dict[str, Any] = field(default_factory=dict)
    proof: str = ""  # the acceptor's proof of the key, when ok

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"ok": self.ok, "reason": self.reason, "checksum": self.checksum,
                                "extras": self.extras, "proof": self.proof}
        if self.peer is not None:
            body.update(name=self.peer.name, grpc_address=self.peer.grpc_address, layout=self.peer.layout.to_dict())
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Reply:
        try:
            peer = None
            if "layout" in body:
                peer = PeerInfo(str(body["name"]), str(body["grpc_address"]), KVLayout.from_dict(body["layout"]))
            return cls(bool(body["ok"]), str(body["reason"]), peer, int(body["checksum"]), dict(body["extras"]),
                       str(body["proof"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise HandshakeError(f"malformed REPLY: {exc}") from exc


@dataclass(frozen=True)
class Challenge:
    """The acceptor's nonce and name, sent before it has learned anything about the initiator's key."""

    nonce: str
    name: str


def bound_fields(hello: Hello, challenge: Challenge) -> tuple[str, ...]:
    """What both proofs of one connection are bound to."""
    return (hello.nonce, challenge.nonce, hello.peer.name, challenge.name, hello.session_id, str(hello.conn_index))


def _send(sock: socket.socket, kind: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert len(raw) <= MAX_BODY_BYTES, f"handshake body of {len(raw)} bytes is over {MAX_BODY_BYTES}"
    sock.sendall(PREFIX.pack(MAGIC, VERSION, kind, 0, len(raw)) + raw)


def _recv_by(sock: socket.socket, size: int, deadline: float) -> bytes:
    """Exactly `size` bytes before `deadline` (time.monotonic), however slowly they trickle in."""
    buffer = bytearray()
    while len(buffer) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("handshake deadline passed")
        sock.settimeout(remaining)
        chunk = sock.recv(min(size - len(buffer), 1 << 16))
        if not chunk:
            raise ConnectionError("peer closed the connection during the handshake")
        buffer += chunk
    return bytes(buffer)


def _recv(sock: socket.socket, kind: int, deadline: float) -> dict[str, Any]:
    try:
        magic, version, got_kind, _, length = PREFIX.unpack(_recv_by(sock, PREFIX.size, deadline))
        if magic != MAGIC:
            raise HandshakeError(f"not a disagg transfer handshake (magic {magic!r})")
        if version != VERSION:
            raise HandshakeError(f"handshake version {version} is not supported (this side speaks {VERSION})")
        if got_kind != kind or length > MAX_BODY_BYTES:
            raise HandshakeError(f"unexpected handshake message kind {got_kind} of {length} bytes")
        body = json.loads(_recv_by(sock, length, deadline))
    except socket.timeout as exc:
        raise TransferTimeout("the handshake did not complete in time") from exc
    except (ConnectionError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise HandshakeError(f"broken handshake: {exc!r}"[:200]) from exc  # RecursionError: "[[[[...", nested
    if not isinstance(body, dict):
        raise HandshakeError("handshake body is not a JSON object")
    return body


def send_hello(sock: socket.socket, hello: Hello) -> None:
    _send(sock, _HELLO, hello.to_json())


def recv_hello(sock: socket.socket, deadline: float) -> Hello:
    return Hello.from_json(_recv(sock, _HELLO, deadline))


def send_challenge(sock: socket.socket, challenge: Challenge) -> None:
    _send(sock, _CHALLENGE, {"nonce": challenge.nonce, "name": challenge.name})


def recv_challenge(sock: socket.socket, deadline: float) -> Challenge:
    body = _recv(sock, _CHALLENGE, deadline)
    try:
        return Challenge(str(body["nonce"]), str(body["name"]))
    except KeyError as exc:
        raise HandshakeError(f"malformed CHALLENGE: {exc}") from exc


def send_proof(sock: socket.socket, proof: str) -> None:
    _send(sock, _PROOF, {"proof": proof})


def recv_proof(sock: socket.socket, deadline: float) -> str:
    body = _recv(sock, _PROOF, deadline)
    if not isinstance(body.get("proof"), str):
        raise HandshakeError("malformed PROOF")
    return str(body["proof"])


def send_reply(sock: socket.socket, reply: Reply) -> None:
    _send(sock, _REPLY, reply.to_json())


def recv_reply(sock: socket.socket, deadline: float) -> Reply:
    return Reply.from_json(_recv(sock, _REPLY, deadline))


def initiate(sock: socket.socket, hello: Hello, key: ClusterKey | None, deadline: float,
             unwanted: Callable[[Challenge], str | None] = lambda _: None) -> tuple[Reply, Challenge]:
    """The initiator's whole handshake on one connection; the acceptor's REPLY and CHALLENGE.

    Raises LinkRefusedError when `unwanted` gives a reason to refuse the acceptor its
    CHALLENGE names (before the proof: an acceptor commits nothing, its sessions stay as
    they were) or when it accepts without proving the key (when this side has one); a
    refusing REPLY is returned as is.
    """
    send_hello(sock, hello)
    challenge = recv_challenge(sock, deadline)
    if (reason := unwanted(challenge)) is not None:
        raise LinkRefusedError(reason)
    bound = bound_fields(hello, challenge)
    send_proof(sock, key.proof("initiator", *bound) if key is not None else "")
    reply = recv_reply(sock, deadline)
    if reply.ok and key is not None:
        try:
            key.check_proof(reply.proof, "acceptor", *bound)
        except AuthError as exc:
            raise LinkRefusedError(f"transfer peer {challenge.name} does not hold the cluster key") from exc
    return reply, challenge
