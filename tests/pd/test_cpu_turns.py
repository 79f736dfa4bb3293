"""Turns on shared CPUs (workers/pd/cpu_turns.py): the order of a prefill's and a decode's steps.

Each side opens its own descriptors of the lock files, as two worker processes
do; flock(2) locks conflict between open files even within one process.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg.proto.vocabulary import Role
from disagg.workers.config import ServerConfig
from disagg.workers.pd.cpu_turns import BESIDE_THREADS, DecodeTurns, PrefillTurns

LONG_WAIT_S = 30.0  # a decode bound no test reaches


def test_a_decode_steps_alone_when_no_prefill_has_work(tmp_path: Path) -> None:
    decode, other_decode = DecodeTurns(tmp_path, LONG_WAIT_S), DecodeTurns(tmp_path, LONG_WAIT_S)
    assert decode.may_step(4)
    assert not other_decode.may_step(4)  # one decode alone on the shared cores at a time
    decode.after_step()
    assert other_decode.may_step(4)
    other_decode.after_step()


def test_a_decode_waits_while_the_prefill_holds_as_many_requests_and_steps_after_the_bound(tmp_path: Path) -> None:
    prefill, decode = PrefillTurns(tmp_path), DecodeTurns(tmp_path, wait_s=0.2)
    assert prefill.may_step(8)
    prefill.after_step()  # the prefill keeps its turn across steps
    began = time.monotonic()
    while not decode.may_step(8):
        assert time.monotonic() - began < 5.0, "the decode never stepped"
        time.sleep(0.005)
    assert time.monotonic() - began >= 0.2  # it waited its bound, then stepped beside the prefill
    decode.after_step()
    assert not decode.may_step(8)  # a new wait begins with the next step
    prefill.idle()
    assert decode.may_step(8)  # the prefill is idle: the decode's turn at once
    decode.after_step()


def test_a_decode_running_more_requests_than_the_prefill_holds_steps_beside_it(tmp_path: Path) -> None:
    """Long prompts arriving one by one while many requests decode: their TPOT does not wait."""
    prefill, decode = PrefillTurns(tmp_path), DecodeTurns(tmp_path, LONG_WAIT_S)
    assert prefill.may_step(1)
    assert decode.may_step(4)
    decode.after_step()
    assert prefill.may_step(1)  # both step: the prefill keeps its turn
    assert prefill.may_step(6)  # a backlog comes: now the prompts go first
    assert not decode.may_step(4)
    prefill.idle()


def test_each_worker_steps_on_one_thread_beside_the_other_and_on_all_alone(tmp_path: Path) -> None:
    prefill, decode = PrefillTurns(tmp_path), DecodeTurns(tmp_path, LONG_WAIT_S)
    assert decode.may_step(4) and decode.step_threads() is None  # no prefill has work: alone
    decode.after_step()
    assert prefill.may_step(4) and prefill.step_threads() is None  # as many requests: the decode will wait
    assert decode.may_step(5) and decode.step_threads() == BESIDE_THREADS  # more requests: beside
    assert prefill.step_threads() == BESIDE_THREADS  # ... and the prefill's next step too
    decode.after_step()
    assert prefill.may_step(5) and prefill.step_threads() is None  # the decode's step beside ended
    prefill.idle()
    assert decode.may_step(4) and decode.step_threads() is None  # alone again
    decode.after_step()
    decode.idle()


def test_a_prefill_holding_fewer_requests_takes_one_thread_before_the_decode_steps_beside(tmp_path: Path) -> None:
    """A prompt step on every thread that the decode's step then joins would run three threads
    on two cores; the decode runs more requests, so its step beside comes next: one thread."""
    prefill, decode = PrefillTurns(tmp_path), DecodeTurns(tmp_path, LONG_WAIT_S)
    assert decode.may_step(6)
    decode.after_step()  # between the decode's steps, not beside anything yet
    assert prefill.may_step(2) and prefill.step_threads() == BESIDE_THREADS
    assert prefill.may_step(6) and prefill.step_threads() is None  # more prompts: the decode will wait
    decode.idle()  # its requests ended: the count it wrote no longer counts
    assert prefill.may_step(2) and prefill.step_threads() is None
    prefill.idle()


def test_a_prefill_waits_for_the_decode_step_in_progress_and_then_goes_first(tmp_path: Path) -> None:
    prefill, decode = PrefillTurns(tmp_path), DecodeTurns(tmp_path, LONG_WAIT_S)
    assert decode.may_step(2)
    assert not prefill.may_step(2)  # the decode's step is running alone on the cores
    decode.after_step()
    # The prefill has said it holds requests: the decode does not take the cores back first.
    assert not decode.may_step(2)
    assert prefill.may_step(2)
    prefill.idle()


def test_a_prefill_takes_small_steps_only_while_a_decode_has_requests(tmp_path: Path) -> None:
    """A wave of prompts while no decode runs goes in one step, as a mixed worker's would;
    beside a decode's requests, the prefill's steps narrow to its cap."""
    prefill, decode = PrefillTurns(tmp_path, busy_step_tokens=512), DecodeTurns(tmp_path, LONG_WAIT_S)
    assert prefill.may_step(8)
    assert prefill.step_tokens() is None  # no decode has requests: the engine's whole budget
    prefill.after_step()
    decode.may_step(2)  # the first prompts' decodes begin (whether it steps now does not matter)
    assert prefill.step_tokens() == 512
    decode.idle()  # its requests ended
    assert prefill.step_tokens() is None
    assert PrefillTurns(tmp_path).step_tokens() is None  # no cap: never narrowed
    assert decode.step_tokens() is None
    prefill.idle()
    with pytest.raises(ValueError, match="must be positive"):
        PrefillTurns(tmp_path, busy_step_tokens=0)


def test_a_dead_workers_turn_is_dropped(tmp_path: Path) -> None:
    """The kernel drops flock(2) locks with their process: a prefill that died holding the
    turn does not hold up the decode."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from disagg.workers.pd.cpu_turns import PrefillTurns\n"
         f"t = PrefillTurns(Path({str(tmp_path)!r})); assert t.may_step(32); print('held', flush=True); "
         "time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        decode = DecodeTurns(tmp_path, LONG_WAIT_S)
        assert not decode.may_step(2)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert decode.may_step(2)  # the count it left in the file does not matter without its lock
    decode.after_step()


def test_turns_are_for_a_prefill_and_a_decode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mixed worker orders its own steps"):
        ServerConfig(role=Role.MIXED, cpu_turn_dir=tmp_path)
    with pytest.raises(ValueError, match="cpu_turn_wait_s must be positive"):
        ServerConfig(role=Role.DECODE, insecure=True, cpu_turn_dir=tmp_path, cpu_turn_wait_s=0)
    with pytest.raises(ValueError, match="must be positive"):
        DecodeTurns(tmp_path, wait_s=-1)
