"""Prefill and decode workers on loopback serving the tiny random model of the
session conftest (`tiny_model_dir`): real engines, real gRPC and a real tcp
data path; in this process or as real `disagg serve` processes.

Fixtures:
- `pd_pair`: an async context manager factory `pd_pair(mode="PUSH", **engine)`
  giving a linked `Pair` (prefill and decode workers, a decode stub).
- `reference_tokens`: greedy tokens of the same model run by a plain LLMEngine.
- `processes`: a module-scoped `Processes` that starts `disagg serve`
  processes on the tiny model and stops them all at the module's end.
- `openai_client`: `openai_client(backend, role)`, an `openai` client of a
  role's HTTP app in this process (httpx's ASGI transport).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from disagg.proto import disagg_pd_pb2_grpc
from disagg.proto.vocabulary import InstanceInfo, PDPolicy
from disagg.workers.config import Role, ServerConfig, TransferMode
from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.http.app import AppState, build_app
from disagg.workers.http.backend import Backend
from disagg.workers.local import WorkerProcess, free_port, spawn_worker
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.worker import PDWorker, build_decode, build_prefill
from disagg.workers.security.control import control_channel
from disagg.workers.security.key import ClusterKey

torch.set_num_threads(1)
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 128
# These tests hold PD, migration and the mixed role to the same tokens, which fp32 gives whatever the batch;
# bf16 (`auto` on a CPU with native bf16) rounds by the batch's shape on AMX, and drifts within its tolerance.
DTYPE = "float32"
CLUSTER_KEY = ClusterKey.generate()  # every worker of these tests, and their clients, share it


def engine_config(model: Path, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(model=str(model), device="cpu", dtype=DTYPE, block_size=BLOCK_SIZE,
                                    num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256)
    settings.update(overrides)
    return EngineConfig(**settings)


def server_config(role: Role, mode: str = "PUSH", connections: int | None = None,
                  policy: PDPolicy = PDPolicy.ALWAYS) -> ServerConfig:
    return ServerConfig(role=role, host="127.0.0.1", http_port=free_port(), grpc_port=free_port(),
                        transfer_port=free_port(), kv_transfer_mode=TransferMode(mode),
                        kv_connections=connections, cluster_key=CLUSTER_KEY, pd_policy=policy)


@dataclass
class Pair:
    prefill: PDWorker
    decode: PDWorker
    prefill_config: ServerConfig
    decode_config: ServerConfig
    stub: disagg_pd_pb2_grpc.DisaggPDServiceStub  # the decode's DisaggPDService

    @property
    def prefill_info(self) -> InstanceInfo:
        c = self.prefill_config
        return InstanceInfo(c.instance_name, f"127.0.0.1:{c.transfer_port}")


async def start_worker(model: Path, role: Role, mode: str = "PUSH", pd: PDConfig | None = None,
                       connections: int | None = None, policy: PDPolicy = PDPolicy.ALWAYS,
                       **engine: Any) -> tuple[PDWorker, ServerConfig]:
    config = server_config(role, mode, connections, policy)
    build = build_prefill if role is Role.PREFILL else build_decode
    worker = build(engine_config(model, **engine), config, WorkerMetrics(role.value), pd)
    await worker.start()
    return worker, config


async def stop_worker(worker: PDWorker) -> None:
    await worker.stop()
    worker.role.close()


@pytest.fixture
def pd_pair(tiny_model_dir: Path) -> Callable[..., contextlib.AbstractAsyncContextManager[Pair]]:
    @contextlib.asynccontextmanager
    async def make(mode: str = "PUSH", link: bool = True, pd: PDConfig | None = None,
                   connections: int | None = None, policy: PDPolicy = PDPolicy.ALWAYS,
                   **engine: Any) -> AsyncIterator[Pair]:
        prefill, pc = await start_worker(tiny_model_dir, Role.PREFILL, mode, pd, connections, policy, **engine)
        decode, dc = await start_worker(tiny_model_dir, Role.DECODE, mode, pd, connections, **engine)
        channel = control_channel(dc.instance_name, CLUSTER_KEY)
        pair = Pair(prefill, decode, pc, dc, disagg_pd_pb2_grpc.DisaggPDServiceStub(channel))
        try:
            if link:
                status = await pair.stub.LinkInstance(pair.prefill_info.to_proto(), timeout=10)
                assert status.ok
                await wait_for(lambda: prefill.role.ready()[0], "the prefill learns its decode")
            yield pair
        finally:
            await channel.close()
            await stop_worker(prefill)
            await stop_worker(decode)

    return make


async def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="session")
def reference_tokens(tiny_model_dir: Path) -> Callable[[list[int], SamplingParams], list[int]]:
    engine = LLMEngine.from_config(engine_config(tiny_model_dir))

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        engine.add_request("ref", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests:
            for out in engine.step():
                tokens += out.new_token_ids
        return tokens

    return run


def _openai_client(backend: Backend, role: str) -> openai.AsyncOpenAI:
    state = AppState(WorkerMetrics(role))
    state.attach(backend, backend)
    transport = httpx.ASGITransport(app=build_app(state))
    return openai.AsyncOpenAI(base_url="http://worker/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, timeout=120.0))  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def openai_client() -> Callable[[Backend, str], openai.AsyncOpenAI]:
    return _openai_client


class Kit:
    """Helpers the test modules share (test folders are not packages, so
    they come as a fixture rather than an import)."""

    num_kv_blocks = NUM_KV_BLOCKS
    key = CLUSTER_KEY
    wait_for = staticmethod(wait_for)
    start_worker = staticmethod(start_worker)
    stop_worker = staticmethod(stop_worker)


@pytest.fixture
def kit() -> type[Kit]:
    return Kit


# --- `disagg serve` processes --------------------------------------------------

SERVED_NAME = "tiny"
PROCESS_STARTUP_S = 180.0
# Room for a few long requests at once (a 400-token request takes 100 blocks).
PROCESS_ENGINE_ARGS = ("--device", "cpu", "--dtype", DTYPE, "--block-size", str(BLOCK_SIZE),
                       "--num-kv-blocks", "512", "--max-model-len", "512", "--max-num-seqs", "16",
                       "--served-model-name", SERVED_NAME)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting until {what}"
        time.sleep(0.1)


class Processes:
    """`disagg serve` processes of one test module, all stopped at its end."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self._model = model
        self._log_dir = log_dir
        self.started: list[WorkerProcess] = []
        self.key_file = log_dir / "cluster.key"
        CLUSTER_KEY.write(self.key_file)

    def spawn(self, role: str, *extra: str, env: dict[str, str] | None = None) -> WorkerProcess:
        """Start one (not waiting for it: start several, then `wait_loaded` each), with `env` added to ours."""
        log_path = self._log_dir / f"{role}-{len(self.started)}.log"
        worker = spawn_worker(role, str(self._model), log_path, [*PROCESS_ENGINE_ARGS, *extra],
                              env={"OMP_NUM_THREADS": "1", **(env or {})}, key_file=self.key_file)
        self.started.append(worker)
        return worker

    def start(self, *specs: tuple[str, ...], env: dict[str, str] | None = None) -> list[WorkerProcess]:
        """Start workers (each spec: role, then extra arguments) side by side; wait until all have loaded."""
        workers = [self.spawn(*spec, env=env) for spec in specs]
        for worker in workers:
            worker.wait_loaded(PROCESS_STARTUP_S)
        return workers

    wait_until = staticmethod(wait_until)

    def stop_all(self) -> None:
        """SIGTERM every worker still running; each must shut down cleanly (exit 0)."""
        running = [w for w in self.started if w.process.poll() is None]
        codes = [w.stop(grace_s=20.0) for w in running]
        bad = [f"{w.role} {w.instance_name} exited {code}:\n{w.log()}" for w, code in zip(running, codes) if code]
        assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def processes(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    procs = Processes(tiny_model_dir, tmp_path_factory.mktemp("workers"))
    try:
        yield procs
    finally:
        procs.stop_all()
