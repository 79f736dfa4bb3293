"""Without a cluster key, the tools refuse to run unless told --insecure on purpose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

DISAGG = [sys.executable, "-m", "disagg.workers"]


@pytest.mark.parametrize("command", [
    ["serve", "--role", "prefill", "--model", "builtin:smollm2-135m"],
    ["link", "--decode", "127.0.0.1:1", "--prefill", "127.0.0.1:2"],
    ["unlink", "--decode", "127.0.0.1:1", "--prefill", "127.0.0.1:2"],
], ids=["serve", "link", "unlink"])
def test_no_key_and_no_insecure_is_a_clear_error(command: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DISAGG_CLUSTER_KEY_FILE", "DISAGG_CLUSTER_KEY")}
    result = subprocess.run([*DISAGG, *command], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    assert ("give --cluster-key-file PATH (or set DISAGG_CLUSTER_KEY_FILE, or the key itself in DISAGG_CLUSTER_KEY), "
            "or --insecure on purpose") in result.stderr


def test_the_key_itself_may_come_from_the_environment() -> None:
    """`disagg link` with the key in $DISAGG_CLUSTER_KEY gets past the key check (to a refused connection);
    a value that is not a key is a clear error."""
    command = [*DISAGG, "link", "--decode", "127.0.0.1:1", "--prefill", "127.0.0.1:2", "--timeout", "2"]
    base = {k: v for k, v in os.environ.items() if k != "DISAGG_CLUSTER_KEY_FILE"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                            env={**base, "DISAGG_CLUSTER_KEY": "ab" * 32})
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr, result.stderr
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**base, "DISAGG_CLUSTER_KEY": "x"})
    assert result.returncode == 2 and "$DISAGG_CLUSTER_KEY" in result.stderr, result.stderr
