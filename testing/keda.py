"""KEDA (operator and metrics adapter) as processes on the local control plane,
so a standard HorizontalPodAutoscaler can read external metrics.

`hack/keda-binaries.sh` builds both from KEDA's Go module into a cache. The
operator reconciles ScaledObjects into HPAs and computes the trigger values;
the adapter serves them as `external.metrics.k8s.io/v1beta1`, an aggregated
API: an APIService names a Service in namespace `keda` whose EndpointSlice
holds the routable address the adapter listens on (the aggregator dials that
endpoint; EndpointSlices refuse loopback addresses). One certificate folder
(tls.crt, tls.key, ca.crt, KEDA's layout) serves the adapter and both ends of
the mutual-TLS gRPC link between adapter and operator.
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

from disagg.testing.binaries import REPO_ROOT, BinariesError, run_build_script
from disagg.testing.cluster import wait_until
from disagg.testing.controlplane import HOST, wait_http
from disagg.workers.local import free_port
from disagg.testing.kubectl import install_crd
from disagg.testing.lifecycle import StartStop
from disagg.testing.pki import write_tls_folder
from disagg.testing.processes import ManagedProcess
from disagg.testing.rest import Kube

BUILD_SCRIPT = REPO_ROOT / "hack" / "keda-binaries.sh"
NAMESPACE = "keda"
SERVICE = "keda-metrics-apiserver"
API_SERVICE = "v1beta1.external.metrics.k8s.io"
_API_SERVICES = "/apis/apiregistration.k8s.io/v1/apiservices"
_SLICE = f"{SERVICE}-adapter"


@dataclass(frozen=True)
class KedaBinaries:
    operator: Path
    adapter: Path
    crds: tuple[Path, ...]  # KEDA's CustomResourceDefinitions, from its module's config/crd/bases


def find_keda(build_timeout_s: float = 3600.0) -> KedaBinaries:
    """Build what is missing, then locate the binaries and the CRDs; BinariesError says why not."""
    if not BUILD_SCRIPT.is_file():
        raise BinariesError(f"{BUILD_SCRIPT} is missing (an installed wheel has no hack/)")
    *_, bin_dir, source = run_build_script(BUILD_SCRIPT, build_timeout_s)
    crds = tuple(sorted((Path(source) / "config" / "crd" / "bases").glob("*.yaml")))
    if not crds:
        raise BinariesError(f"no CRDs under {source}/config/crd/bases")
    return KedaBinaries(operator=Path(bin_dir) / "keda", adapter=Path(bin_dir) / "keda-adapter", crds=crds)


class Keda(StartStop):
    """KEDA's operator and metrics adapter against the cluster of `kubeconfig` (an admin's).

    `address` is where the adapter listens: a local address outside
    127.0.0.0/8 that no pod takes (`LocalKubelet.take_address`).
    """

    def __init__(self, binaries: KedaBinaries, kube: Kube, kubeconfig: Path, address: str, workdir: Path,
                 start_timeout_s: float = 120.0) -> None:
        self.binaries, self.kube, self.kubeconfig, self.address = binaries, kube, kubeconfig, address
        self.workdir = workdir
        self.start_timeout_s = start_timeout_s
        self.adapter_port, self.grpc_port, self.probe_port = free_port(address), free_port(), free_port()
        self._processes: list[ManagedProcess] = []

    @property
    def logs(self) -> list[Path]:
        """The operator's and the adapter's logs (kept after stop)."""
        return sorted((self.workdir / "logs").glob("*.log"))

    def start(self) -> None:
        """Install the CRDs, start both processes and register the adapter; stops everything on failure."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for crd in self.binaries.crds:
            install_crd(self.kube, yaml.safe_load(crd.read_text()))
        self._create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        certs = write_tls_folder(self.workdir / "certs",
                                 [f"{SERVICE}.{NAMESPACE}.svc", self.address, HOST, "localhost"])
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.workdir), "KUBECONFIG": str(self.kubeconfig),
               # Every namespace; KEDA's own objects in `keda`, as its chart installs them.
               "WATCH_NAMESPACE": "", "POD_NAMESPACE": NAMESPACE, "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE}
        operator = self._spawn("keda-operator", [
            str(self.binaries.operator),
            f"--metrics-bind-address={HOST}:{free_port()}",
            f"--health-probe-bind-address={HOST}:{self.probe_port}",
            f"--metrics-service-bind-address={HOST}:{self.grpc_port}",
            f"--cert-dir={certs}",
            # The certificates are ours: KEDA neither makes them nor patches the APIService.
            "--enable-cert-rotation=false",
            "--enable-webhook-patching=false",
            "--enable-apiservice-patching=false",
        ], env)
        wait_http(operator, f"http://{HOST}:{self.probe_port}/readyz", deadline, self.start_timeout_s, None)
        adapter = self._spawn("keda-adapter", [
            str(self.binaries.adapter),
            f"--lister-kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            f"--bind-address={self.address}",
            f"--secure-port={self.adapter_port}",
            f"--tls-cert-file={certs / 'tls.crt'}",
            f"--tls-private-key-file={certs / 'tls.key'}",
            # The gRPC client's certificates (ca.crt, tls.crt, tls.key) come from here.
            f"--cert-dir={certs}",
            f"--metrics-service-address={HOST}:{self.grpc_port}",
            f"--port={free_port()}",
        ], env)
        wait_http(adapter, f"https://{self.address}:{self.adapter_port}/readyz", deadline, self.start_timeout_s,
                  certs / "ca.crt")
        self._register(certs / "ca.crt")
        wait_until(self._available, max(deadline - time.monotonic(), 1.0), f"the {API_SERVICE} APIService Available")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.workdir / "logs" / f"{name}.log", env=env)
        self._processes.append(proc)
        return proc

    def _create(self, path: str, body: dict[str, Any]) -> None:
        """Create `body` under `path`; one left by an earlier start is kept."""
        try:
            self.kube.post(path, body)
        except ApiException as e:
            if e.status != 409:
                raise

    def _register(self, ca: Path) -> None:
        """The Service, its EndpointSlice (the adapter's address) and the APIService that names them."""
        self._create(f"/api/v1/namespaces/{NAMESPACE}/services", {
            "metadata": {"name": SERVICE},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": self.adapter_port}]}})
        slices = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
        if self._exists(f"{slices}/{_SLICE}"):  # an earlier start's, with another port
            self.kube.delete(f"{slices}/{_SLICE}")
        self.kube.post(slices, {
            "metadata": {"name": _SLICE, "labels": {"kubernetes.io/service-name": SERVICE,
                                                    "endpointslice.kubernetes.io/managed-by": "disagg-testing"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [self.address], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": self.adapter_port, "protocol": "TCP"}]})
        self._create(_API_SERVICES, {
            "metadata": {"name": API_SERVICE},
            "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1",
                     "service": {"name": SERVICE, "namespace": NAMESPACE, "port": 443},
                     "caBundle": base64.b64encode(ca.read_bytes()).decode(),
                     "groupPriorityMinimum": 100, "versionPriority": 100}})

    def _exists(self, path: str) -> bool:
        try:
            self.kube.get(path)
        except ApiException as e:
            if e.status != 404:
                raise
            return False
        return True

    def _available(self) -> bool:
        got = self.kube.get(f"{_API_SERVICES}/{API_SERVICE}")
        return any(c["type"] == "Available" and c["status"] == "True"
                   for c in (got.get("status") or {}).get("conditions") or [])

    def stop(self) -> None:
        """Unregister the adapter (an unavailable aggregated API breaks discovery, and with it namespace
        deletion, for the rest of the session), then stop both processes."""
        if self._processes and self._exists(f"{_API_SERVICES}/{API_SERVICE}"):
            self.kube.delete(f"{_API_SERVICES}/{API_SERVICE}")
        while self._processes:
            self._processes.pop().stop(grace_s=10.0)
