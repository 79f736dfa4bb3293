"""How a worker process serves: its role, addresses and KV transfer settings.

The engine's own settings (model, device, blocks) live in
`disagg.workers.engine.config.EngineConfig`; `disagg.workers.args` builds both
from the command line.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import os
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path

from disagg.proto.vocabulary import (
    ADMIN_PORT,
    GRPC_PORT,
    HTTP_PORT,
    KV_CHECKSUMS,
    MAX_KV_CONNECTIONS,
    MAX_PORT,
    TRANSFER_PORT,
    PDPolicy,
    Role,
    TransferMode,
    Transport,
)

from disagg.workers.engine.config import EngineConfig
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.cpu_turns import DEFAULT_DECODE_WAIT_S
from disagg.workers.pd.decision import DecisionPolicy
from disagg.workers.security.key import ClusterKey
from disagg.workers.security.tls import TlsFiles

__all__ = ["CorsPolicy", "Role", "ServerConfig", "TransferMode", "Transport", "default_kv_connections",
           "default_step_tokens", "default_threads", "usable_cpus"]

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
# What only a prefill or a decode reads: its KV transfer, hand-off policy and migrations (`ignored_settings`).
_PD_SETTINGS = frozenset({"kv_transfer_mode", "kv_transport", "kv_connections", "kv_checksum", "stream_idle_timeout_s",
                          "kv_prefix_reuse", "max_migrations", "pd_policy", "pd_local_max_tokens",
                          "pd_local_max_running"})


@dataclass(frozen=True)
class CorsPolicy:
    """Which browser pages may call the client API (CORS), vLLM's flags and defaults:
    any origin, method and header, without credentials."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


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
    http_port: int = HTTP_PORT
    grpc_port: int = GRPC_PORT
    transfer_port: int = TRANSFER_PORT
    admin_port: int = ADMIN_PORT  # /drain (state changes, off the client port) and xLLM's HTTP link routes
    served_model_name: str | None = None  # None: the --model source
    kv_transfer_mode: TransferMode = TransferMode.PUSH
    kv_transport: Transport = Transport.TCP
    # TCP connections a decode opens per link (the prefill takes what comes).
    # None: default_kv_connections().
    kv_connections: int | None = None
    # The payload checksum of TCP KV links: "auto" (none where it buys nothing:
    # loopback and TLS links; xxh3 elsewhere, see transfer.wire.checksum_preference),
    # or one of KV_CHECKSUMS forced on both the links a worker opens and those it accepts.
    kv_checksum: str = "auto"
    # Seconds to let in-flight requests finish after SIGTERM before the
    # server closes their connections.
    graceful_shutdown_s: float = 30.0
    # The cluster key that authenticates gRPC, the HTTP link routes and the
    # transfer handshake (docs/security.md). A prefill or decode needs it,
    # or `insecure` said on purpose.
    cluster_key: ClusterKey | None = None
    insecure: bool = False
    # Accept control calls that carry no credential at all (an xLLM peer); a wrong one is still refused.
    allow_anonymous_peers: bool = False
    # Mutual TLS for gRPC and the TCP KV transfer (security/tls.py); None: plaintext.
    tls: TlsFiles | None = None
    # torch's intra-op threads. None: default_threads().
    threads: int | None = None
    # A folder shared by a prefill and a decode on the same cores, through which
    # they take turns at stepping (workers/pd/cpu_turns.py); None: no turns.
    cpu_turn_dir: Path | None = None
    cpu_turn_wait_s: float = DEFAULT_DECODE_WAIT_S  # the longest a decode step waits for its turn
    # Clients of the OpenAI API send it as `Authorization: Bearer`; None: open.
    api_key: str | None = field(default=None, repr=False)
    cors: CorsPolicy = field(default_factory=CorsPolicy)
    # Client requests held beyond the engine's max_num_seqs before a 429; None: 4 x max_num_seqs.
    max_queued_requests: int | None = None
    # Also export the routing and latency metrics under vLLM's names (vllm:*).
    vllm_metric_aliases: bool = False
    # PDConfig.stream_idle_timeout_s, the one PD bound a user may want to set.
    stream_idle_timeout_s: float = PDConfig.stream_idle_timeout_s
    kv_prefix_reuse: bool = PDConfig.prefix_reuse  # PDConfig.prefix_reuse
    max_migrations: int = PDConfig.max_migrations
    # A prefill's hand-off policy (workers/pd/decision.py).
    pd_policy: PDPolicy = DecisionPolicy.mode
    pd_local_max_tokens: int = DecisionPolicy.local_max_tokens
    pd_local_max_running: int = DecisionPolicy.local_max_running

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "transfer_port", "admin_port"):
            port = getattr(self, name)
            if not 1 <= port <= MAX_PORT:
                raise ValueError(f"{name} must be between 1 and {MAX_PORT}, got {port}")
        ports = {self.http_port, self.grpc_port, self.transfer_port, self.admin_port}
        if len(ports) != 4:
            raise ValueError(
                f"http_port, grpc_port, transfer_port and admin_port must differ, got "
                f"{self.http_port}, {self.grpc_port}, {self.transfer_port}, {self.admin_port}"
            )
        if not self.host:
            raise ValueError("host must not be empty")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        if self.graceful_shutdown_s < 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}")
        if self.cluster_key is not None and self.insecure:
            raise ValueError("a cluster key and --insecure exclude each other")
        if self.role is not Role.MIXED and self.cluster_key is None and not self.insecure:
            raise ValueError(
                f"a {self.role.value} worker needs the cluster key: --cluster-key-file PATH (or the environment "
                "variable DISAGG_CLUSTER_KEY_FILE); --insecure runs without authentication, for a trusted network only"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be blank")
        DecisionPolicy(self.pd_policy, self.pd_local_max_tokens, self.pd_local_max_running)  # raises if out of range
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not 0 < self.stream_idle_timeout_s < math.inf:  # NaN too: it would turn the idle failover off
            raise ValueError(f"stream_idle_timeout_s must be positive and finite, got {self.stream_idle_timeout_s}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.kv_connections is not None and not 1 <= self.kv_connections <= MAX_KV_CONNECTIONS:
            raise ValueError(f"kv_connections must be between 1 and {MAX_KV_CONNECTIONS}, got {self.kv_connections}")
        if self.kv_checksum not in KV_CHECKSUMS:
            raise ValueError(f"kv_checksum must be one of {', '.join(KV_CHECKSUMS)}, got {self.kv_checksum!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.threads is None:
            default_threads()  # raises on a bad $OMP_NUM_THREADS, before anything loads
        if self.cpu_turn_dir is not None and self.role is Role.MIXED:
            raise ValueError("--cpu-turn-dir is for a prefill and a decode sharing cores; a mixed worker "
                             "orders its own steps")
        if not 0 < self.cpu_turn_wait_s < math.inf:
            raise ValueError(f"cpu_turn_wait_s must be positive and finite, got {self.cpu_turn_wait_s}")
        if self.role is not Role.MIXED:
            _ = self.instance_host  # raises for what names no IPv4 address, before anything loads

    def ignored_settings(self) -> list[str]:
        """The settings given (not at their defaults) that this role does not read: a mixed worker
        has no KV transfer, hand-off or migration."""
        if self.role is not Role.MIXED:
            return []
        return [f.name for f in fields(self)
                if f.name in _PD_SETTINGS and getattr(self, f.name) != f.default]

    @property
    def num_threads(self) -> int:
        return default_threads() if self.threads is None else self.threads

    @functools.cached_property
    def instance_host(self) -> str:
        """The IPv4 address of this worker's instance name (`<ip>:<grpc port>`): --advertise-host,
        else the address it binds (127.0.0.1 for a wildcard), a name resolved once. ValueError
        for what is none: xLLM's cluster_id packs an IPv4 address."""
        flag = "--advertise-host" if self.advertise_host else "--host"
        host = self.advertise_host or ("127.0.0.1" if _is_wildcard(self.host) else self.host)
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            pass
        try:
            return socket.gethostbyname(host)
        except (OSError, UnicodeError) as exc:
            raise ValueError(f"{flag} {host!r} is not an IPv4 address or a name that resolves to one ({exc}): a "
                             f"{self.role.value} names itself by its IPv4 address (xLLM's cluster_id packs one)") from None

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


# A prefill's engine step on a CPU (see default_step_tokens).
PREFILL_CPU_STEP_TOKENS = 512


def default_step_tokens(role: Role, engine: EngineConfig, cpu_turns: bool = False) -> int:
    """The token budget of one engine step when --max-num-batched-tokens is not given.

    A prefill on a CPU takes PREFILL_CPU_STEP_TOKENS: its steps compute prompts
    only, and every prompt of a step waits for the last one's first token. One
    prompt of a few hundred tokens already keeps a CPU's projections
    compute-bound (893 ms per 256-token prompt in steps of 8 prompts or of 2,
    985 ms alone; docs/benchmarks.md), so a larger step adds no throughput, only
    first-token latency. A mixed worker or a decode keeps the engine's default:
    its decodes ride in its steps. A GPU does too: it needs large steps to fill.
    A prefill taking turns with a decode on shared CPUs (`cpu_turns`) keeps the
    engine's default too: its turns narrow its steps to PREFILL_CPU_STEP_TOKENS
    only while a decode has requests (workers/pd/cpu_turns.py says why).
    """
    cap = prefill_step_cap(engine) if role is Role.PREFILL and not cpu_turns else None
    return engine.max_num_batched_tokens if cap is None else cap


def prefill_step_cap(engine: EngineConfig) -> int | None:
    """A prefill's small step where its engine runs on a CPU (PREFILL_CPU_STEP_TOKENS), else None."""
    return PREFILL_CPU_STEP_TOKENS if engine.torch_device.type == "cpu" else None


def default_threads(cpus: int | None = None) -> int:
    """Compute threads of a worker: $OMP_NUM_THREADS when set (the OpenMP
    convention torch follows too), else every CPU this process may use.

    Workers that share a machine (`disagg demo`, the benchmarks) take every
    CPU each, not a share: their OpenMP threads wait passively (cli.py), so a
    worker with nothing to do leaves the cores to the other, and one that
    computes alone has all of them. A prefill and a decode sharing 2 cores
    served 0.84x to 1.01x the mixed worker's tokens per second this way,
    against 0.53x to 0.81x with a core each (docs/benchmarks.md).
    """
    if cpus is None and (env := os.environ.get("OMP_NUM_THREADS")):
        try:
            threads = int(env)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS must be a whole number, got {env!r}") from None
        if threads < 1:
            raise ValueError(f"OMP_NUM_THREADS must be at least 1, got {threads}")
        return threads
    return max(1, usable_cpus() if cpus is None else cpus)
