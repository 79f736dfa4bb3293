"""A real Kubernetes control plane on loopback, in the manner of envtest.

etcd, kube-apiserver (static-token authentication, Node+RBAC authorization,
service-account signing keys, the default admission plugins plus
NodeRestriction, the aggregation layer) and kube-controller-manager (garbage
collector, namespaces, service accounts and their tokens, endpoints and
endpoint slices, the root CA publisher, deployments and replica sets, the
HorizontalPodAutoscaler), each on free 127.0.0.1 ports with its data, keys,
logs and kubeconfigs in one per-run folder.
"""

from __future__ import annotations

import ipaddress
import shutil
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from disagg.testing.binaries import Binaries
from disagg.testing.lifecycle import StartStop
from disagg.testing.pki import (
    FRONT_PROXY_CLIENT,
    SERVICE_CIDR,
    Identity,
    new_identity,
    write_pki,
    write_token_file,
)
from disagg.testing.processes import ManagedProcess
from disagg.workers.local import free_port

HOST = "127.0.0.1"
ADMIN_USER = "disagg-admin"  # in system:masters
USER = "disagg-user"  # authenticated, with no RBAC grants
CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "root-ca-certificate-publisher-controller",
    "deployment-controller",
    "replicaset-controller",
    "horizontal-pod-autoscaler-controller",
)
# The HPA controller's period and scale-down window, seconds rather than the
# defaults' 15 s and 5 min, so a test sees it act both ways within a minute.
HPA_SYNC_PERIOD = "2s"
HPA_DOWNSCALE_STABILIZATION = "10s"


class ControlPlaneError(RuntimeError):
    """A component did not come up; the message carries its log tail."""


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int

    @property
    def server_url(self) -> str:
        return f"https://{HOST}:{self.apiserver}"


def write_kubeconfig(path: Path, server: str, ca_file: Path, identity: Identity) -> None:
    """A kubeconfig with one cluster, one bearer-token user and one context."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "disagg", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": identity.user, "user": {"token": identity.token}}],
        "contexts": [{"name": identity.user, "context": {"cluster": "disagg", "user": identity.user}}],
        "current-context": identity.user,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


def wait_http(proc: ManagedProcess, url: str, deadline: float, timeout_s: float, ca_file: Path | None,
              token: str | None = None) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits, late at `deadline` (`timeout_s`
    after the start, for the message). Without `ca_file` the server's certificate is not checked."""
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if ca_file is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    last = "no answer yet"
    while True:
        code = proc.poll()
        if code is not None:
            raise ControlPlaneError(
                f"{proc.name} exited with code {code} before {url} was ready; "
                f"log {proc.log_path}:\n{proc.tail()}"
            )
        try:
            tls = context if url.startswith("https") else None
            with urllib.request.urlopen(request, timeout=2, context=tls) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[-2000:].decode(errors='replace')}"
        except (OSError, ssl.SSLError) as e:
            last = repr(e)
        if time.monotonic() > deadline:
            raise ControlPlaneError(
                f"{proc.name} not ready at {url} within {timeout_s:.0f} s (last: {last}); "
                f"log {proc.log_path}:\n{proc.tail()}"
            )
        time.sleep(0.2)


class ControlPlane(StartStop):
    """etcd + kube-apiserver + kube-controller-manager; use as a context manager.

    `workdir` (a fresh temporary folder by default, removed on stop) holds
    everything a run writes; the logs are under `workdir/logs`.
    """

    def __init__(self, binaries: Binaries, workdir: Path | None = None, start_timeout_s: float = 120.0) -> None:
        self.binaries = binaries
        self._own_workdir = workdir is None
        self.workdir = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="disagg-k8s-run-cp-"))
        self.start_timeout_s = start_timeout_s
        self.admin = new_identity(ADMIN_USER, "system:masters")
        self.user = new_identity(USER)
        self._kcm_identity = new_identity("system:kube-controller-manager")
        self.admin_kubeconfig = self.workdir / "admin.kubeconfig"
        self.user_kubeconfig = self.workdir / "user.kubeconfig"
        self.ports = Ports(free_port(), free_port(), free_port(), free_port())
        self.ca_file = self.workdir / "pki" / "ca.crt"
        self._processes: list[ManagedProcess] = []

    @property
    def server_url(self) -> str:
        return self.ports.server_url

    # ---- start ----------------------------------------------------------

    def start(self) -> None:
        """Start the three components in order; raises ControlPlaneError (after stopping) on failure."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        pki = write_pki(
            self.workdir / "pki",
            [HOST, "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local", str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))],
        )
        assert pki.ca_cert == self.ca_file, "the CA path is fixed before start"
        tokens = self.workdir / "tokens.csv"
        write_token_file(tokens, [self.admin, self.user, self._kcm_identity])
        write_kubeconfig(self.admin_kubeconfig, self.server_url, pki.ca_cert, self.admin)
        write_kubeconfig(self.user_kubeconfig, self.server_url, pki.ca_cert, self.user)
        kcm_kubeconfig = self.workdir / "controller-manager.kubeconfig"
        write_kubeconfig(kcm_kubeconfig, self.server_url, pki.ca_cert, self._kcm_identity)
        deadline = time.monotonic() + self.start_timeout_s
        logs = self.workdir / "logs"

        p = self.ports
        etcd = self._spawn("etcd", [
            str(self.binaries.etcd),
            "--name=default",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://{HOST}:{p.etcd_client}",
            f"--advertise-client-urls=http://{HOST}:{p.etcd_client}",
            f"--listen-peer-urls=http://{HOST}:{p.etcd_peer}",
            f"--initial-advertise-peer-urls=http://{HOST}:{p.etcd_peer}",
            f"--initial-cluster=default=http://{HOST}:{p.etcd_peer}",
            # A throw-away store: durability costs seconds per test run.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ], logs)
        self._wait_http(etcd, f"http://{HOST}:{p.etcd_client}/health", deadline)

        apiserver = self._spawn("kube-apiserver", [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers=http://{HOST}:{p.etcd_client}",
            f"--bind-address={HOST}",
            f"--advertise-address={HOST}",
            f"--secure-port={p.apiserver}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={tokens}",
            "--authorization-mode=Node,RBAC",
            # The defaults stay on; NodeRestriction pairs with the Node authorizer.
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            # The `kubernetes` Service's endpoint would be 127.0.0.1, which
            # Endpoints validation rejects; nothing here routes to it anyway.
            "--endpoint-reconciler-type=none",
            # The aggregation layer, for extension API servers (a metrics adapter):
            # it authenticates as the front proxy and names the caller in headers.
            f"--requestheader-client-ca-file={pki.front_proxy_ca}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki.front_proxy_client_cert}",
            f"--proxy-client-key-file={pki.front_proxy_client_key}",
            # Dial the APIService's endpoint, not its Service's ClusterIP, which
            # nothing routes here (no kube-proxy).
            "--enable-aggregator-routing=true",
            "--profiling=false",
        ], logs)
        self._wait_http(apiserver, f"{self.server_url}/readyz", deadline, token=self.admin.token)

        kcm = self._spawn("kube-controller-manager", [
            str(self.binaries.kube_controller_manager),
            f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}",
            f"--authorization-kubeconfig={kcm_kubeconfig}",
            f"--bind-address={HOST}",
            f"--secure-port={p.controller_manager}",
            f"--cert-dir={self.workdir / 'controller-manager-certs'}",
            f"--controllers={','.join(CONTROLLERS)}",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_cert}",
            "--use-service-account-credentials=true",
            "--leader-elect=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}",
            f"--horizontal-pod-autoscaler-downscale-stabilization={HPA_DOWNSCALE_STABILIZATION}",
            "--profiling=false",
        ], logs)
        # It serves a self-signed certificate of its own.
        self._wait_http(kcm, f"https://{HOST}:{p.controller_manager}/healthz", deadline, verify=False)

    def _spawn(self, name: str, argv: list[str], logs: Path) -> ManagedProcess:
        proc = ManagedProcess(name, argv, logs / f"{name}.log")
        self._processes.append(proc)
        return proc

    def _wait_http(
        self, proc: ManagedProcess, url: str, deadline: float, token: str | None = None, verify: bool = True
    ) -> None:
        wait_http(proc, url, deadline, self.start_timeout_s, self.ca_file if verify else None, token)

    # ---- stop -----------------------------------------------------------

    def stop(self) -> None:
        """Stop the components in reverse order and remove a temporary workdir."""
        while self._processes:
            self._processes.pop().stop(grace_s=10.0)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
