"""How a worker process serves: its role, addresses and KV transfer settings.

The engine's own settings (model, device, blocks) live in
`disagg.workers.engine.config.EngineConfig`; `disagg.workers.args` builds both
from the command line.
"""

from __future__ import annotations

import enum
import ipaddress
import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
MAX_KV_CONNECTIONS = 64


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # prefill and decode in one process, no KV transfer


class KvTransferMode(str, enum.Enum):
    PUSH = "PUSH"  # the prefill writes each layer's KV into the decode's blocks
    PULL = "PULL"  # the decode reads the KV from the prefill inside FirstGeneration


class KvTransport(str, enum.Enum):
    TCP = "tcp"
    CUDA_IPC = "cuda_ipc"
    NCCL = "nccl"


@dataclass(frozen=True)
class ServerConfig:
    """One worker's serving settings. Ports are validated here so that a typo
    fails at start, not when a peer first connects."""

    role: Role = Role.MIXED
    host: str = "0.0.0.0"
    # The address peers and the operator reach this worker at. None: `host`,
    # or loopback when `host` is a wildcard (a single-machine setup; pods
    # pass their IP).
    advertise_host: str | None = None
    http_port: int = 8000
    grpc_port: int = 7777
    transfer_port: int = 26000
    served_model_name: str | None = None  # None: the --model source
    kv_transfer_mode: KvTransferMode = KvTransferMode.PUSH
    kv_transport: KvTransport = KvTransport.TCP
    # TCP connections a decode opens per link (the prefill takes what comes).
    # None: default_kv_connections().
    kv_connections: int | None = None
    # Seconds to let in-flight requests finish after SIGTERM before the
    # server closes their connections.
    graceful_shutdown_s: float = 30.0
    # Also export the routing and latency metrics under vLLM's names (vllm:*).
    vllm_metric_aliases: bool = False

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "transfer_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise ValueError(f"{name} must be between 1 and 65535, got {port}")
        ports = {self.http_port, self.grpc_port, self.transfer_port}
        if len(ports) != 3:
            raise ValueError(
                f"http_port, grpc_port and transfer_port must differ, got "
                f"{self.http_port}, {self.grpc_port}, {self.transfer_port}"
            )
        if not self.host:
            raise ValueError("host must not be empty")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        if self.graceful_shutdown_s < 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}")
        if self.kv_connections is not None and not 1 <= self.kv_connections <= MAX_KV_CONNECTIONS:
            raise ValueError(f"kv_connections must be between 1 and {MAX_KV_CONNECTIONS}, got {self.kv_connections}")

    @property
    def instance_host(self) -> str:
        """The host part of this worker's instance name (`<ip>:<grpc port>`)."""
        if self.advertise_host:
            return self.advertise_host
        if _is_wildcard(self.host):
            return "127.0.0.1"
        return self.host

    @property
    def instance_name(self) -> str:
        return f"{self.instance_host}:{self.grpc_port}"


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a pod's limit)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
        limit = math.ceil(int(quota) / int(period))
    except (OSError, ValueError):  # no cgroup v2 file, "max" (no quota), or unreadable
        return cpus
    return max(1, min(cpus, limit))


def default_kv_connections(cpus: int | None = None) -> int:
    """One connection per two usable CPUs, from 1 to 4.

    Each connection streams on its own sender and reader threads: with CPUs to
    spare, more connections fill a NIC; on 2 CPUs, where one connection keeps
    both ends busy, more only contend (docs/benchmarks-transfer.md).
    """
    return max(1, min(4, (usable_cpus() if cpus is None else cpus) // 2))
