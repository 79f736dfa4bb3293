"""The control plane and the local kubelet together: a one-node cluster on loopback."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kubernetes.client.exceptions import ApiException

from disagg.testing.binaries import Binaries, find_binaries
from disagg.testing.controlplane import ControlPlane
from disagg.testing.kubelet import LocalKubelet
from disagg.testing.lifecycle import StartStop
from disagg.testing.rest import Kube

T = TypeVar("T")


class LocalCluster(StartStop):
    """`start()` builds the binaries when missing, then starts the control plane and the kubelet.

    Everything a run writes goes under `workdir` (a fresh temporary folder
    named disagg-k8s-run-*, removed on stop, unless given; every control-plane
    process has that name on its command line, which .ci/run's clean-up relies on): `logs/` for the control plane,
    `kubelet/pods/<namespace>_<name>.log` for each pod's process.
    """

    def __init__(self, workdir: Path | None = None, binaries: Binaries | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self._own_workdir = workdir is None
        self.workdir = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="disagg-k8s-run-"))
        self._binaries = binaries
        self.start_timeout_s = start_timeout_s
        self.control_plane: ControlPlane | None = None
        self.kubelet: LocalKubelet | None = None
        self.start_seconds = 0.0  # wall time of the last control plane start

    @property
    def binaries(self) -> Binaries:
        if self._binaries is None:
            self._binaries = find_binaries()
        return self._binaries

    def start(self) -> None:
        binaries = self.binaries
        began = time.monotonic()
        self.control_plane = ControlPlane(binaries, self.workdir, self.start_timeout_s)
        try:
            self.control_plane.start()
            self.start_seconds = time.monotonic() - began
            self.kubelet = LocalKubelet(self.control_plane.admin_kubeconfig, self.workdir / "kubelet")
            self.kubelet.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
            self.kubelet = None
        if self.control_plane is not None:
            self.control_plane.stop()
            self.control_plane = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def admin_kubeconfig(self) -> Path:
        assert self.control_plane is not None, "the cluster is not started"
        return self.control_plane.admin_kubeconfig

    @property
    def user_kubeconfig(self) -> Path:
        assert self.control_plane is not None, "the cluster is not started"
        return self.control_plane.user_kubeconfig

    def kube(self, admin: bool = True) -> Kube:
        """A new API connection for the admin (system:masters) or the non-admin identity."""
        return Kube(self.admin_kubeconfig if admin else self.user_kubeconfig)


def create_namespace(kube: Kube, name: str, timeout_s: float = 60.0) -> None:
    """Create a namespace and wait for its `default` ServiceAccount.

    The ServiceAccount admission plugin refuses pods until the service-account
    controller has created that account, a moment after the namespace.
    """
    kube.post("/api/v1/namespaces", {"metadata": {"name": name}})

    def has_account() -> bool:
        try:
            kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default")
        except ApiException as e:
            if e.status != 404:
                raise
            return False
        return True

    wait_until(has_account, timeout_s, f"the default ServiceAccount of namespace {name}")


def wait_until(check: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """Poll `check` until it returns something other than None or False; TimeoutError names `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
