"""Turns on shared CPUs: a prefill and a decode on the same cores order their steps.

A mixed worker orders its own work: a step computes the waiting prompts and its
decodes ride along. A prefill and a decode sharing cores (one machine: `disagg
demo`, the benchmarks, a single-node setup) have no such order: a decode step
that runs while the prefill computes prompts slows both, and every queued
prompt's first token waits (issue 18: PD's TTFT 1.3-2.0x the mixed worker's at
concurrency 8 and 32 on 2 cores, its throughput 0.8x). With `--cpu-turn-dir
DIR` on both, they take turns through two flock(2) locks in DIR, which the
kernel drops when a worker dies:

- `prompts`, held shared by a prefill from its first step until it is idle,
  and tested by a decode before each step;
- `steps`, held shared by a prefill across those steps, and exclusively by a
  decode for one step.

So a prefill's prompts run on all the cores back to back, as a mixed worker's
would, and a decode steps when no prefill has work. A decode that has waited
`wait_s` steps anyway, beside the prefill, as it would without turns: that
bound is what its requests' TPOT gives up to prompts, and it keeps PD's lead
when long prompts keep arriving, where a mixed worker's decodes wait for every
prompt. A prefill waits at most `PREFILL_WAIT_S` for a decode's step to end.

The engine loop asks `may_step()` between looks at its command queue, so
commands (a decode's reservations, admissions) never wait for a turn.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

PREFILL_WAIT_S = 2.0  # a decode's step ends well within this
DEFAULT_DECODE_WAIT_S = 0.25


class _Lock:
    """One flock(2) lock on a file of the turn folder, tried without blocking."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.held = False

    def take(self, mode: int) -> bool:
        """Take it in `mode` (LOCK_SH or LOCK_EX) unless another holder conflicts."""
        try:
            fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.held = True
        return True

    def release(self) -> None:
        if self.held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.held = False


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Waiting:
    """When the current wait for a turn began, and whether it has run out."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self._since: float | None = None

    def over(self) -> bool:
        now = time.monotonic()
        if self._since is None:
            self._since = now
        return now - self._since >= self.bound_s

    def reset(self) -> None:
        self._since = None


class PrefillTurns:
    """A prefill's side: it keeps the turn from its first step until it is idle."""

    def __init__(self, folder: Path) -> None:
        folder = _folder(folder)
        self._prompts = _Lock(folder / "prompts")
        self._steps = _Lock(folder / "steps")
        self._waiting = _Waiting(PREFILL_WAIT_S)

    def may_step(self) -> bool:
        # `prompts` fails only for the instant a decode tests it; `steps` while a decode steps.
        if not self._prompts.held:
            self._prompts.take(fcntl.LOCK_SH)
        if self._steps.held or self._steps.take(fcntl.LOCK_SH) or self._waiting.over():
            self._waiting.reset()
            return True
        return False

    def after_step(self) -> None:
        """Kept across steps: the next prompt step follows at once."""

    def idle(self) -> None:
        self._steps.release()
        self._prompts.release()


class DecodeTurns:
    """A decode's side: it takes the turn for one step when no prefill has work,
    or steps anyway once it has waited `wait_s`."""

    def __init__(self, folder: Path, wait_s: float = DEFAULT_DECODE_WAIT_S) -> None:
        if wait_s <= 0:
            raise ValueError(f"a decode's wait for its turn must be positive, got {wait_s}")
        folder = _folder(folder)
        self._prompts = _Lock(folder / "prompts")
        self._steps = _Lock(folder / "steps")
        self._waiting = _Waiting(wait_s)

    def may_step(self) -> bool:
        if self._take() or self._waiting.over():
            self._waiting.reset()
            return True
        return False

    def _take(self) -> bool:
        if not self._prompts.take(fcntl.LOCK_EX):  # a prefill has prompts to compute
            return False
        self._prompts.release()
        return self._steps.take(fcntl.LOCK_EX)

    def after_step(self) -> None:
        self._steps.release()

    def idle(self) -> None:
        self._steps.release()
