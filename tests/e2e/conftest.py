"""The e2e folder's fixtures: API clients and kubectl against the session's control plane with our
CRDs installed, and the operator as its own process."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from disagg.operator import crd
from disagg.testing.binaries import find_binaries
from disagg.testing.cluster import LocalCluster
from disagg.testing.kubectl import Kubectl, install_crd
from disagg.testing.operator_process import OperatorProcess
from disagg.testing.rest import Kube
from disagg.testing.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> Iterator[client.ApiClient]:
    with config.new_client_from_config(config_file=str(cluster.admin_kubeconfig)) as c:
        yield c


@pytest.fixture(scope="module")
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture(scope="module")
def custom(api: client.ApiClient, kube: Kube) -> client.CustomObjectsApi:
    """Our CRDs (DisaggCluster, DisaggRole), installed from the committed manifests' source, and established."""
    for build in crd.FILES.values():
        install_crd(kube, build())
    return client.CustomObjectsApi(api)


@pytest.fixture(scope="module")
def kubectl(cluster: LocalCluster, custom: client.CustomObjectsApi) -> Kubectl:
    binary = find_binaries().kubectl
    if binary is None:
        pytest.fail("hack/k8s-binaries.sh built no kubectl", pytrace=False)
    return Kubectl(binary, cluster.admin_kubeconfig)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def worker_path() -> Iterator[None]:
    """The kubelet runs `disagg` from PATH: put this virtualenv's bin first."""
    before = os.environ["PATH"]
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{before}"
    yield
    os.environ["PATH"] = before


@pytest.fixture
def operator(cluster: LocalCluster, custom: client.CustomObjectsApi, worker_path: None,
             tmp_path: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster.admin_kubeconfig, tmp_path / "operator.log")
    op.start()
    yield op
    if op.proc is not None:
        op.stop()
    sys.stderr.write(op.log.read_text(errors="replace")[-4000:])
