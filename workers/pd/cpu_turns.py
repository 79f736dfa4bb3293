"""Turns on shared CPUs: a prefill and a decode on the same cores order their steps.

A mixed worker orders its own work: a step computes the waiting prompts and its
decodes ride along. A prefill and a decode sharing cores (one machine: `disagg
demo`, the benchmarks, a single-node setup) have no such order: a decode step
that runs while the prefill computes prompts slows both, and every queued
prompt's first token waits (issue 18: PD's TTFT 1.5-2.4x the mixed worker's at
concurrency 32 on 2 cores). With `--cpu-turn-dir DIR` on both, they take turns
through four flock(2) locks in DIR, which the kernel drops when a worker dies:

- `prompts`, held shared by a prefill from its first step until it is idle,
  with the number of requests it holds written in it; a decode tests the lock
  and reads the number before each step;
- `steps`, held shared by a prefill across those steps, and exclusively by a
  decode for one step;
- `decodes`, held shared by a decode while it has requests, with the number
  it runs written in it; a prefill tests the lock and reads the number before
  each step;
- `beside`, held shared by a decode for a step it takes beside the prefill's
  prompts; a prefill tests it before each step.

The rule, per decode step:

- no prefill has work: the decode takes `steps` and runs alone on the cores;
- the prefill holds at least as many requests as the decode runs: the prompts
  go first, on every core, as a mixed worker's would; more requests wait for a
  first token than for a next one, and the decode's batch fills meanwhile. The
  decode waits, at most `wait_s`: then it steps beside the prefill, so a
  prompt backlog never stops its tokens for longer than that;
- the decode runs more requests than the prefill holds (long prompts arriving
  one by one while many requests decode, the case PD exists for): it steps at
  once, beside the prefill, as it would without turns, and its TPOT stays
  protected, where a mixed worker's decodes wait for every prompt.

Prompts always first, with only the bound for the decode, was measured and
not kept: it cures TTFT at concurrency 32 but moves the cost to TPOT and gives
up most of the third rule's protection (docs/benchmarks.md, "Prompts first
with a bounded wait").

A prefill's step size follows the decodes. While a decode has requests, the
prefill's steps are small (`busy_step_tokens`): prompts queued behind a step
get their first tokens sooner, and a decode running more requests than the
prefill holds steps between them. While no decode has requests, a step takes
every waiting prompt, up to the engine's budget, as a mixed worker's step does:
split into small steps, a wave of prompts arriving together would give its
first prompts a token early and then hold their streams for seconds while the
rest of the wave is computed (a decode running fewer requests than the prefill
holds waits for the prompts), which is what PD exists to avoid
(docs/benchmarks.md, "A prefill's step size follows the decodes").

A worker's threads follow the turns too. Stepping alone, a worker takes
every CPU it has, and its OpenMP threads spin a while between a step's
parallel regions (workers/cli.py gives workers that take turns
`TURN_SPIN_COUNT`): sleeping threads woken for each of a step's few hundred
regions made the PD pair's decode slower than a mixed worker's (PD 0.84x at
concurrency 1). Stepping beside the other worker, each steps on one thread:
two pools of spinning threads on the same cores held the cores each other
needed at every barrier (0.62x at concurrency 32, docs/benchmarks.md,
"OpenMP spinning for the PD pair"). A prefill holding fewer requests than a
decode runs takes one thread before the decode's step beside it begins, since
by the rule above that step comes at once: a prompt step of every thread that
the decode's thread then joins runs three threads on two cores for up to a
second, its two threads meeting at every barrier behind the third
(docs/benchmarks.md, "A prefill's threads before the decode's step beside it").

A prefill waits at most `PREFILL_WAIT_S` for a decode's step to end. The engine
loop asks `may_step()` between looks at its command queue, so commands (a
decode's reservations, admissions) never wait for a turn.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from pathlib import Path

PREFILL_WAIT_S = 2.0  # a decode's step ends well within this
DEFAULT_DECODE_WAIT_S = 1.0
BESIDE_THREADS = 1  # a worker's threads for a step beside the other's
_COUNT = struct.Struct("<q")  # a worker's requests, at the start of its lock's file


class _Lock:
    """One flock(2) lock on a file of the turn folder, tried without blocking."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.held = False

    def take(self, mode: int) -> bool:
        """Take it in `mode` (LOCK_SH or LOCK_EX) unless another holder conflicts."""
        try:
            fcntl.flock(self.fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.held = True
        return True

    def release(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.held = False


class _Published:
    """The request count a worker writes in its lock's file for the other to read."""

    def __init__(self, lock: _Lock) -> None:
        self.lock = lock
        self.value: int | None = None

    def write(self, requests: int) -> None:
        if requests != self.value:
            os.pwrite(self.lock.fd, _COUNT.pack(requests), 0)
            self.value = requests


def _read_count(lock: _Lock) -> int:
    data = os.pread(lock.fd, _COUNT.size, 0)
    return _COUNT.unpack(data)[0] if len(data) == _COUNT.size else 0


def _locks(folder: Path) -> tuple[_Lock, _Lock, _Lock, _Lock]:
    folder.mkdir(parents=True, exist_ok=True)
    return _Lock(folder / "prompts"), _Lock(folder / "steps"), _Lock(folder / "decodes"), _Lock(folder / "beside")


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
    """A prefill's side: it keeps the turn from its first step until it is idle, and takes
    steps of at most `busy_step_tokens` while a decode has requests (None: no such cap)."""

    def __init__(self, folder: Path, busy_step_tokens: int | None = None) -> None:
        if busy_step_tokens is not None and busy_step_tokens < 1:
            raise ValueError(f"a prefill's step while decodes run must be positive, got {busy_step_tokens}")
        self._prompts, self._steps, self._decodes, self._beside = _locks(folder)
        self._waiting = _Waiting(PREFILL_WAIT_S)
        self._published = _Published(self._prompts)
        self._busy_step_tokens = busy_step_tokens

    def may_step(self, requests: int) -> bool:
        self._published.write(requests)
        # `prompts` fails only for the instant a decode tests it; `steps` while a decode steps alone.
        if not self._prompts.held:
            self._prompts.take(fcntl.LOCK_SH)
        if self._steps.held or self._steps.take(fcntl.LOCK_SH) or self._waiting.over():
            self._waiting.reset()
            return True
        return False

    def step_tokens(self) -> int | None:
        if self._busy_step_tokens is None:
            return None
        if self._decodes.take(fcntl.LOCK_EX):  # no decode has requests
            self._decodes.release()
            return None
        return self._busy_step_tokens

    def step_threads(self) -> int | None:
        if not self._beside.take(fcntl.LOCK_EX):  # a decode steps beside the prompts
            return BESIDE_THREADS
        self._beside.release()
        if self._decodes.take(fcntl.LOCK_EX):  # no decode has requests
            self._decodes.release()
            return None
        # A decode running more requests than this prefill holds steps beside it next.
        return BESIDE_THREADS if _read_count(self._decodes) > (self._published.value or 0) else None

    def after_step(self) -> None:
        """Kept across steps: the next prompt step follows at once."""

    def idle(self) -> None:
        self._published.write(0)
        self._steps.release()
        self._prompts.release()


class DecodeTurns:
    """A decode's side: each step, alone on the cores, after the prefill's prompts, or
    beside them (the module's docstring says which)."""

    def __init__(self, folder: Path, wait_s: float = DEFAULT_DECODE_WAIT_S) -> None:
        if wait_s <= 0:
            raise ValueError(f"a decode's wait for its turn must be positive, got {wait_s}")
        self._prompts, self._steps, self._decodes, self._beside = _locks(folder)
        self._waiting = _Waiting(wait_s)
        self._published = _Published(self._decodes)
        self._stepping_beside = False

    def may_step(self, requests: int) -> bool:
        self._published.write(requests)
        if not self._decodes.held:  # fails only for the instant a prefill tests it: taken next step
            self._decodes.take(fcntl.LOCK_SH)
        if self._prompts.take(fcntl.LOCK_EX):  # no prefill has work
            self._prompts.release()
            if self._steps.take(fcntl.LOCK_EX):  # fails while another decode steps alone
                self._waiting.reset()
                return True
            go = False
        else:
            go = requests > _read_count(self._prompts)
        if go or self._waiting.over():
            self._waiting.reset()
            self._stepping_beside = True
            self._beside.take(fcntl.LOCK_SH)  # fails only for the instant a prefill tests it
            return True
        return False

    def step_tokens(self) -> int | None:
        return None

    def step_threads(self) -> int | None:
        return BESIDE_THREADS if self._stepping_beside else None

    def after_step(self) -> None:
        self._stepping_beside = False
        self._steps.release()
        self._beside.release()

    def idle(self) -> None:
        self._steps.release()
        self._beside.release()
        self._decodes.release()
