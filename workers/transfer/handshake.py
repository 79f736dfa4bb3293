"""The link handshake: the first bytes on every transfer connection.

The decode opens the data path to a prefill and sends a HELLO on each of its
connections: its instance name, gRPC address, KV layout, the transport, which
connection of how many this is, and the checksums it can compute. The prefill
answers a REPLY: ok, or a refusal with a reason (a layout mismatch is never a
silent garbage decode). Both messages are

    <4s H B B I>  magic "DKVH", version, kind (1 HELLO, 2 REPLY), reserved, body length
    body          UTF-8 JSON object, at most MAX_BODY_BYTES

Transports add their own fields under "extras" (e.g. a CUDA IPC handle).
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from disagg.workers.transfer.base import KVLayout, PeerInfo, TransferError, TransferTimeout
from disagg.workers.transfer.wire import recv_exact

MAGIC = b"DKVH"
VERSION = 1
PREFIX = struct.Struct("<4sHBBI")
MAX_BODY_BYTES = 1 << 20
_HELLO = 1
_REPLY = 2


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

    def to_json(self) -> dict[str, Any]:
        return {
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
            )
        except (KeyError, TypeError, ValueError) as exc:
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

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"ok": self.ok, "reason": self.reason, "checksum": self.checksum, "extras": self.extras}
        if self.peer is not None:
            body.update(name=self.peer.name, grpc_address=self.peer.grpc_address, layout=self.peer.layout.to_dict())
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Reply:
        try:
            peer = None
            if "layout" in body:
                peer = PeerInfo(str(body["name"]), str(body["grpc_address"]), KVLayout.from_dict(body["layout"]))
            return cls(bool(body["ok"]), str(body["reason"]), peer, int(body["checksum"]), dict(body["extras"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise HandshakeError(f"malformed REPLY: {exc}") from exc


def _send(sock: socket.socket, kind: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert len(raw) <= MAX_BODY_BYTES, f"handshake body of {len(raw)} bytes is over {MAX_BODY_BYTES}"
    sock.sendall(PREFIX.pack(MAGIC, VERSION, kind, 0, len(raw)) + raw)


def _recv(sock: socket.socket, kind: int, timeout: float) -> dict[str, Any]:
    sock.settimeout(timeout)
    try:
        magic, version, got_kind, _, length = PREFIX.unpack(recv_exact(sock, PREFIX.size))
        if magic != MAGIC:
            raise HandshakeError(f"not a disagg transfer handshake (magic {magic!r})")
        if version != VERSION:
            raise HandshakeError(f"handshake version {version} is not supported (this side speaks {VERSION})")
        if got_kind != kind or length > MAX_BODY_BYTES:
            raise HandshakeError(f"unexpected handshake message kind {got_kind} of {length} bytes")
        body = json.loads(recv_exact(sock, length))
    except socket.timeout as exc:
        raise TransferTimeout(f"no handshake within {timeout:.1f}s") from exc
    except (ConnectionError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HandshakeError(f"broken handshake: {exc}") from exc
    if not isinstance(body, dict):
        raise HandshakeError("handshake body is not a JSON object")
    return body


def send_hello(sock: socket.socket, hello: Hello) -> None:
    _send(sock, _HELLO, hello.to_json())


def recv_hello(sock: socket.socket, timeout: float) -> Hello:
    return Hello.from_json(_recv(sock, _HELLO, timeout))


def send_reply(sock: socket.socket, reply: Reply) -> None:
    _send(sock, _REPLY, reply.to_json())


def recv_reply(sock: socket.socket, timeout: float) -> Reply:
    return Reply.from_json(_recv(sock, _REPLY, timeout))
