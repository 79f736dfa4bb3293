"""Child processes with a log file, their own process group and a clean stop.

The control plane's binaries and the local kubelet's pods are both started
this way: each one leads its own process group, so a stop reaches every
process it spawned, and a Ctrl-C on the terminal does not kill them before
their owner has torn them down in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def log_tail(path: Path, max_bytes: int = 4000) -> str:
    """The last `max_bytes` of a log file, or a note when it does not exist."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"


class ManagedProcess:
    """One child process whose stdout and stderr are appended to `log_path`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> None:
        if not argv:
            raise ValueError(f"{name}: empty command")
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            # process_group=0: the child leads a new group (see the module doc).
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                process_group=0,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.popen.poll()

    def tail(self, max_bytes: int = 4000) -> str:
        return log_tail(self.log_path, max_bytes)

    def signal_group(self, sig: signal.Signals) -> None:
        """Send `sig` to the whole process group (a no-op once it is gone)."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def reap(self) -> int:
        """After the leader exited: kill what it left in its group and collect its code."""
        self.signal_group(signal.SIGKILL)
        return self.popen.wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL; returns the exit code."""
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=max(grace_s, 0.0))
            except subprocess.TimeoutExpired:
                pass
        # NOTE: the leader may have exited while children it forked still run
        # in its group; SIGKILL the group unconditionally so none is left.
        self.signal_group(signal.SIGKILL)
        code = self.popen.wait(timeout=30)
        _wait_group_gone(self.popen.pid, timeout_s=5.0)
        return code


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None when it is gone;
    `pid` may also be "PID/task/TID", one thread of a process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    return text[text.rindex(")") + 2:].split()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) from /proc/PID/stat, or None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[2]))


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU time of a process so far, its threads included (0 once it is gone);
    of one thread for "PID/task/TID"."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU time so far of each live thread of a process, by thread id."""
    try:
        tids = [task.name for task in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:
        return {}
    return {tid: cpu_seconds(f"{pid}/task/{tid}") for tid in tids}


def process_running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie.

    NOTE: kill(pid, 0) is not enough: an orphan whose new parent never reaps
    (a container's init may not) lingers as a zombie after it exits.
    """
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def group_running(pgid: int) -> bool:
    """Whether any process of group `pgid` is still running (zombies aside)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
                return True
    return False


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no process of group `pgid` runs any more."""
    deadline = time.monotonic() + timeout_s
    while group_running(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
