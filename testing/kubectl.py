"""kubectl, the binary hack/k8s-binaries.sh builds, as the e2e tests run it, and our CRDs installed as a user would.

Every call has a timeout; a failed call raises with kubectl's own output.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from disagg.testing.cluster import wait_until
from disagg.testing.rest import Kube

KUBECTL_TIMEOUT_S = 60.0
CRD_ESTABLISHED_S = 30.0


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


def install_crd(kube: Kube, body: dict[str, Any]) -> None:
    """Create a CRD (one that exists is kept) and wait until the API server serves it."""
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

    wait_until(established, CRD_ESTABLISHED_S, f"the {name} CRD to be established")
