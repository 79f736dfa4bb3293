"""A real `disagg serve --role mixed` process on loopback, serving the tiny
random model of the session conftest (`tiny_model_dir`), shared by the HTTP
tests of one session.

Fixtures:
- `served`: a `ServedWorker` (base URL, model name, log) of a running worker.
- `worker_launcher`: a context manager that runs a worker of one's own.
- `long_context_worker`: another, of `long_model_dir`'s model of 2048 positions
  (tool calls, /v1/responses).
- `http`: an httpx client bound to it.
- `read_metric`: the value of an unlabelled sample of its /metrics.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from disagg.workers.engine.tokenizer import Tokenizer
from disagg.testing.tiny_model import build_tiny_model
from disagg.workers.local import WorkerFailed, WorkerProcess, spawn_worker

MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 180.0
# Room for a few long requests at once: a request of ~500 tokens runs long
# enough on a CPU for a client to go away in the middle of it.
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 1024
MAX_MODEL_LEN = 512
LONG_CONTEXT = 2048  # long_context_worker's


@dataclass(frozen=True)
class ServedWorker:
    process: WorkerProcess
    model: str

    @property
    def base_url(self) -> str:
        return self.process.base_url

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def log(self) -> str:
        return self.process.log()


def start_worker(model: str, log_path: Path, *extra: str, served_model_name: str = MODEL_NAME,
                 env: dict[str, str] | None = None) -> ServedWorker:
    """Start `disagg serve --role mixed` on free loopback ports; wait until it has loaded (= ready, for mixed)."""
    process = spawn_worker("mixed", model, log_path, ["--device", "cpu", "--served-model-name", served_model_name,
                                                      *extra], env={"OMP_NUM_THREADS": "1", **(env or {})})
    worker = ServedWorker(process, served_model_name)
    try:
        process.wait_loaded(STARTUP_TIMEOUT_S)
    except WorkerFailed:
        stop_worker(worker)
        raise
    return worker


def stop_worker(worker: ServedWorker) -> int:
    """SIGTERM, then SIGKILL if it does not stop; returns the exit code."""
    return worker.process.stop(grace_s=30.0)


@contextlib.contextmanager
def running_worker(model: str, log_path: Path, *extra: str, served_model_name: str = MODEL_NAME,
                   env: dict[str, str] | None = None) -> Iterator[ServedWorker]:
    """A worker for the duration of the block; it must exit 0 on SIGTERM."""
    worker = start_worker(model, log_path, *extra, served_model_name=served_model_name, env=env)
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
    ) as worker:
        yield worker


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of LONG_CONTEXT positions: tool listings and replayed histories make
    long prompts with the tiny byte-level tokenizer."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("long-model"), context=LONG_CONTEXT)


@pytest.fixture(scope="session")
def long_context_worker(long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedWorker]:
    """A worker of long_model_dir's model."""
    log_path = tmp_path_factory.mktemp("long-worker") / "worker.log"
    with running_worker(str(long_model_dir), log_path, "--block-size", "16", "--num-kv-blocks", "1024",
                        "--max-model-len", str(LONG_CONTEXT), "--max-num-seqs", "8") as worker:
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


@pytest.fixture
def client(served: ServedWorker) -> Iterator[openai.OpenAI]:
    """The openai client on the session's mixed worker."""
    with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", timeout=120.0, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)
