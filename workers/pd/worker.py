"""A prefill or decode worker: the role picks its classes here, and only here.

`build_role` loads the model and starts the transfer listener (blocking, in
the loader thread); `PDWorker.start` then joins the event loop: the role's
watchers and the gRPC server of DisaggPDService.
"""

from __future__ import annotations

import logging

import grpc

from disagg.workers.config import Role, ServerConfig, default_kv_connections
from disagg.workers.engine.config import EngineConfig
from disagg.workers.http.backend import ModelInfo
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.clients import PeerClients
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.decode import DecodeRole
from disagg.workers.pd.engine import PDAsyncEngine, PDEngine
from disagg.workers.pd.messages import TransferMode
from disagg.workers.pd.prefill import PrefillRole
from disagg.workers.pd.service import build_grpc_server
from disagg.workers.security.control import ControlGuard
from disagg.workers.transfer import BlockAccess, KVLayout, create_transport

log = logging.getLogger(__name__)


class PDWorker:
    """A role plus its gRPC server; the HTTP backend is the role itself."""

    def __init__(self, role: PrefillRole | DecodeRole, server_config: ServerConfig, config: PDConfig,
                 guard: ControlGuard) -> None:  # fmt: skip
        self.role = role
        self._guard = guard
        self._server_config = server_config
        self._config = config
        self._grpc: grpc.aio.Server | None = None

    @property
    def backend(self) -> PrefillRole | DecodeRole:
        """The role serves HTTP too: a prefill takes client requests, a decode refuses them."""
        return self.role

    async def start(self) -> None:
        await self.role.start()
        address = f"{self._server_config.host}:{self._server_config.grpc_port}"
        self._grpc = build_grpc_server(self.role, address, self._config.max_message_bytes,
                                       serves_generations=isinstance(self.role, PrefillRole),
                                       guard=self._guard)  # fmt: skip
        await self._grpc.start()
        log.info("DisaggPDService of %s on %s", self._server_config.instance_name, address)

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self.role.stop()


def build_worker(engine_config: EngineConfig, server_config: ServerConfig,
                 metrics: WorkerMetrics, config: PDConfig | None = None) -> PDWorker:  # fmt: skip
    """Load the model, start the engine and the transfer listener, build the role."""
    assert server_config.role in (Role.PREFILL, Role.DECODE), "the mixed role has no PD worker"
    config = config or PDConfig()
    llm = PDEngine.from_config(engine_config)
    assert isinstance(llm, PDEngine) and llm.tokenizer is not None, "from_config builds the class and its tokenizer"
    model = ModelInfo(
        name=server_config.served_model_name or engine_config.model, source=engine_config.model,
        max_model_len=llm.max_model_len, vocab_size=llm.model_config.vocab_size,
    )  # fmt: skip
    # The model identity in the layout: two workers link only if they serve the same source.
    layout = KVLayout.of_pool(llm.kv_cache.tensor, engine_config.model)
    name = server_config.instance_name
    connections = server_config.kv_connections or default_kv_connections()
    key = server_config.cluster_key
    transport = create_transport(server_config.kv_transport.value, llm.kv_cache.tensor, layout, name, name,
                                 num_connections=connections, key=key,
                                 on_auth_failure=lambda: metrics.count_auth_failure("transfer"),
                                 access=BlockAccess(on_refused=lambda: metrics.count_auth_failure("transfer")),
                                 accepts_links=server_config.role is Role.PREFILL)  # a decode opens its own  # fmt: skip
    bound = transport.start(server_config.host, server_config.transfer_port)
    transfer_address = f"{server_config.instance_host}:{bound.rpartition(':')[2]}"
    engine = PDAsyncEngine(llm)
    clients = PeerClients(config, key)
    role: PrefillRole | DecodeRole
    if server_config.role is Role.PREFILL:
        mode = TransferMode(server_config.kv_transfer_mode.value)
        role = PrefillRole(engine, llm.tokenizer, model, transport, clients, metrics, config, name,
                           transfer_address, mode)  # fmt: skip
    else:
        role = DecodeRole(engine, llm.tokenizer, model, transport, clients, metrics, config)
    engine.start()
    guard = ControlGuard(key, server_config.allow_anonymous_peers, metrics.count_auth_failure)
    return PDWorker(role, server_config, config, guard)
