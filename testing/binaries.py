"""Where the control plane's binaries come from.

`hack/k8s-binaries.sh` builds them from their Go modules into a cache outside
the repository (only what is missing) and prints that folder. A folder named by
`KUBEBUILDER_ASSETS` (envtest's convention) wins for each binary it holds.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "hack" / "k8s-binaries.sh"
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")


class BinariesError(RuntimeError):
    """The binaries are neither present nor buildable; the message says why."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    helm: Path | None
    kubectl: Path | None = None

    @property
    def folder(self) -> Path:
        return self.kube_apiserver.parent


def _pick(name: str, build_dir: Path | None) -> Path | None:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    for folder in ([Path(assets)] if assets else []) + ([build_dir] if build_dir else []):
        candidate = folder / name
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def run_build_script(script: Path, timeout_s: float) -> list[str]:
    """Run one of hack/'s build scripts; returns its stdout lines (never empty: the last names a folder).

    Raises BinariesError with the script's output tail when it fails.
    """
    try:
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise BinariesError(f"{script} ran past {timeout_s:.0f} s") from e
    if done.returncode != 0:
        raise BinariesError(f"{script} failed with exit code {done.returncode}:\n{done.stderr[-4000:]}")
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise BinariesError(f"{script} printed no folder:\n{done.stderr[-4000:]}")
    return lines


def find_binaries(build: bool = True, build_timeout_s: float = 5400.0) -> Binaries:
    """Locate the binaries, building the missing ones first when `build`.

    Raises BinariesError with the build script's output tail when it fails.
    """
    build_dir: Path | None = None
    if build:
        if not BUILD_SCRIPT.is_file():
            raise BinariesError(f"{BUILD_SCRIPT} is missing (an installed wheel has no hack/); set KUBEBUILDER_ASSETS")
        build_dir = Path(run_build_script(BUILD_SCRIPT, build_timeout_s)[-1])
    found = {name: _pick(name, build_dir) for name in CONTROL_PLANE_BINARIES + ("helm", "kubectl")}
    missing = [name for name in CONTROL_PLANE_BINARIES if found[name] is None]
    if missing:
        where = f"KUBEBUILDER_ASSETS={os.environ.get('KUBEBUILDER_ASSETS', '')!r}, build folder {build_dir}"
        raise BinariesError(f"missing binaries {missing} ({where})")
    etcd, apiserver, kcm = (found[name] for name in CONTROL_PLANE_BINARIES)
    assert etcd and apiserver and kcm, "checked by `missing` above"
    return Binaries(etcd=etcd, kube_apiserver=apiserver, kube_controller_manager=kcm, helm=found["helm"],
                    kubectl=found["kubectl"])
