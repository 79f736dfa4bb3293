"""A prefill and a decode in this process, on loopback, serving a tiny random
model: real engines, real gRPC and a real tcp data path.

Fixtures:
- `tiny_model_dir`: a tiny random Llama folder (the engine tests' builder).
- `pd_pair`: an async context manager factory `pd_pair(mode="PUSH", **engine)`
  giving a linked `Pair` (prefill and decode workers, a decode stub).
- `reference_tokens`: greedy tokens of the same model run by a plain LLMEngine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from disagg.proto import disagg_pd_pb2_grpc
from disagg.workers.config import KvTransferMode, Role, ServerConfig
from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.links import InstanceInfo
from disagg.workers.pd.worker import PDWorker, build_worker

torch.set_num_threads(1)
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 128


def _engine_fixtures_module() -> Any:
    # NOTE: the tiny-model builder lives in the engine tests' conftest; test
    # folders are not packages, so it is loaded by path.
    path = Path(__file__).parent.parent / "engine" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_engine_conftest", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(_engine_fixtures_module().build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama")))


def engine_config(model: Path, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(model=str(model), device="cpu", block_size=BLOCK_SIZE,
                                    num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256)
    settings.update(overrides)
    return EngineConfig(**settings)


def server_config(role: Role, mode: str = "PUSH") -> ServerConfig:
    return ServerConfig(role=role, host="127.0.0.1", http_port=free_port(), grpc_port=free_port(),
                        transfer_port=free_port(), kv_transfer_mode=KvTransferMode(mode))


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
                       **engine: Any) -> tuple[PDWorker, ServerConfig]:
    config = server_config(role, mode)
    worker = build_worker(engine_config(model, **engine), config, WorkerMetrics(role.value), pd)
    await worker.start()
    return worker, config


async def stop_worker(worker: PDWorker) -> None:
    await worker.stop()
    worker.role.close()


@pytest.fixture
def pd_pair(tiny_model_dir: Path) -> Callable[..., contextlib.AbstractAsyncContextManager[Pair]]:
    @contextlib.asynccontextmanager
    async def make(mode: str = "PUSH", link: bool = True, pd: PDConfig | None = None,
                   **engine: Any) -> AsyncIterator[Pair]:
        prefill, pc = await start_worker(tiny_model_dir, Role.PREFILL, mode, pd, **engine)
        decode, dc = await start_worker(tiny_model_dir, Role.DECODE, mode, pd, **engine)
        channel = grpc.aio.insecure_channel(dc.instance_name)
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


class Kit:
    """Helpers the test modules share (test folders are not packages, so
    they come as a fixture rather than an import)."""

    num_kv_blocks = NUM_KV_BLOCKS
    wait_for = staticmethod(wait_for)
    start_worker = staticmethod(start_worker)
    stop_worker = staticmethod(stop_worker)


@pytest.fixture
def kit() -> type[Kit]:
    return Kit
