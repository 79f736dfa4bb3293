"""What a user does with kubectl, against the test control plane: apply the
CPU example, read it back (printer columns, defaults), explain the schema,
scale a role, and check the InferencePool example against the real
InferencePool CRD by a server-side dry run.

kubectl is the binary hack/k8s-binaries.sh builds; no operator runs here (the
operator's side is tests/e2e/test_operator.py and `make demo-k8s`).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from disagg.operator import crd
from disagg.testing.binaries import find_binaries
from disagg.testing.cluster import LocalCluster, wait_until
from disagg.testing.gateway_crds import CrdUnavailable, inference_pool_crd
from disagg.testing.rest import Kube

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"
KUBECTL_TIMEOUT_S = 60.0


class Kubectl:
    def __init__(self, binary: Path, kubeconfig: Path) -> None:
        self.binary, self.kubeconfig = binary, kubeconfig

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(self.binary), "--kubeconfig", str(self.kubeconfig), *args], capture_output=True,
                              text=True, timeout=KUBECTL_TIMEOUT_S, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited with {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def json(self, *args: str) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(self(*args, "-o", "json").stdout)
        return answer


def _install_crd(kube: Kube, body: dict[str, Any]) -> None:
    name = body["metadata"]["name"]
    try:
        kube.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body)
    except ApiException as e:
        if e.status != 409:
            raise

    def established() -> bool:
        got = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (got.get("status") or {}).get("conditions") or [])

    wait_until(established, 30, f"the {name} CRD to be established")


@pytest.fixture(scope="module")
def kubectl(cluster: LocalCluster, kube: Kube) -> Iterator[Kubectl]:
    binary = find_binaries().kubectl
    if binary is None:
        pytest.fail("hack/k8s-binaries.sh built no kubectl", pytrace=False)
    _install_crd(kube, crd.crd())
    yield Kubectl(binary, cluster.admin_kubeconfig)


def test_apply_get_and_apply_again(kubectl: Kubectl, namespace: str) -> None:
    example = str(EXAMPLES / "cpu-disaggcluster.yaml")
    assert "smollm2 created" in kubectl("apply", "-n", namespace, "-f", example).stdout
    # Applying the same file again is a no-op, as users expect of a declarative file.
    assert "smollm2 unchanged" in kubectl("apply", "-n", namespace, "-f", example).stdout
    table = kubectl("get", "dc", "-n", namespace).stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "PREFILL", "DECODE", "LINKS", "AVAILABLE"], table
    assert table[1].split()[0] == "smollm2"
    got = kubectl.json("get", "disaggcluster", "smollm2", "-n", namespace)
    assert got["spec"]["model"]["servedName"] == "smollm2"
    assert got["spec"]["prefill"]["replicas"] == 1


def test_explain_shows_the_schema(kubectl: Kubectl) -> None:
    out = kubectl("explain", "dc.spec").stdout
    assert "KIND:       DisaggCluster" in out or "KIND:     DisaggCluster" in out, out
    for field in ("model", "prefill", "decode", "engine", "kvTransfer"):
        assert f"\n  {field}\t" in out, f"{field} missing:\n{out}"
    assert "decode replicas" in kubectl("explain", "dc.spec.decode.replicas").stdout.lower() or \
        "replicas" in kubectl("explain", "dc.spec.decode.replicas").stdout


def test_scale_a_role(kubectl: Kubectl, namespace: str) -> None:
    kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "cpu-disaggcluster.yaml"))
    before = kubectl.json("get", "dc", "smollm2", "-n", namespace)["metadata"]["generation"]
    # A DisaggCluster has two replica counts, so it scales by role with a patch
    # (`kubectl scale` needs one count per object, a scale subresource).
    kubectl("patch", "dc", "smollm2", "-n", namespace, "--type", "merge", "-p",
            json.dumps({"spec": {"decode": {"replicas": 3}}}))
    got = kubectl.json("get", "dc", "smollm2", "-n", namespace)
    assert got["spec"]["decode"]["replicas"] == 3 and got["spec"]["prefill"]["replicas"] == 1
    assert got["metadata"]["generation"] == before + 1
    refused = kubectl("patch", "dc", "smollm2", "-n", namespace, "--type", "merge", "-p",
                      json.dumps({"spec": {"decode": {"replicas": -1}}}), check=False)
    assert refused.returncode != 0 and "replicas" in refused.stderr, refused.stderr


def test_inference_pool_example_passes_a_server_side_dry_run(kubectl: Kubectl, kube: Kube, namespace: str,
                                                              tmp_path: Path) -> None:
    try:
        pool_crd = inference_pool_crd()
    except CrdUnavailable as e:
        pytest.fail(f"the InferencePool CRD is not available: {e}", pytrace=False)
    _install_crd(kube, pool_crd)
    example = EXAMPLES / "inferencepool.yaml"
    out = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example), "-o", "json").stdout
    pool = json.loads(out)
    assert pool["spec"]["selector"]["matchLabels"] == {"disagg.dev/cluster": "smollm2", "disagg.dev/role": "prefill"}
    # The pool selects exactly the pods the operator labels as the example's prefills.
    dc = yaml.safe_load((EXAMPLES / "cpu-disaggcluster.yaml").read_text())
    assert pool["spec"]["selector"]["matchLabels"]["disagg.dev/cluster"] == dc["metadata"]["name"]
    assert pool["spec"]["targetPorts"] == [{"number": dc["spec"]["service"]["port"]}]
    # The real schema is in force: a pool without its endpoint picker is refused.
    broken = yaml.safe_load(example.read_text())
    del broken["spec"]["endpointPickerRef"]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    refused = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path), check=False)
    assert refused.returncode != 0 and "endpointPickerRef" in refused.stderr, refused.stderr
