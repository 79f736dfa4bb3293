"""The chart tests' helm runner (the control plane fixtures are tests/conftest.py's).

helm is the binary hack/k8s-binaries.sh builds (v3.21.4), found through
`disagg.testing.binaries`; a missing helm fails the tests (never skips).
Every helm call has a timeout and private config/cache folders.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.testing.binaries import BinariesError, find_binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "disagg"
HELM_TIMEOUT_S = 120.0


class Manifests(list[dict[str, Any]]):
    """Rendered objects, with look-ups by kind (and name)."""

    def find(self, kind: str, name: str | None = None) -> list[dict[str, Any]]:
        return [o for o in self if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = self.find(kind, name)
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]


class HelmError(RuntimeError):
    """helm exited non-zero; the message carries its output."""


@dataclass(frozen=True)
class Helm:
    binary: Path
    home: Path  # HELM_{CACHE,CONFIG,DATA}_HOME live here, not in the user's folders

    def __call__(self, *args: str, kubeconfig: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {"HELM_CACHE_HOME": str(self.home / "cache"), "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data"), "PATH": "/usr/bin:/bin", "HOME": str(self.home)}
        argv = [str(self.binary), *args] + (["--kubeconfig", str(kubeconfig)] if kubeconfig else [])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=HELM_TIMEOUT_S, env=env, check=False)
        if check and done.returncode != 0:
            raise HelmError(f"helm {' '.join(args)} exited with {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def template(self, *args: str, chart: Path = CHART, release: str = "disagg") -> Manifests:
        """`helm template` as a list of objects (empty documents dropped)."""
        out = self("template", release, str(chart), "--namespace", "disagg-system", *args).stdout
        return Manifests(doc for doc in yaml.safe_load_all(out) if doc)


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    try:
        binary = find_binaries().helm
    except BinariesError as e:
        pytest.fail(f"the Kubernetes binaries are not available: {e}", pytrace=False)
    if binary is None:
        pytest.fail("hack/k8s-binaries.sh built no helm", pytrace=False)
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


