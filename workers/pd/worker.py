"""A prefill or decode worker: its role's parts, engine and gRPC server.

`build_prefill` and `build_decode` (the builders `server.ROLES` names) load the
model and start the transfer listener (blocking, in the loader thread);
`PDWorker.start` then joins the event loop: the role's watchers and the gRPC
server of the role's handlers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from disagg.proto.vocabulary import InstanceInfo
from disagg.workers.config import Role, ServerConfig, default_kv_connections, prefill_step_cap
from disagg.workers.engine.config import EngineConfig
from disagg.workers.http.backend import Backend, Health, LoadedEngine, load_engine
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.clients import PeerClients
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.cpu_turns import DecodeTurns, PrefillTurns
from disagg.workers.pd.decision import DecisionPolicy
from disagg.workers.pd.decode import DecodeRole
from disagg.workers.pd.messages import TransferMode
from disagg.workers.pd.prefill import PrefillRole
from disagg.workers.pd.service import Handlers, build_grpc_server
from disagg.workers.security.control import ControlGuard
from disagg.workers.transfer import BlockAccess, KVLayout, KVTransport, create_transport
from disagg.workers.transfer.wire import ChecksumKind

log = logging.getLogger(__name__)


class PDWorker:
    """A role plus its gRPC server."""

    def __init__(self, role: PrefillRole | DecodeRole, backend: Backend | None, server_config: ServerConfig,
                 config: PDConfig, guard: ControlGuard, identity: InstanceInfo) -> None:
        self.role = role
        self.identity = identity  # what DESCRIBE_METHOD answers
        self._backend = backend
        self._guard = guard
        self._server_config = server_config
        self._config = config
        self._grpc: grpc.aio.Server | None = None

    @property
    def health(self) -> Health:
        return self.role

    @property
    def backend(self) -> Backend | None:
        """The completion backend; None for a decode, which takes no client requests."""
        return self._backend

    @property
    def handlers(self) -> Handlers:
        return self.role.handlers()

    async def start(self) -> None:
        await self.role.start()
        address = f"{self._server_config.host}:{self._server_config.grpc_port}"
        tls = self._server_config.tls
        self._grpc = build_grpc_server(self.handlers, address, self._config.max_message_bytes, self._guard,
                                       self.identity, None if tls is None else tls.grpc_server_credentials())
        await self._grpc.start()
        log.info("DisaggPDService of %s on %s%s", self._server_config.instance_name, address,
                 " (mutual TLS)" if tls is not None else "")

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self.role.stop()

    def close(self) -> None:
        self.role.close()


@dataclass(frozen=True)
class _Parts:
    """What either role is built from: a loaded engine whose transfer listener runs."""

    loaded: LoadedEngine
    transport: KVTransport
    transfer_address: str  # where peers reach this worker's data path
    clients: PeerClients
    config: PDConfig
    guard: ControlGuard  # checks every control call
    instance_name: str

    @property
    def identity(self) -> InstanceInfo:
        return InstanceInfo(self.instance_name, self.transfer_address)


def build_prefill(engine_config: EngineConfig, server_config: ServerConfig,
                  metrics: WorkerMetrics, config: PDConfig | None = None) -> PDWorker:
    """A prefill worker: its role is also the client completion Backend."""
    parts = _load(engine_config, server_config, metrics, config)
    loaded = parts.loaded
    mode = TransferMode(server_config.kv_transfer_mode.value)
    policy = DecisionPolicy(server_config.pd_policy, server_config.pd_local_max_tokens,
                            server_config.pd_local_max_running)
    role = PrefillRole(loaded.engine, loaded.tokenizer, loaded.model, parts.transport, parts.clients, metrics,
                       parts.config, server_config.instance_name, parts.transfer_address, mode, policy)
    if server_config.cpu_turn_dir is not None:
        loaded.engine.set_step_gate(PrefillTurns(server_config.cpu_turn_dir, prefill_step_cap(engine_config)))
    loaded.engine.start()  # after the role installed its layer hook
    return PDWorker(role, role, server_config, parts.config, parts.guard, parts.identity)


def build_decode(engine_config: EngineConfig, server_config: ServerConfig,
                 metrics: WorkerMetrics, config: PDConfig | None = None) -> PDWorker:
    """A decode worker: no completion Backend."""
    parts = _load(engine_config, server_config, metrics, config)
    loaded = parts.loaded
    role = DecodeRole(loaded.engine, loaded.tokenizer, loaded.model, parts.transport, parts.clients, metrics,
                      parts.config)
    if server_config.cpu_turn_dir is not None:
        loaded.engine.set_step_gate(DecodeTurns(server_config.cpu_turn_dir, server_config.cpu_turn_wait_s))
    loaded.engine.start()
    return PDWorker(role, None, server_config, parts.config, parts.guard, parts.identity)


def _load(engine_config: EngineConfig, server_config: ServerConfig, metrics: WorkerMetrics,
          config: PDConfig | None) -> _Parts:
    """Load the model (not started yet) and start the transfer listener."""
    config = config or PDConfig(stream_idle_timeout_s=server_config.stream_idle_timeout_s,
                                prefix_reuse=server_config.kv_prefix_reuse,
                                max_migrations=server_config.max_migrations)
    loaded = load_engine(engine_config, server_config.served_model_name)
    pool = loaded.engine.kv_pool
    # The model identity in the layout: two workers link only if they serve the same source.
    layout = KVLayout.of_pool(pool, engine_config.model)
    name = server_config.instance_name
    connections = server_config.kv_connections or default_kv_connections()
    key = server_config.cluster_key
    forced = server_config.kv_checksum
    checksums = None if forced == "auto" else [ChecksumKind[forced.upper()]]
    transport = create_transport(server_config.kv_transport.value, pool, layout, name, name,
                                 num_connections=connections, key=key, checksums=checksums,
                                 on_auth_failure=lambda: metrics.count_auth_failure("transfer"),
                                 access=BlockAccess(on_refused=lambda: metrics.count_auth_failure("transfer")),
                                 accepts_links=server_config.role is Role.PREFILL,  # a decode opens its own
                                 tls=server_config.tls)
    bound = transport.start(server_config.host, server_config.transfer_port)
    transfer_address = f"{server_config.instance_host}:{bound.rpartition(':')[2]}"
    guard = ControlGuard(key, server_config.allow_anonymous_peers, metrics.count_auth_failure)
    tls = None if server_config.tls is None else server_config.tls.grpc_channel_credentials()
    return _Parts(loaded, transport, transfer_address, PeerClients(config, key, tls), config, guard, name)
