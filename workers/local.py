"""`disagg serve` processes on this machine: start one on free loopback ports,
wait until its model is loaded, link a decode to a prefill, stop it.

`disagg demo`, the benchmark and the process-level tests run workers this way.
Each worker leads its own process group, so a Ctrl-C on the terminal reaches
its owner first, which then stops the workers in order.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from disagg.workers.security.key import ClusterKey
from disagg.workers.security.tls import TlsFiles

LOOPBACK = "127.0.0.1"


_FREE_PORT_TRIES = 100
_handed_out: set[int] = set()  # every port free_port gave this process


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` now (another process may take it before we bind it),
    never one it gave this process before: callers take several in a row before
    binding any, and the kernel may offer a port it just handed out again."""
    for _ in range(_FREE_PORT_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no port on {host} that this process was not given already, in {_FREE_PORT_TRIES} tries")


class WorkerFailed(RuntimeError):
    """A worker process exited or did not load its model in time; the message carries its log's tail."""


@dataclass
class WorkerProcess:
    """One `disagg serve` child process and its addresses."""

    role: str
    host: str
    http_port: int
    grpc_port: int
    transfer_port: int
    admin_port: int
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    key_file: Path | None = None  # its --cluster-key-file; None: --insecure
    tls_dir: Path | None = None  # its --tls-dir; None: plaintext

    @property
    def cluster_key(self) -> ClusterKey | None:
        return None if self.key_file is None else ClusterKey.from_file(self.key_file)

    @property
    def tls(self) -> TlsFiles | None:
        return None if self.tls_dir is None else TlsFiles.from_folder(self.tls_dir)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def admin_url(self) -> str:
        """/drain and the HTTP link routes."""
        return f"http://{self.host}:{self.admin_port}"

    def set_draining(self, draining: bool, timeout_s: float = 10.0) -> httpx.Response:
        """`POST /drain` (or `DELETE /drain` to end it) on its admin port, signed with its key."""
        from disagg.workers.security.control import http_credential_headers

        verb = "POST" if draining else "DELETE"
        return httpx.request(verb, f"{self.admin_url}/drain", timeout=timeout_s,
                             headers=http_credential_headers(self.cluster_key, "/drain", verb))

    @property
    def instance_name(self) -> str:
        """`<ip>:<grpc port>`: its DisaggPDService, and its name in links."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def transfer_address(self) -> str:
        return f"{self.host}:{self.transfer_port}"

    def log(self, max_chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except FileNotFoundError:
            return f"(no log at {self.log_path})"

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` in its /metrics that carry these labels (0 if none)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        return sum(
            s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def wait_loaded(self, timeout_s: float) -> None:
        """Until /health says the model is loaded and the role's servers are up.

        Not /ready: a prefill is ready only once a decode is linked to it.
        """
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise WorkerFailed(f"the {self.role} worker exited with {self.process.returncode}:\n{self.log()}")
                try:
                    if client.get(f"{self.base_url}/health").json().get("loaded"):
                        return
                except (httpx.TransportError, ValueError):
                    pass  # not listening yet
                time.sleep(0.2)
        raise WorkerFailed(f"the {self.role} worker had not loaded its model after {timeout_s:.0f} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault tests)."""
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM (the worker finishes its requests), then SIGKILL after `grace_s`; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=30)


def spawn_worker(role: str, model: str, log_path: Path, extra: Sequence[str] = (), host: str = LOOPBACK,
                 env: dict[str, str] | None = None, key_file: Path | None = None,
                 threads: int | None = None, tls_dir: Path | None = None) -> WorkerProcess:
    """Start `disagg serve --role ROLE` on free ports of `host`; returns at once (see `wait_loaded`).

    A prefill or decode gets `--cluster-key-file key_file`, or `--insecure` when it is None,
    and `--tls-dir tls_dir` when given.
    `threads`: its --threads; None: the worker's default (default_threads).
    """
    ports = [free_port(host) for _ in range(4)]
    auth = [] if role == "mixed" else ["--insecure"] if key_file is None else ["--cluster-key-file", str(key_file)]
    auth += [] if tls_dir is None else ["--tls-dir", str(tls_dir)]
    cmd = [
        sys.executable, "-m", "disagg.workers", "serve", "--role", role, "--model", model, "--host", host,
        "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--transfer-port", str(ports[2]),
        "--admin-port", str(ports[3]), *auth, *([] if threads is None else ["--threads", str(threads)]), *extra,
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                                   process_group=0)
    return WorkerProcess(role, host, ports[0], ports[1], ports[2], ports[3], log_path, process, key_file, tls_dir)


def link(decode: WorkerProcess, prefill: WorkerProcess, timeout_s: float = 15.0) -> str | None:
    """LinkInstance on the decode with the prefill's info (`disagg link`'s call); the error, or None."""
    from disagg.workers.pd.commands import link_call

    return link_call(decode.instance_name, prefill.instance_name, None, timeout_s,  # the port asked, as by hand
                     decode.cluster_key, decode.tls)


def unlink(decode: WorkerProcess, prefill: WorkerProcess, timeout_s: float = 15.0) -> list[str]:
    """UnlinkInstance on both sides (`disagg unlink`'s calls); the errors."""
    from disagg.workers.pd.commands import unlink_calls

    return unlink_calls(decode.instance_name, None, prefill.instance_name, None,  # the ports asked, as by hand
                        timeout_s, decode.cluster_key, decode.tls)
