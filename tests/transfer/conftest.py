"""Fixtures for transfer tests: peers in their own processes on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from disagg.workers.transfer import KVLayout, KVTransport

PEER_SCRIPT = Path(__file__).with_name("peer.py")
PEER_START_TIMEOUT_S = 60.0  # importing torch on a busy 2-core machine is slow
PAUSE_TIMEOUT_S = 10.0
LAYOUT = KVLayout("test-model", "float16", num_layers=3, num_blocks=48, block_size=4, num_kv_heads=2, head_dim=16)


def _peer_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("transfer_peer", PEER_SCRIPT)
    assert spec is not None and spec.loader is not None, f"cannot load {PEER_SCRIPT}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PEER = _peer_module()
_seeded_pool: Callable[[KVLayout, int], torch.Tensor] = _PEER.seeded_pool
_make_transport: Callable[..., KVTransport] = _PEER.make_transport


@pytest.fixture
def layout() -> KVLayout:
    """The small layout every transfer test peer uses."""
    return LAYOUT


@pytest.fixture
def transport_factory() -> Iterator[Callable[..., KVTransport]]:
    """`make_transport` of peer.py (registered names, and "gloo"); closes what it made after the test."""
    made: list[KVTransport] = []

    def make(name: str, pool: torch.Tensor, layout: KVLayout, instance: str, **options: object) -> KVTransport:
        made.append(_make_transport(name, pool, layout, instance, **options))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


@pytest.fixture
def seeded_pool() -> Callable[[KVLayout, int], torch.Tensor]:
    """The pool a peer started with `--seed N` holds (0: zeros)."""
    return _seeded_pool


class Peer:
    """A peer process running peer.py; talk to it with `command`."""

    def __init__(self, mode: str, layout: KVLayout, name: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), mode, "--layout", json.dumps(layout.to_dict()), "--name", name, *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.first_line = self.read_line(PEER_START_TIMEOUT_S)

    def read_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None, "stdout is piped"
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"peer printed nothing within {timeout}s")
        line = self.proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait(5)}")
        return line

    def command(self, line: str, timeout: float = 30.0) -> str:
        assert self.proc.stdin is not None, "stdin is piped"
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read_line(timeout)

    def dump(self, path: Path) -> torch.Tensor:
        assert self.command(f"dump {path}") == "dumped"
        return torch.load(path)

    def pause(self) -> None:
        """SIGSTOP: alive, its connections open, but silent. The signal stops each thread when it
        next leaves the kernel, so this waits until /proc shows every thread stopped."""
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        while not all(_thread_state(stat) in ("t", "T", "X") for stat in tasks.glob("*/stat")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.proc.pid} not stopped {PAUSE_TIMEOUT_S}s after SIGSTOP")
            time.sleep(0.01)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _thread_state(stat: Path) -> str:
    """A thread's state letter from its /proc stat line ("X", dead, for a thread that has just exited)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "X"


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def listening_peer() -> Iterator[tuple[Peer, str]]:
    """A prefill-like peer listening with a seeded pool (seed 7); yields (peer, address)."""
    peer = Peer("listen", LAYOUT, "prefill-0", "--seed", "7", "--connections", "3")
    kind, address = peer.first_line.split()
    assert kind == "ready", peer.first_line
    yield peer, address
    peer.stop()


@pytest.fixture
def peer_factory() -> Iterator[Callable[..., Peer]]:
    """Start peers that are stopped after the test."""
    peers: list[Peer] = []

    def start(mode: str, layout: KVLayout, name: str, *extra: str) -> Peer:
        peers.append(Peer(mode, layout, name, *extra))
        return peers[-1]

    yield start
    for peer in peers:
        peer.stop()
