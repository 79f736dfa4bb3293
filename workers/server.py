"""Launches a worker: the HTTP server starts at once (so /health answers while
the model loads), the role's backend is built in a thread, and both stop
gracefully on SIGTERM or SIGINT.

Everything runs in one asyncio loop, which the role's gRPC server can join;
the engine computes in its own background thread, so the loop stays free to
serve HTTP while a long prompt runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from disagg.workers.config import Role, ServerConfig
from disagg.workers.engine.config import EngineConfig
from disagg.workers.http.app import AppState, build_app
from disagg.workers.http.backend import Backend
from disagg.workers.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class RoleNotAvailable(Exception):
    """The role exists in the CLI but this build cannot run it yet."""


# What a role runs: builds its backend (blocking: it loads the model). The
# role picks its builder here, and only here.
BackendBuilder = Callable[[EngineConfig, ServerConfig], Backend]


def _build_mixed(engine_config: EngineConfig, server_config: ServerConfig) -> Backend:
    from disagg.workers.http.backend import LocalEngineBackend

    return LocalEngineBackend.from_config(engine_config, server_config.served_model_name)


BACKEND_BUILDERS: dict[Role, BackendBuilder] = {Role.MIXED: _build_mixed}


def backend_builder(role: Role) -> BackendBuilder:
    if role not in BACKEND_BUILDERS:
        raise RoleNotAvailable(
            f"the {role.value} role is not available yet in this build; run --role mixed "
            f"(prefill and decode in one process)"
        )
    return BACKEND_BUILDERS[role]


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, minus its own signal handling: `serve` below owns the
    signals, so that the whole worker (engine included) shuts down on them and
    the process exits 0 rather than re-raising the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def run(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        builder = backend_builder(server_config.role)
    except RoleNotAvailable as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(engine_config, server_config, builder))


async def serve(engine_config: EngineConfig, server_config: ServerConfig, builder: BackendBuilder) -> int:
    state = AppState(WorkerMetrics(server_config.role.value))
    http = _UvicornServer(
        uvicorn.Config(
            build_app(state),
            host=server_config.host,
            port=server_config.http_port,
            lifespan="off",
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=int(server_config.graceful_shutdown_s),
        )
    )
    _install_signal_handlers(http)
    http_task = asyncio.create_task(http.serve(), name="http")
    load_task = _in_daemon_thread(builder, engine_config, server_config)
    done, _ = await asyncio.wait([http_task, load_task], return_when=asyncio.FIRST_COMPLETED)
    if load_task not in done:
        # Stopped while loading: the loader thread cannot be interrupted; it is
        # a daemon, so the process exits without waiting for it.
        log.info("stopped before the model finished loading")
        return _exit_code(http_task)
    try:
        backend = load_task.result()
    except Exception as exc:  # a bad model source or config: report it and stop
        log.error("cannot start the %s role: %s", server_config.role.value, exc)
        http.should_exit = True
        await http_task
        return 1
    state.attach(backend)
    log.info("serving %s as %s on http://%s:%d", backend.model.name, server_config.role.value,
             server_config.host, server_config.http_port)  # fmt: skip
    try:
        await http_task
    finally:
        backend.close()
    return _exit_code(http_task)


def _in_daemon_thread(fn: BackendBuilder, *args: Any) -> asyncio.Future[Backend]:
    """Run a blocking call in a daemon thread (asyncio.to_thread's threads
    would keep the process alive until a model load ends)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Backend] = loop.create_future()

    def settle(result: Backend | None, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            assert result is not None, "a builder returns a backend or raises"
            future.set_result(result)

    def target() -> None:
        result: Backend | None = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the loop, which reports it
            error = exc
        # NOTE: the loop may already be closed when a load ends after shutdown.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="load-model", daemon=True).start()
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
