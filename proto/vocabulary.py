"""The words workers, the `disagg` CLI and the operator share, declared once.

Roles, transfer modes, transport names, devices, dtypes, default ports, the
connection bound, and the `InstanceClusterInfo` encoding (PROTOCOL.md). Both
sides import this module, so it imports neither torch nor grpc nor kopf:
only the protobuf messages.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from disagg.proto import disagg_pd_pb2 as pb


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # prefill and decode in one process, no KV transfer


# The roles the operator runs as pods (a mixed worker needs no operator).
POD_ROLES = (Role.PREFILL.value, Role.DECODE.value)


class TransferMode(str, enum.Enum):
    """`kv_cache_transfer_mode` on the wire, `--kv-transfer-mode`, `spec.kvTransfer.mode`."""

    PUSH = "PUSH"  # the prefill writes each layer into the decode's blocks during its forward
    PULL = "PULL"  # the decode reads the prefill's blocks inside FirstGeneration


class Transport(str, enum.Enum):
    """KV data paths by name; `disagg.workers.transfer.TRANSPORTS` registers one class per member (a test pins it)."""

    TCP = "tcp"
    CUDA_IPC = "cuda_ipc"
    NCCL = "nccl"


class PDPolicy(str, enum.Enum):
    """Whether a prefill hands every request off: `--pd-policy`, `spec.kvTransfer.policy` (workers/pd/decision.py)."""

    ALWAYS = "always"  # every request goes to a decode
    AUTO = "auto"  # per request, by measured costs: some are served on the prefill itself


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # "auto": bfloat16 on CUDA and CPUs with native bf16

# Every worker pod has its own IP, so the operator uses these same defaults in every pod.
HTTP_PORT = 8000  # the OpenAI API, /health, /ready, /metrics
GRPC_PORT = 7777  # DisaggPDService
TRANSFER_PORT = 26000  # the KV data path
# Our own call beside DisaggPDService on the gRPC port (not xLLM's): a worker's InstanceClusterInfo,
# so that `disagg link` needs only the workers' gRPC addresses, whatever their transfer ports.
DESCRIBE_METHOD = "/disagg.v1.Worker/Describe"
# /drain and (as on the HTTP port) xLLM's HTTP link routes; by default the HTTP port + the offset,
# so that workers given distinct HTTP ports on one host get distinct admin ports too.
ADMIN_PORT_OFFSET = 100
ADMIN_PORT = HTTP_PORT + ADMIN_PORT_OFFSET
# Where a worker reads its client API key (the operator sets it from a Secret); an
# environment variable stays out of `ps`, where a flag would show.
API_KEY_ENV = "DISAGG_API_KEY"
MAX_PORT = 65535
MAX_KV_CONNECTIONS = 64  # TCP connections a decode may open per link
# --kv-checksum: auto, or a transfer.wire.ChecksumKind name in lower case.
KV_CHECKSUMS = ("auto", "xxh3", "crc32", "none")


def _choices(enum_type: type[enum.Enum]) -> tuple[str, ...]:
    return tuple(str(m.value) for m in enum_type)


TRANSFER_MODES = _choices(TransferMode)
TRANSPORTS = _choices(Transport)
PD_POLICIES = _choices(PDPolicy)


# --- InstanceClusterInfo ----------------------------------------------------------


def cluster_id(transfer_address: str) -> int:
    """`ip << 32 | port` of an IPv4 "ip:port" (PROTOCOL.md's cluster_id)."""
    host, _, port = transfer_address.rpartition(":")
    return int(ipaddress.IPv4Address(host)) << 32 | int(port)


def address_of_cluster_id(value: int) -> str:
    port = value & 0xFFFF_FFFF
    if not 0 < port <= MAX_PORT:
        raise ValueError(f"cluster_id {value:#x} holds no valid port")
    return f"{ipaddress.IPv4Address(value >> 32)}:{port}"


def rank0_transfer_address(addrs: Sequence[str], cluster_ids: Sequence[int]) -> str | None:
    """Worker rank 0's transfer "ip:port" as given: `addrs[0]`, else decoded
    from `cluster_ids[0]`; None when both lists are empty."""
    if addrs:
        return addrs[0]
    if cluster_ids:
        return address_of_cluster_id(cluster_ids[0])
    return None


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
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= MAX_PORT:
            raise ValueError(f"instance {msg.instance_name}: transfer address {address!r} is not host:port")
        return cls(msg.instance_name, address)

    def to_proto(self) -> pb.InstanceClusterInfo:
        host, _, port = self.transfer_address.rpartition(":")
        return pb.InstanceClusterInfo(
            instance_name=self.name,
            cluster_ids=[cluster_id(self.transfer_address)],
            addrs=[self.transfer_address],
            device_ips=[host],
            ports=[int(port)],
            dp_size=1,
        )
