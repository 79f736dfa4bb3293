"""The chart against the real test control plane.

- every rendered manifest passes a server-side dry-run apply;
- `helm install`, then the operator runs with the chart's ServiceAccount token
  (not as admin) and the chart's own arguments and environment: it creates
  the pods and writes the status, so the chart's RBAC is enough; what the
  RBAC does not grant is refused;
- `helm upgrade` with a changed CRD schema updates the CRD once crds.manage is on.

The release is installed with `operator.replicas=0`, so the test starts the
operator process itself from what the installed Deployment says, with a
token it can look at (`make demo-k8s` runs the chart's pod under the local
kubelet instead).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from disagg.operator import crd
from disagg.operator import manifests as m
from disagg.testing.cluster import LocalCluster, create_namespace, wait_until
from disagg.testing.controlplane import write_kubeconfig
from disagg.testing.pki import Identity
from disagg.testing.rest import Kube
from disagg.testing.tiny_model import build_tiny_model

if TYPE_CHECKING:
    from conftest import Helm

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "disagg"
VALUES_FILES = sorted((Path(__file__).resolve().parent / "values").glob("*.yaml"))
RELEASE = "disagg"
WAIT_S = 120.0
CRD_NAME = f"{crd.PLURAL}.{crd.GROUP}"
# Namespaces the values files name (watched namespaces, worker namespaces).
FIXED_NAMESPACES = ("team-a", "team-b", "serving", "staging")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_namespace(kube: Kube, name: str) -> None:
    try:
        create_namespace(kube, name)
    except ApiException as e:
        if e.status != 409:
            raise


def monitoring_stand_in_crds(kube: Kube) -> None:
    """ServiceMonitor and PodMonitor kinds that accept any spec.

    NOTE: stand-ins, not the Prometheus Operator's schemas: the dry run proves
    the objects are well-formed API objects of those kinds, not that the
    Prometheus Operator accepts every field.
    """
    for kind in ("ServiceMonitor", "PodMonitor"):
        plural = kind.lower() + "s"
        body = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.monitoring.coreos.com"},
                "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                         "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                         "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                             "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
        try:
            kube.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body)
        except ApiException as e:
            if e.status != 409:
                raise
        wait_until(lambda: _established(kube, f"{plural}.monitoring.coreos.com") or None, 30, f"the {kind} CRD")


def _established(kube: Kube, name: str) -> bool:
    got = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    return any(c["type"] == "Established" and c["status"] == "True" for c in (got.get("status") or {}).get("conditions") or [])


# ---- server-side dry run ---------------------------------------------------------


@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda v: v.stem if v else "defaults")
def test_rendered_manifests_pass_a_server_side_dry_run(helm: Helm, kube: Kube, namespace: str,
                                                       values: Path | None) -> None:
    for name in FIXED_NAMESPACES:
        ensure_namespace(kube, name)
    monitoring_stand_in_crds(kube)
    objects = helm.template("--namespace", namespace, *(["-f", str(values)] if values else []))
    assert objects, "nothing rendered"
    dynamic = DynamicClient(kube.api)
    for obj in objects:
        resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        answer = dynamic.server_side_apply(resource, body=obj, namespace=obj["metadata"].get("namespace"),
                                           field_manager="disagg-chart-test", force_conflicts=True, dry_run="All")
        assert answer.metadata.name == obj["metadata"]["name"]


# ---- install, then run the operator as the chart's ServiceAccount -----------------------


@dataclass(frozen=True)
class Installed:
    namespace: str  # the release's
    account_kubeconfig: Path  # the operator ServiceAccount's token, nothing more
    deployment: dict[str, Any]


@pytest.fixture(scope="module")
def installed(helm: Helm, cluster: LocalCluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """`helm install` with the default values (but no operator pod: the test runs it, watching every namespace)
    into a fresh namespace."""
    release_ns = f"disagg-{uuid.uuid4().hex[:6]}"
    create_namespace(kube, release_ns)
    # Every namespace: the tests make their clusters in namespaces of their own.
    helm("install", RELEASE, str(CHART), "--namespace", release_ns, "--set", "operator.watchAllNamespaces=true",
         "--set", "operator.replicas=0", "--set", "workerPods.networkPolicy.enabled=false",
         kubeconfig=cluster.admin_kubeconfig)
    wait_until(lambda: _established(kube, CRD_NAME) or None, 30, "the DisaggCluster CRD from crds/")
    token = kube.post(f"/api/v1/namespaces/{release_ns}/serviceaccounts/{RELEASE}/token",
                      {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                       "spec": {"expirationSeconds": 3600}})["status"]["token"]
    assert cluster.control_plane is not None, "the cluster fixture is started"
    kubeconfig = tmp_path_factory.mktemp("operator-account") / "kubeconfig"
    write_kubeconfig(kubeconfig, cluster.control_plane.server_url, cluster.control_plane.ca_file,
                     Identity(f"system:serviceaccount:{release_ns}:{RELEASE}", token))
    deployment = kube.get(f"/apis/apps/v1/namespaces/{release_ns}/deployments/{RELEASE}")
    yield Installed(release_ns, kubeconfig, deployment)
    helm("uninstall", RELEASE, "--namespace", release_ns, kubeconfig=cluster.admin_kubeconfig)
    kube.delete(f"/api/v1/namespaces/{release_ns}")


@dataclass(frozen=True)
class RunningOperator:
    process: subprocess.Popen[bytes]
    health_port: int
    metrics_port: int
    log: Path


@pytest.fixture
def operator(installed: Installed, tmp_path: Path) -> Iterator[RunningOperator]:
    """The operator process, with the installed Deployment's arguments and
    environment and the ServiceAccount's kubeconfig; only the two ports are
    moved to free ones (several test sessions share this machine)."""
    (container,) = installed.deployment["spec"]["template"]["spec"]["containers"]
    health_port, metrics_port = free_port(), free_port()
    args = [a for a in container["args"] if not a.startswith("--liveness-port")]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["DISAGG_OPERATOR_METRICS_PORT"] = str(metrics_port)
    env["DISAGG_OPERATOR_RESYNC_S"] = "2"  # quicker passes; the other settings stay the chart's
    # The kubelet runs the workers' `disagg` from PATH: this virtualenv's.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.operator.main", *args, f"--liveness-port={health_port}",
             "--kubeconfig", str(installed.account_kubeconfig)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env, "PATH": path}, cwd=ROOT)
    yield RunningOperator(proc, health_port, metrics_port, log)
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    sys.stderr.write(log.read_text(errors="replace")[-4000:])


def cluster_body(name: str, model: str, env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    role = {"replicas": 1, **({"env": env} if env else {})}
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"model": {"source": model, "servedName": "tiny"}, "image": "local",
                     "prefill": role, "decode": role,
                     "engine": {"device": "cpu", "dtype": "float32", "blockSize": 4, "numKvBlocks": 256,
                                "maxNumSeqs": 8}}}


def clusters_path(namespace: str, name: str = "") -> str:
    return f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{namespace}/{crd.PLURAL}" + (f"/{name}" if name else "")


def worker_pods(kube: Kube, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kube.get(f"/api/v1/namespaces/{namespace}/pods",
                                           labelSelector=m.CLUSTER_LABEL)["items"]
    return items


def test_operator_as_the_chart_account_creates_pods_and_writes_status(
        operator: RunningOperator, kube: Kube, namespace: str) -> None:
    # No worker process ever starts (PATH leads nowhere): this is about the API calls.
    nowhere = [{"name": "PATH", "value": "/nonexistent"}]
    created = kube.post(clusters_path(namespace), cluster_body("llm", "m", env=nowhere))
    wait_until(lambda: len(worker_pods(kube, namespace)) == 2 or None, WAIT_S, "two worker pods")

    def status() -> dict[str, Any] | None:
        s: dict[str, Any] | None = kube.get(clusters_path(namespace, "llm")).get("status")
        return s if s and s.get("observedGeneration") == created["metadata"]["generation"] else None

    s = wait_until(status, WAIT_S, "the status written by the operator")
    assert s["prefillReady"] == "0/1" and s["decodeReady"] == "0/1"
    # The per-role DisaggRoles, made and given their status under the same RBAC.
    roles = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{namespace}/{crd.ROLE_PLURAL}"

    def with_status() -> list[dict[str, Any]] | None:  # both: the operator writes one role's status, then the other's
        children = [c for c in kube.get(roles)["items"] if c.get("status")]
        return children if len(children) == 2 else None

    children = wait_until(with_status, WAIT_S, "both DisaggRoles with their status")
    assert sorted(c["metadata"]["name"] for c in children) == ["llm-decode", "llm-prefill"]
    assert kube.get(f"/api/v1/namespaces/{namespace}/services/llm")["spec"]["selector"][m.ROLE_LABEL] == "prefill"
    # The endpoints the chart's probes and metrics Service point at answer.
    assert httpx.get(f"http://127.0.0.1:{operator.health_port}/healthz", timeout=5).status_code == 200
    metrics = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5).text
    assert "disagg_operator_reconcile_duration_seconds" in metrics
    log = operator.log.read_text(errors="replace")
    # A 403 status, not the digits of a log line's milliseconds (",403"), which failed this once.
    assert "Not enough permissions" not in log and not re.search(r"(?<![\d,])403(?!\d)", log), log[-3000:]


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/api/v1/namespaces/{ns}/secrets", None),
    ("GET", "/api/v1/namespaces/{ns}/configmaps", None),
    ("POST", "/apis/apps/v1/namespaces/{ns}/deployments",
     {"metadata": {"name": "x"}, "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
         "metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}}),
    ("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}", None),
    ("DELETE", "/api/v1/namespaces/{ns}/services/anything", None),
    ("PATCH", "/api/v1/namespaces/{ns}", {"metadata": {"labels": {"x": "y"}}}),
    # The operator writes a role's spec.replicas itself: /scale is for the scalers, and it deletes no role.
    ("PUT", f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{{ns}}/{crd.ROLE_PLURAL}/x/scale",
     {"metadata": {"name": "x"}, "spec": {"replicas": 1}}),
    ("DELETE", f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{{ns}}/{crd.ROLE_PLURAL}/x", None),
])
def test_actions_outside_the_chart_rbac_are_refused(installed: Installed, namespace: str, method: str, path: str,
                                                   body: dict[str, Any] | None) -> None:
    account = Kube(installed.account_kubeconfig)
    try:
        with pytest.raises(ApiException) as err:
            account.request(method, path.format(ns=namespace), body)
        assert err.value.status == 403, err.value.body
        assert f"system:serviceaccount:{installed.namespace}:{RELEASE}" in err.value.body
    finally:
        account.close()


# ---- the link end to end (needs the workers' PD roles) ---------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.slow
def test_operator_as_the_chart_account_links_and_serves(operator: RunningOperator, kube: Kube, namespace: str,
                                                        tiny_model: Path) -> None:
    kube.post(clusters_path(namespace), cluster_body("llm", str(tiny_model)))

    def linked() -> bool:
        s = kube.get(clusters_path(namespace, "llm")).get("status") or {}
        return s.get("available") == "True" and s.get("links", {}).get("established") == 1

    wait_until(linked, WAIT_S, "the prefill and the decode, linked")
    (prefill,) = [p for p in worker_pods(kube, namespace) if p["metadata"]["labels"][m.ROLE_LABEL] == "prefill"]
    r = httpx.post(f"http://{prefill['status']['podIP']}:{m.HTTP_PORT}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# ---- CRD upgrades ---------------------------------------------------------------------------


def _crd_properties(kube: Kube) -> dict[str, Any]:
    got = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
    props: dict[str, Any] = got["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    return props


def test_helm_upgrade_updates_the_crd_once_managed(helm: Helm, cluster: LocalCluster, kube: Kube,
                                                   tmp_path: Path) -> None:
    release, release_ns = "crdtest", f"crdtest-{uuid.uuid4().hex[:6]}"
    create_namespace(kube, release_ns)
    chart = tmp_path / "disagg"
    shutil.copytree(CHART, chart)
    admin = cluster.admin_kubeconfig
    # No operator pod: this test is about the CRD, and one would reconcile other tests' clusters.
    helm("install", release, str(chart), "--namespace", release_ns, "--set", "operator.replicas=0", kubeconfig=admin)
    wait_until(lambda: _established(kube, CRD_NAME) or None, 30, "the DisaggCluster CRD")

    # A new version of the chart whose CRD has one more (optional) spec field.
    crd_file = chart / "crds" / "disagg.dev_disaggclusters.yaml"
    changed = yaml.safe_load(crd_file.read_text())
    spec_schema = changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["properties"]["upgradeProbe"] = {"type": "string", "description": "Added by the upgrade test."}
    crd_file.write_text(yaml.safe_dump(changed, sort_keys=False))
    try:
        # Helm's rule: crds/ is installed once and never upgraded.
        helm("upgrade", release, str(chart), "--namespace", release_ns, "--reuse-values", kubeconfig=admin)
        assert "upgradeProbe" not in _crd_properties(kube)
        # The chart's way: render the CRD as a template; Helm adopts it once.
        helm("upgrade", release, str(chart), "--namespace", release_ns, "--reuse-values", "--set", "crds.manage=true",
             "--take-ownership", kubeconfig=admin)
        assert _crd_properties(kube)["upgradeProbe"]["type"] == "string"
        got = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
        assert got["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
        # The objects of the new field are accepted (the server uses the new schema).
        dc = cluster_body("probe", "m")
        dc["spec"]["upgradeProbe"] = "yes"
        assert kube.post(clusters_path(release_ns), dc)["spec"]["upgradeProbe"] == "yes"
        kube.delete(clusters_path(release_ns, "probe"))
        # Uninstall keeps the CRD (deleting it would delete every DisaggCluster).
        helm("uninstall", release, "--namespace", release_ns, kubeconfig=admin)
        assert _established(kube, CRD_NAME)
    finally:
        # Back to the project's CRD for the other tests of this session.
        kube.request("PUT", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}",
                     {**crd.crd(), "metadata": {**crd.crd()["metadata"], "resourceVersion": kube.get(
                         f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")["metadata"][
                         "resourceVersion"]}})
        kube.delete(f"/api/v1/namespaces/{release_ns}")
