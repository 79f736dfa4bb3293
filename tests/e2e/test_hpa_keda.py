"""A standard HorizontalPodAutoscaler, run by the real kube-controller-manager, scales a DisaggRole
through its /scale subresource on a metric served by a real adapter: KEDA (operator and metrics
adapter, built from its Go module), whose ScaledObject reads a worker series from the prefill's
/metrics. Under real load the HPA grows the decode role to 2 (the operator makes the pod, linked
and gated); once the load stops it shrinks it back to 1 through a drain; no request fails.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from disagg.operator import crd
from disagg.operator import manifests as m
from disagg.testing.binaries import BinariesError
from disagg.testing.cluster import LocalCluster, wait_until
from disagg.testing.elastic import (
    CLUSTER,
    event_reasons,
    external_decode_cluster,
    load_until_second_decode,
    settled,
)
from disagg.testing.keda import Keda, find_keda
from disagg.testing.kubectl import Kubectl
from disagg.testing.kubelet import LocalKubelet
from disagg.testing.operator_process import OperatorProcess
from disagg.testing.rest import Kube

pytestmark = pytest.mark.e2e

WAIT_S = 180.0
KEDA_BUILD_WAIT_S = 300.0
SCALED_OBJECT = f"{CLUSTER}-decode"
# KEDA names the HPA it makes for a ScaledObject keda-hpa-<name>.
HPA = f"keda-hpa-{SCALED_OBJECT}"


@pytest.fixture(scope="module")
def keda(cluster: LocalCluster, kube: Kube, routable_kubelet: LocalKubelet,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keda]:
    try:
        # `make test` builds them first; a cold build here would run past the test's time limit.
        binaries = find_keda(build_timeout_s=KEDA_BUILD_WAIT_S)
    except BinariesError as e:
        pytest.skip(f"KEDA's binaries cannot be built here: {e}")
    part = Keda(binaries, kube, cluster.admin_kubeconfig, routable_kubelet.take_address(),
                tmp_path_factory.mktemp("keda"))
    try:
        with part:
            yield part
    finally:
        for log in part.logs:
            sys.stderr.write(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}\n")


def _scaled_object(prefill_ip: str) -> dict[str, Any]:
    """Decode follows the prefill's running requests: one per decode pod is the target, so three
    concurrent streams ask for the maximum, 2, and none for the minimum, 1."""
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": SCALED_OBJECT},
            "spec": {"scaleTargetRef": {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": "DisaggRole",
                                        "name": f"{CLUSTER}-decode"},
                     "pollingInterval": 2, "minReplicaCount": 1, "maxReplicaCount": 2,
                     "triggers": [{"type": "metrics-api", "metricType": "AverageValue", "metadata": {
                         "url": f"http://{prefill_ip}:{m.HTTP_PORT}/metrics", "format": "prometheus",
                         "valueLocation": "disagg_requests_running", "targetValue": "1"}}]}}


def _has_hpa(kubectl: Kubectl, namespace: str) -> bool:
    return bool(kubectl("get", "hpa", HPA, "-n", namespace, "--ignore-not-found", "-o", "name").stdout.strip())


def _active_hpa(kubectl: Kubectl, namespace: str) -> dict[str, Any] | None:
    """KEDA's HPA once the HPA controller has read its metric (ScalingActive), else None."""
    if not _has_hpa(kubectl, namespace):
        return None
    hpa = kubectl.json("get", "hpa", HPA, "-n", namespace)
    conditions = {c["type"]: c["status"] for c in (hpa.get("status") or {}).get("conditions") or []}
    return hpa if conditions.get("ScalingActive") == "True" else None


def test_an_hpa_scales_a_disagg_role_through_scale_on_keda_metrics(
        keda: Keda, operator: OperatorProcess, custom: client.CustomObjectsApi, kubectl: Kubectl,
        namespace: str, tiny_model: Path) -> None:
    custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL,
                                           external_decode_cluster(tiny_model), _request_timeout=10)
    wait_until(lambda: settled(kubectl, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    (prefill,) = kubectl.json("get", "pods", "-n", namespace, "-l",
                              f"{m.CLUSTER_LABEL}={CLUSTER},{m.ROLE_LABEL}=prefill")["items"]
    ip = prefill["status"]["podIP"]
    custom.create_namespaced_custom_object("keda.sh", "v1alpha1", namespace, "scaledobjects", _scaled_object(ip),
                                           _request_timeout=10)
    try:
        # KEDA made a standard HPA for the DisaggRole, and the HPA reads its metric through the adapter.
        hpa = wait_until(lambda: _active_hpa(kubectl, namespace), WAIT_S, "KEDA's HPA, its metric readable")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": "DisaggRole",
                                                 "name": f"{CLUSTER}-decode"}, hpa["spec"]
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 2)
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External", metric
        assert settled(kubectl, namespace, 1, 1), "idle: the HPA keeps one decode"

        def through_scale() -> None:
            # The count came through /scale from kube-controller-manager (the HPA controller), not from us.
            role = kubectl.json("get", "dr", f"{CLUSTER}-decode", "-n", namespace, "--show-managed-fields")
            writers = {(f["manager"], f.get("subresource", "")) for f in role["metadata"]["managedFields"]}
            assert any(manager.startswith("kube-controller-manager") and sub == "scale"
                       for manager, sub in writers), writers
            assert role["spec"]["replicas"] == 2

        load_until_second_decode(kubectl, namespace, ip, through_scale, WAIT_S)

        # The load stopped: after the HPA's scale-down window, back to one decode through a drain.
        wait_until(lambda: settled(kubectl, namespace, 1, 1), WAIT_S, "back to one decode")
        reasons = event_reasons(kubectl, namespace)
        assert "Drained" in reasons and reasons.count("SuccessfulRescale") >= 2, reasons
        assert kubectl.json("get", "hpa", HPA, "-n", namespace)["status"]["desiredReplicas"] == 1
    finally:
        custom.delete_namespaced_custom_object("keda.sh", "v1alpha1", namespace, "scaledobjects", SCALED_OBJECT,
                                               _request_timeout=10)
        # KEDA's finalizer goes with its HPA; gone before the namespace and KEDA itself go.
        wait_until(lambda: not _has_hpa(kubectl, namespace) and not kubectl(
            "get", "scaledobjects", "-n", namespace, "-o", "name").stdout.strip(), 60.0, "the ScaledObject deleted")

