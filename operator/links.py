"""What a link is: a worker incarnation as its peers know it, one link RPC and its outcome.

Semantics are PROTOCOL.md's: a link is made on the decode, payload = the
prefill's `InstanceClusterInfo`; an unlink is sent to whichever side is still
alive, payload = the other. Links are idempotent on the workers, so the
operator may re-assert them at any time. graph.py remembers what was made,
link_client.py sends the RPCs; this module needs no gRPC, so the pure
planners can import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.operator.manifests import GRPC_PORT, TRANSFER_PORT
from disagg.proto import disagg_pd_pb2
from disagg.proto.vocabulary import InstanceInfo


@dataclass(frozen=True)
class Endpoint:
    """One incarnation of a worker, as its peers know it."""

    pod: str
    incarnation: str  # "<pod uid>/<restart count>": a restarted worker has forgotten its links
    ip: str
    grpc_port: int = GRPC_PORT
    transfer_port: int = TRANSFER_PORT

    @property
    def instance_name(self) -> str:
        return f"{self.ip}:{self.grpc_port}"

    def cluster_info(self) -> disagg_pd_pb2.InstanceClusterInfo:
        """One worker rank per pod: each list has one entry."""
        return InstanceInfo(self.instance_name, f"{self.ip}:{self.transfer_port}").to_proto()


@dataclass(frozen=True)
class LinkOp:
    """One RPC: `LinkInstance`/`UnlinkInstance` on `target` with `payload`'s info."""

    link: bool
    target: Endpoint
    payload: Endpoint

    @property
    def verb(self) -> str:
        return "link" if self.link else "unlink"


@dataclass(frozen=True)
class LinkResult:
    op: LinkOp
    ok: bool
    error: str
    seconds: float
