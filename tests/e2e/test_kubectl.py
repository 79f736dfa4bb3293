"""What a user does with kubectl, against the test control plane: apply the
CPU example, read it back (printer columns, defaults), explain the schema,
scale a role, and check the InferencePool example against the real
InferencePool CRD by a server-side dry run.

kubectl is the binary hack/k8s-binaries.sh builds; no operator runs here (the
operator's side is tests/e2e/test_operator.py and `make demo-k8s`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from disagg.testing.gateway_crds import CrdUnavailable, inference_pool_crd
from disagg.testing.kubectl import Kubectl, install_crd
from disagg.testing.rest import Kube

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"


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
    install_crd(kube, pool_crd)
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
