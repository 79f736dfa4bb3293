"""`python -m disagg.testing up|down`: the local cluster as a background service.

`up` starts `serve` as a detached process, which runs the cluster until it
gets SIGTERM, and prints what a user needs once it is ready. The runtime
folder holds `state.json` (written when ready), `serve.log` and the run's
files; `down` stops the service and waits for it to tear everything down.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from disagg.testing.binaries import find_binaries
from disagg.testing.cluster import LocalCluster
from disagg.testing.processes import log_tail, process_running


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / "disagg-cluster"


def read_state(runtime_dir: Path) -> dict[str, str | int] | None:
    path = runtime_dir / "state.json"
    if not path.is_file():
        return None
    state: dict[str, str | int] = json.loads(path.read_text())
    return state if process_running(int(state["pid"])) else None


def _print_state(state: dict[str, str | int]) -> None:
    print(f"admin kubeconfig:     {state['admin_kubeconfig']}")
    print(f"non-admin kubeconfig: {state['user_kubeconfig']}")
    print(f"API server:           {state['server']}")
    print(f"binaries:             {state['binaries']}")
    print(f"pod logs:             {state['pod_logs']}")
    print(f"export KUBECONFIG={state['admin_kubeconfig']}")
    # kubectl and helm are built into the binaries folder; this puts them on PATH.
    print(f"export PATH={state['binaries']}:$PATH")


def serve(runtime_dir: Path) -> int:
    """Run the cluster in the foreground until SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Each run starts empty: an old etcd store would hold objects signed with old keys.
    shutil.rmtree(runtime_dir / "run", ignore_errors=True)
    cluster = LocalCluster(workdir=runtime_dir / "run")
    cluster.start()
    try:
        assert cluster.kubelet is not None, "started above"
        state = {
            "pid": os.getpid(),
            "admin_kubeconfig": str(cluster.admin_kubeconfig),
            "user_kubeconfig": str(cluster.user_kubeconfig),
            "server": cluster.control_plane.server_url if cluster.control_plane else "",
            "binaries": str(cluster.binaries.folder),
            "pod_logs": str(cluster.kubelet.workdir / "pods"),
        }
        tmp = runtime_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.rename(runtime_dir / "state.json")
        stop.wait()
    finally:
        (runtime_dir / "state.json").unlink(missing_ok=True)
        cluster.stop()
    return 0


def up(runtime_dir: Path, timeout_s: float = 300.0) -> int:
    state = read_state(runtime_dir)
    if state is not None:
        print(f"already running (pid {state['pid']})")
        _print_state(state)
        return 0
    runtime_dir.mkdir(parents=True, exist_ok=True)
    # Build (or find) the binaries here, where a failure is plain to see.
    print(f"binaries: {find_binaries().folder}", flush=True)
    log_path = runtime_dir / "serve.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.testing", "serve", "--runtime-dir", str(runtime_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while (state := read_state(runtime_dir)) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.terminate()
            print(f"the cluster did not start; {log_path}:\n{log_tail(log_path)}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    _print_state(state)
    print(f"stop it with: {sys.executable} -m disagg.testing down --runtime-dir {runtime_dir}")
    return 0


def down(runtime_dir: Path, timeout_s: float = 120.0) -> int:
    state = read_state(runtime_dir)
    if state is None:
        print("not running")
        return 0
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while process_running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if process_running(pid):
        # It leads its own session: take the whole group down.
        os.killpg(pid, signal.SIGKILL)
        print(f"pid {pid} did not stop within {timeout_s:.0f} s; killed", file=sys.stderr)
        return 1
    print("stopped")
    return 0
