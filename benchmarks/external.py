"""Tools from outside the project (AIPerf, sglang-router, vLLM, llama.cpp), each installed in its
own virtual environment so their pins never meet ours: find one's executable,
run it to the end under a bound, or keep it running beside a benchmark and stop
it, its children included.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


class ToolFailed(RuntimeError):
    """An external tool is missing, failed, or ran past its bound; the message carries its log's tail."""


def executable(name: str, venv: Path, package: str) -> Path:
    """`name` from `venv`'s bin, else from the PATH; the error says how to install `package` there."""
    candidate = venv / "bin" / name
    if candidate.is_file():
        return candidate
    found = shutil.which(name)
    if found is None:
        raise ToolFailed(f"{name} is neither in {venv}/bin nor on the PATH: "
                         f"python3 -m venv {venv} && {venv}/bin/pip install {package}")
    return Path(found)


def _tail(log: Path, max_chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-max_chars:] if log.exists() else f"(no log at {log})"


def _spawn(cmd: Sequence[str | Path | int], log: Path, env: Mapping[str, str] | None = None,
           ) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        # its own process group: AIPerf and the router start children, which must go with them
        return subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, process_group=0,
                                env=None if env is None else {**os.environ, **env})


def _stop(process: subprocess.Popen[bytes], grace_s: float) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children that outlived their parent
    except ProcessLookupError:
        pass


def run(cmd: Sequence[str | Path | int], log: Path, timeout_s: float) -> None:
    """Run `cmd` to its end, its output into `log`; ToolFailed on a non-zero exit or past `timeout_s`."""
    process = _spawn(cmd, log)
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ToolFailed(f"{Path(str(cmd[0])).name} ran past {timeout_s:.0f} s:\n{_tail(log)}") from None
    finally:
        _stop(process, 10.0)
    if code != 0:
        raise ToolFailed(f"{Path(str(cmd[0])).name} exited with {code}:\n{_tail(log)}")


@contextmanager
def serving(cmd: Sequence[str | Path | int], log: Path, ready_url: str, timeout_s: float,
            env: Mapping[str, str] | None = None) -> Iterator[None]:
    """`cmd` running until the block ends, once `ready_url` answers 200 (within `timeout_s`).

    `env`: variables added to ours for it.
    """
    process = _spawn(cmd, log, env)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise ToolFailed(f"{Path(str(cmd[0])).name} exited with {process.returncode}:\n{_tail(log)}")
            try:
                if httpx.get(ready_url, timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ToolFailed(f"{ready_url} did not answer 200 within {timeout_s:.0f} s:\n{_tail(log)}")
            time.sleep(0.2)
        yield
    finally:
        _stop(process, 10.0)
