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
    env = {k: v for k, v in os.environ.items() if k != "DISAGG_CLUSTER_KEY_FILE"}
    result = subprocess.run([*DISAGG, *command], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    assert "give --cluster-key-file PATH (or set DISAGG_CLUSTER_KEY_FILE), or --insecure on purpose" in result.stderr
