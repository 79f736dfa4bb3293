"""A prefill or decode worker: its role's parts, engine and gRPC server.

`build_worker` loads the model and starts the transfer listener (blocking, in
the loader thread); `PDWorker.start` then joins the event loop: the role's
watchers and the gRPC server of the role's handlers.
"""

from __future__ import annotations

import logging

import grpc

from disagg.workers.config import Role, ServerConfig, default_kv_connections
from disagg.workers.engine.config import EngineConfig
from disagg.workers.http.backend import Backend, Health, load_engine
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.clients import PeerClients
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.decode import DecodeRole
from disagg.workers.pd.messages import TransferMode
from disagg.workers.pd.prefill import PrefillRole
from disagg.workers.pd.service import Handlers, build_grpc_server
from disagg.workers.transfer import KVLayout, create_transport

log = logging.getLogger(__name__)


class PDWorker:
    """A role plus its gRPC server."""

    def __init__(self, role: PrefillRole | DecodeRole, server_config: ServerConfig, config: PDConfig) -> None:
        self.role = role
        self._server_config = server_config
        self._config = config
        self._grpc: grpc.aio.Server | None = None

    @property
    def health(self) -> Health:
        return self.role

    @property
    def backend(self) -> Backend | None:
        """A prefill serves client completions; a decode serves none."""
        return self.role if isinstance(self.role, PrefillRole) else None

    @property
    def handlers(self) -> Handlers:
        return self.role.handlers()

    async def start(self) -> None:
        await self.role.start()
        address = f"{self._server_config.host}:{self._server_config.grpc_port}"
        self._grpc = build_grpc_server(self.handlers, address, self._config.max_message_bytes)
        await self._grpc.start()
        log.info("DisaggPDService of %s on %s", self._server_config.instance_name, address)

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self.role.stop()

    def close(self) -> None:
        self.role.close()


def build_worker(engine_config: EngineConfig, server_config: ServerConfig,
                 metrics: WorkerMetrics, config: PDConfig | None = None) -> PDWorker:  # fmt: skip
    """Load the model, start the engine and the transfer listener, build the role."""
    assert server_config.role in (Role.PREFILL, Role.DECODE), "the mixed role has no PD worker"
    config = config or PDConfig()
    loaded = load_engine(engine_config, server_config.served_model_name)
    pool = loaded.engine.kv_pool
    # The model identity in the layout: two workers link only if they serve the same source.
    layout = KVLayout.of_pool(pool, engine_config.model)
    name = server_config.instance_name
    connections = server_config.kv_connections or default_kv_connections()
    transport = create_transport(server_config.kv_transport.value, pool, layout, name, name,
                                 num_connections=connections)  # fmt: skip
    bound = transport.start(server_config.host, server_config.transfer_port)
    transfer_address = f"{server_config.instance_host}:{bound.rpartition(':')[2]}"
    clients = PeerClients(config)
    role: PrefillRole | DecodeRole
    if server_config.role is Role.PREFILL:
        mode = TransferMode(server_config.kv_transfer_mode.value)
        role = PrefillRole(loaded.engine, loaded.tokenizer, loaded.model, transport, clients, metrics, config, name,
                           transfer_address, mode)  # fmt: skip
    else:
        role = DecodeRole(loaded.engine, loaded.tokenizer, loaded.model, transport, clients, metrics, config)
    loaded.engine.start()
    return PDWorker(role, server_config, config)
