"""Launches a worker: the HTTP server starts at once (so /health answers while
the model loads), the role's worker is built in a thread and then started on
the loop (a PD role's gRPC server), and all stop gracefully on SIGTERM or
SIGINT: HTTP finishes its requests, then the requests still in flight over
gRPC (bounded by `graceful_shutdown_s`), then the gRPC server, the links
and the engine.

Everything runs in one asyncio loop, which the role's gRPC server can join;
the engine computes in its own background thread, so the loop stays free to
serve HTTP while a long prompt runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import uvicorn
from fastapi import FastAPI, Request

from disagg.workers import tracing
from disagg.workers.config import Role, ServerConfig
from disagg.workers.engine.config import EngineConfig
from disagg.workers.heap import freeze_startup_heap
from disagg.workers.local import LOOPBACK
from disagg.workers.http.app import AppState, build_admin_app, build_app
from disagg.workers.http.backend import Backend, Health
from disagg.workers.http.edge import Admission, RequestCheck, max_in_flight
from disagg.workers.http.errors import APIError
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.security.control import REFUSAL, ControlGuard

if TYPE_CHECKING:
    from disagg.workers.pd.service import Handlers

log = logging.getLogger(__name__)
_LOADER = "load-model"  # the thread that loads the model


class Worker(Protocol):
    """What a role runs: built (model loaded) in a thread, then started on the loop.

    `start` joins the event loop (a PD role's gRPC server); `stop` ends what
    `start` began, after the HTTP server has finished its requests; then
    `close()` stops the engine.
    """

    @property
    def health(self) -> Health: ...

    @property
    def backend(self) -> Backend | None:
        """The completion backend; None for a role that takes no client requests."""
        ...

    @property
    def handlers(self) -> Handlers | None:
        """The role's gRPC handlers, which also serve xLLM's HTTP link routes; None without PD."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def close(self) -> None: ...


# Builds a role's worker (blocking: it loads the model).
WorkerBuilder = Callable[[EngineConfig, ServerConfig, WorkerMetrics], Worker]


class _MixedWorker:
    """The mixed role: only the HTTP backend, nothing on the loop."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    @property
    def health(self) -> Health:
        return self._backend

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def handlers(self) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def close(self) -> None:
        self._backend.close()


def _build_mixed(engine_config: EngineConfig, server_config: ServerConfig, metrics: WorkerMetrics) -> Worker:
    from disagg.workers.http.backend import LocalEngineBackend

    return _MixedWorker(LocalEngineBackend.from_config(engine_config, server_config.served_model_name))


def _build_prefill(engine_config: EngineConfig, server_config: ServerConfig, metrics: WorkerMetrics) -> Worker:
    from disagg.workers.pd.worker import build_prefill

    return build_prefill(engine_config, server_config, metrics)


def _build_decode(engine_config: EngineConfig, server_config: ServerConfig, metrics: WorkerMetrics) -> Worker:
    from disagg.workers.pd.worker import build_decode

    return build_decode(engine_config, server_config, metrics)


@dataclass(frozen=True)
class RoleSpec:
    """What a role is, for the server: its builder, and which HTTP routes it serves.
    (The gRPC services follow from the handlers its worker has.)"""

    build: WorkerBuilder
    serves_completions: bool  # the OpenAI completion routes; else they answer 404
    link_routes: bool  # xLLM's HTTP form of LinkInstance / UnlinkInstance


# The role is decided here, and only here.
ROLES: dict[Role, RoleSpec] = {
    Role.MIXED: RoleSpec(_build_mixed, serves_completions=True, link_routes=False),
    Role.PREFILL: RoleSpec(_build_prefill, serves_completions=True, link_routes=True),
    Role.DECODE: RoleSpec(_build_decode, serves_completions=False, link_routes=True),
}


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, minus its own signal handling: `serve` below owns the
    signals, so that the whole worker (engine included) shuts down on them and
    the process exits 0 rather than re-raising the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """The sockets a server on HOST:PORT listens on, bound before anything starts (uvicorn would
    exit the process with a traceback): the address itself and, bound to a pod's own address, loopback
    too (`loopback_listener`). OSError naming the address when it cannot be had."""
    sock = _bound_socket(host, port)
    sock.set_inheritable(True)
    loopback = loopback_listener(host, port)
    return [sock] if loopback is None else [sock, loopback]


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """OSError naming the first of `ports` (what each is for -> port; 0 is any) that HOST cannot bind.

    gRPC and the KV transport bind only once the model has loaded; this tells of a taken port
    (and checks the others before the model source) at once. A check, not a reservation: the
    port is let go at once."""
    for purpose, port in ports.items():
        if port:
            try:
                _bound_socket(host, port).close()
            except OSError as exc:
                raise OSError(f"{exc} (the {purpose} port)") from exc


def _bound_socket(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds: "localhost" is IPv4
        info = socket.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def loopback_listener(host: str, port: int) -> socket.socket | None:
    """A socket bound to 127.0.0.1:`port` when `host` is one non-loopback IPv4 address, else None.

    The operator binds workers to their pod's IP, and `kubectl port-forward` connects to
    localhost inside the pod, which nothing else would listen on. Best effort: where
    another worker of the host has that loopback port, this one does without."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a name: what it resolves to is the listener's
    if address.version != 4 or address.is_loopback or address.is_unspecified:
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port))
    except OSError as exc:
        sock.close()
        log.warning("not listening on %s:%d as well (%s): kubectl port-forward will not reach this port",
                    LOOPBACK, port, exc)
        return None
    sock.set_inheritable(True)
    log.info("also listening on %s:%d, for kubectl port-forward", LOOPBACK, port)
    return sock


def run(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(server_config.num_threads)  # once, before the model loads
    torch.set_num_interop_threads(1)
    log.info("compute threads: %d (inter-op: %d)", torch.get_num_threads(), torch.get_num_interop_threads())
    if ignored := server_config.ignored_settings():
        log.warning("a %s worker ignores %s (for prefill and decode workers)", server_config.role.value,
                    ", ".join(ignored))
    try:
        tracing.configure(server_config.role.value, server_config.instance_name)
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    try:
        code = asyncio.run(serve(engine_config, server_config, ROLES[server_config.role]))
    finally:
        tracing.shutdown()  # exports the spans still buffered
    if any(t.name == _LOADER and t.is_alive() for t in threading.enumerate()):
        # Stopped while loading: an interpreter exit under the loader, inside torch's C++,
        # aborts the process (SIGABRT); nothing is left to clean up, so leave at once.
        logging.shutdown()
        os._exit(code)
    return code


def _add_link_routes(admin_app: FastAPI, client_app: FastAPI, guard: ControlGuard,
                     worker: Callable[[], Worker | None]) -> None:
    """xLLM's HTTP link calls on the admin port and on the HTTP port (DESIGN.md: the HTTP port
    accepts them), behind one memory of used credentials; the HTTP port, open to clients, refuses
    an anonymous call even with `allow_anonymous_peers`."""
    from disagg.workers.pd.service import add_link_routes

    def handlers() -> Handlers | None:
        current = worker()
        return None if current is None else current.handlers

    add_link_routes(admin_app, handlers, guard)
    add_link_routes(client_app, handlers, guard.refusing_anonymous())


def _signed_change(guard: ControlGuard) -> RequestCheck:
    """A drain started or ended on the admin port carries a cluster credential for its verb and
    path, as the operator signs it; anonymous calls are refused whatever `allow_anonymous_peers`
    says (no xLLM peer drains)."""
    strict = guard.refusing_anonymous()

    async def check(request: Request) -> None:
        if not strict.allows_http(request.method, request.url.path, request.headers, "http-admin"):
            raise APIError(REFUSAL, 401, "unauthenticated")

    return check


def _uvicorn(app: FastAPI, host: str, port: int, graceful_shutdown_s: float) -> _UvicornServer:
    return _UvicornServer(uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="info",
                                         access_log=False, timeout_graceful_shutdown=int(graceful_shutdown_s)))


async def serve(engine_config: EngineConfig, server_config: ServerConfig, spec: RoleSpec) -> int:
    """The admin server runs for the whole life of the worker (a drain is watched to its end)."""
    metrics = WorkerMetrics(server_config.role.value)
    if server_config.vllm_metric_aliases:
        metrics.add_vllm_aliases(server_config.served_model_name or engine_config.model)
    limit = max_in_flight(engine_config.max_num_seqs, server_config.max_queued_requests)
    state = AppState(metrics, Admission(limit))
    state.insecure = server_config.insecure
    state.cluster_key = server_config.cluster_key
    if server_config.insecure:
        log.warning("INSECURE: no cluster key (--insecure): anyone who reaches the gRPC, HTTP and transfer ports "
                    "can link, send requests and read or write KV blocks")
    started: list[Worker] = []  # the worker, once started: the link routes serve it from then on
    guard = ControlGuard(server_config.cluster_key, server_config.allow_anonymous_peers,
                         state.metrics.count_auth_failure)
    admin_app = build_admin_app(state, _signed_change(guard))
    client_app = build_app(state, client_api=spec.serves_completions, api_key=server_config.api_key,
                           cors=server_config.cors)
    if spec.link_routes:
        _add_link_routes(admin_app, client_app, guard, lambda: started[0] if started else None)
    try:
        admin_sockets, http_sockets = _startable(engine_config, server_config, spec)
    except (OSError, ValueError) as exc:  # ValueError: the loader's errors (ModelLoadError, ModelConfigError)
        log.error("%s", exc)
        return 2
    admin = _uvicorn(admin_app, server_config.host, server_config.admin_port, graceful_shutdown_s=1.0)
    admin_task = asyncio.create_task(admin.serve(admin_sockets), name="admin")
    try:
        return await _serve_clients(engine_config, server_config, spec, state, started, client_app, http_sockets)
    finally:
        admin.should_exit = True
        await admin_task


def _startable(engine_config: EngineConfig, server_config: ServerConfig, spec: RoleSpec
               ) -> tuple[list[socket.socket], list[socket.socket]]:
    """The admin and HTTP listening sockets, once every port and the model source are known to
    be usable: what would fail after the servers started (or the model loaded) fails here."""
    from disagg.workers.engine.loader import check_model_source

    host = server_config.host
    ports = {"HTTP": server_config.http_port, "admin": server_config.admin_port}
    if spec.link_routes:  # a prefill or a decode: its gRPC and KV transfer ports too
        ports |= {"gRPC": server_config.grpc_port, "KV transfer": server_config.transfer_port}
    check_ports_free(host, ports)
    check_model_source(engine_config.model)
    admin_sockets = listening_sockets(host, server_config.admin_port)
    try:
        return admin_sockets, listening_sockets(host, server_config.http_port)
    except OSError:
        for sock in admin_sockets:
            sock.close()
        raise


async def _serve_clients(engine_config: EngineConfig, server_config: ServerConfig, spec: RoleSpec,
                         state: AppState, started: list[Worker], app: FastAPI, sockets: list[socket.socket]) -> int:
    metrics = state.metrics
    http = _uvicorn(app, server_config.host, server_config.http_port, server_config.graceful_shutdown_s)
    _install_signal_handlers(http)
    http_task = asyncio.create_task(http.serve(sockets), name="http")
    load_task = _in_daemon_thread(spec.build, engine_config, server_config, metrics)
    first: list[asyncio.Future[Any]] = [http_task, load_task]
    done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    if load_task not in done:
        # Stopped while loading: the loader thread cannot be interrupted; it is
        # a daemon, so the process exits without waiting for it.
        log.info("stopped before the model finished loading")
        return _exit_code(http_task)
    try:
        worker = load_task.result()
    except Exception as exc:  # a bad model source or config: report it and stop
        log.error("cannot start the %s role: %s", server_config.role.value, exc)
        http.should_exit = True
        await http_task
        return 1
    try:
        try:
            await worker.start()
        except Exception as exc:  # e.g. the gRPC port is taken
            log.error("cannot start the %s role: %s", server_config.role.value, exc)
            http.should_exit = True
            await http_task
            return 1
        started.append(worker)
        state.attach(worker.health, worker.backend)
        frozen = freeze_startup_heap()
        log.info("serving %s as %s on http://%s:%d, admin on port %d (%d start-up objects frozen out of the "
                 "garbage collector's reach)", worker.health.model.name, server_config.role.value, server_config.host,
                 server_config.http_port, server_config.admin_port, frozen)
        await http_task
        # HTTP has finished its requests; a decode's requests come over gRPC: let them finish too.
        await _finish_in_flight(worker.health, server_config.graceful_shutdown_s, http)
        await worker.stop()
    finally:
        worker.close()
    return _exit_code(http_task)


async def _finish_in_flight(health: Health, timeout_s: float, http: uvicorn.Server) -> None:
    """Take no new work and wait, bounded, until nothing is in flight (a second Ctrl-C stops waiting)."""
    health.set_draining(True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not http.force_exit:
        stats = health.stats()
        if stats.requests_running + stats.requests_waiting == 0:
            return
        await asyncio.sleep(0.1)
    log.warning("stopping with requests still in flight")


def _in_daemon_thread(fn: WorkerBuilder, *args: Any) -> asyncio.Future[Worker]:
    """Run a blocking call in a daemon thread (asyncio.to_thread's threads
    would keep the process alive until a model load ends)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Worker] = loop.create_future()

    def settle(result: Worker | None, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            assert result is not None, "a builder returns a worker or raises"
            future.set_result(result)

    def target() -> None:
        result: Worker | None = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the loop, which reports it
            error = exc
        # NOTE: the loop may already be closed when a load ends after shutdown.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=_LOADER, daemon=True).start()
    return future


def _exit_code(http_task: asyncio.Task[None]) -> int:
    if http_task.cancelled() or http_task.exception() is not None:
        return 1
    return 0


def _install_signal_handlers(http: uvicorn.Server) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s: shutting down", sig.name)
        if http.should_exit and sig is signal.SIGINT:
            http.force_exit = True  # a second Ctrl-C skips the graceful wait
        http.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
