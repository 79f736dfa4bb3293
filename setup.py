"""The wheel's package list; everything else is in pyproject.toml.

`disagg.testing` (a control plane launcher, a kubelet emulator, a PKI) is the
tests' harness, packaged only from a checkout that has `testing/`. The images
build their wheel without copying it (Dockerfile.worker, Dockerfile.operator),
so it never reaches them; `pip install -e ".[dev]"` in a checkout has it.
"""

from pathlib import Path

from setuptools import setup

RUNTIME_PACKAGES = [
    "disagg.workers",
    "disagg.workers.engine",
    "disagg.workers.engine.csrc",  # the CPU kernels' C sources (data only), built on first use
    "disagg.workers.engine.models",
    "disagg.workers.pd",
    "disagg.workers.transfer",
    "disagg.workers.http",
    "disagg.workers.security",
    "disagg.operator",
    "disagg.proto",
]
TEST_HARNESS = "disagg.testing"

has_harness = (Path(__file__).resolve().parent / "testing").is_dir()
setup(packages=RUNTIME_PACKAGES + ([TEST_HARNESS] if has_harness else []))
