"""The e2e folder's fixtures: kubectl against the session's control plane, with our CRDs installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from disagg.operator import crd
from disagg.testing.binaries import find_binaries
from disagg.testing.cluster import LocalCluster
from disagg.testing.kubectl import Kubectl, install_crd
from disagg.testing.rest import Kube


@pytest.fixture(scope="module")
def kubectl(cluster: LocalCluster, kube: Kube) -> Iterator[Kubectl]:
    binary = find_binaries().kubectl
    if binary is None:
        pytest.fail("hack/k8s-binaries.sh built no kubectl", pytrace=False)
    for build in crd.FILES.values():
        install_crd(kube, build())
    yield Kubectl(binary, cluster.admin_kubeconfig)
