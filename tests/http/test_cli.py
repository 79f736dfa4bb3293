"""The `disagg` command: subcommands, a fast --help, and `disagg link` errors."""

from __future__ import annotations

import subprocess
import sys

from disagg.workers.local import free_port

DISAGG = [sys.executable, "-m", "disagg.workers"]
# Loads the CLI, runs it with the given arguments, and lists the heavy modules it imported.
_PROBE = """
import sys
from disagg.workers.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("HEAVY", sorted(m for m in ("torch", "kopf", "grpc", "transformers") if m in sys.modules))
"""


def _probe(*args: str) -> str:
    result = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=60)
    return result.stdout


def test_help_and_version_import_nothing_heavy() -> None:
    out = _probe("--help")
    for name in ("serve", "link", "unlink", "demo", "operator"):
        assert f"    {name}" in out, out
    assert "HEAVY []" in out
    out = _probe("--version")
    assert "HEAVY []" in out
    assert "HEAVY []" in _probe("serve", "--help"), "serve's options come from torch-free defaults"


def test_link_to_nothing_fails_with_the_reason() -> None:
    """The error names the side that failed: the prefill asked for its transfer port, else the decode."""
    port = free_port()
    link = [*DISAGG, "link", "--decode", f"127.0.0.1:{port}", "--prefill", "127.0.0.1:1", "--timeout", "3",
            "--insecure"]
    result = subprocess.run(link, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "asking 127.0.0.1:1 for its transfer port: UNAVAILABLE" in result.stderr, result.stderr
    result = subprocess.run([*link, "--prefill-transfer-port", "26000"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"127.0.0.1:{port} refused: UNAVAILABLE" in result.stderr, result.stderr


def test_unlink_reports_each_side() -> None:
    decode, prefill = free_port(), free_port()
    result = subprocess.run([*DISAGG, "unlink", "--decode", f"127.0.0.1:{decode}", "--prefill",
                             f"127.0.0.1:{prefill}", "--timeout", "3", "--insecure"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"127.0.0.1:{decode} refused: UNAVAILABLE" in result.stderr
    assert f"127.0.0.1:{prefill} refused: UNAVAILABLE" in result.stderr


def test_operator_subcommand_has_its_options() -> None:
    result = subprocess.run([*DISAGG, "operator", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--namespace" in result.stdout


def test_free_port_never_gives_a_port_twice() -> None:
    """Callers take several ports in a row before binding any (a worker takes four):
    the kernel may offer a just-closed port again, free_port does not."""
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
