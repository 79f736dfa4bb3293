"""A real `disagg serve --role mixed` process on loopback, serving a tiny
random model, shared by the HTTP tests of one session.

Fixtures:
- `tiny_model_dir`: a tiny random Llama folder (the engine tests' builder).
- `served`: a `ServedWorker` (base URL, model name, log) of a running worker.
- `worker_launcher`: a context manager that runs a worker of one's own.
- `http`: an httpx client bound to it.
- `read_metric`: the value of an unlabelled sample of its /metrics.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 180.0
# Room for a few long requests at once: a request of ~500 tokens runs long
# enough on a CPU for a client to go away in the middle of it.
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 1024
MAX_MODEL_LEN = 512


def _engine_fixtures_module() -> object:
    # NOTE: the tiny-model builder lives in the engine tests' conftest; test
    # folders are not packages, so it is loaded by path.
    path = Path(__file__).parent.parent / "engine" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_engine_conftest", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class ServedWorker:
    base_url: str
    model: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = getattr(_engine_fixtures_module(), "build_tiny_model")
    return Path(build("llama", tmp_path_factory.mktemp("tiny-llama")))


def start_worker(model: str, log_path: Path, *extra: str, served_model_name: str = MODEL_NAME) -> ServedWorker:
    """Start `disagg serve --role mixed` on free loopback ports; wait until /ready."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "disagg.workers", "serve", "--role", "mixed", "--model", model,
        "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", str(free_port()),
        "--transfer-port", str(free_port()), "--device", "cpu", "--served-model-name", served_model_name,
        *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    worker = ServedWorker(f"http://127.0.0.1:{port}", served_model_name, log_path, process)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the worker exited with {process.returncode}:\n{worker.log()}")
            try:
                if client.get(f"{worker.base_url}/ready").status_code == 200:
                    return worker
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
    stop_worker(worker)
    raise TimeoutError(f"the worker was not ready after {STARTUP_TIMEOUT_S} s:\n{worker.log()}")


def stop_worker(worker: ServedWorker) -> int:
    """SIGTERM, then SIGKILL if it does not stop; returns the exit code."""
    worker.process.terminate()
    try:
        return worker.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        worker.process.kill()
        return worker.process.wait(timeout=10)


@contextlib.contextmanager
def running_worker(model: str, log_path: Path, *extra: str, served_model_name: str = MODEL_NAME) -> Iterator[ServedWorker]:
    """A worker for the duration of the block; it must exit 0 on SIGTERM."""
    worker = start_worker(model, log_path, *extra, served_model_name=served_model_name)
    try:
        yield worker
    finally:
        code = stop_worker(worker)
    assert code == 0, f"the worker exited with {code} on SIGTERM:\n{worker.log()}"


@pytest.fixture(scope="session")
def worker_launcher() -> Callable[..., contextlib.AbstractContextManager[ServedWorker]]:
    """`running_worker`, for test modules that need a worker of their own."""
    return running_worker


@pytest.fixture(scope="session")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedWorker]:
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    with running_worker(
        str(tiny_model_dir), log_path,
        "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
    ) as worker:  # fmt: skip
        yield worker


@pytest.fixture
def http(served: ServedWorker) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.base_url, timeout=60.0) as client:
        yield client


@pytest.fixture
def read_metric(http: httpx.Client) -> Callable[[str], float]:
    """Reads the current value of an unlabelled sample from /metrics."""

    def read(name: str) -> float:
        text = http.get("/metrics").text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, f"metric {name} not in /metrics"
        return float(match.group(1))

    return read
