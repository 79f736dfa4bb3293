"""DisaggRole on the real control plane, with the operator process and real workers: the children
exist, owned by their cluster; `kubectl scale` through the API server's /scale scales an external
role (pods made, linked, gated; a scale-down drains) and is set back on a static one; the P:D
ratio band clamps the owners' counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from disagg.operator import crd
from disagg.operator import manifests as m
from disagg.testing.cluster import wait_until
from disagg.testing.elastic import (
    ChatLoad,
    event_reasons,
    external_decode_cluster,
    load_until_second_decode,
    serving,
    settled,
)
from disagg.testing.kubectl import Kubectl
from disagg.testing.operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

WAIT_S = 180.0


def test_roles_scale_through_their_scale_subresource(operator: OperatorProcess, custom: client.CustomObjectsApi,
                                                     kubectl: Kubectl, namespace: str, tiny_model: Path) -> None:
    created = custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL,
                                                     external_decode_cluster(tiny_model), _request_timeout=10)

    def children() -> list[dict[str, Any]] | None:
        found = kubectl.json("get", "dr", "-n", namespace)["items"]
        return found if len(found) == 2 and all((c.get("status") or {}).get("selector") for c in found) else None

    for child in wait_until(children, WAIT_S, "the two DisaggRoles with their status"):
        role = child["metadata"]["name"].removeprefix("llm-")
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (crd.KIND, created["metadata"]["uid"], True)
        assert child["status"]["selector"] == f"{m.CLUSTER_LABEL}=llm,{m.ROLE_LABEL}={role}"
        assert child["status"]["owner"] == ("external" if role == "decode" else "static")
    wait_until(lambda: settled(kubectl, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    status = kubectl.json("get", "dc", "llm", "-n", namespace)["status"]
    assert status["scaling"] == {"prefill": {"owner": "static", "desired": 1},
                                 "decode": {"owner": "external", "desired": 1}, "ratio": ""}

    # What an HPA reads: the scale subresource, with the pods' selector.
    scale = kubectl.json("get", "dr", "llm-decode", "-n", namespace, "--subresource", "scale")
    assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["replicas"]) == ("Scale", 1, 1)
    assert scale["status"]["selector"] == f"{m.CLUSTER_LABEL}=llm,{m.ROLE_LABEL}=decode"

    # An external role: kubectl scale (through /scale) makes the pod, linked and gated.
    kubectl("scale", "dr/llm-decode", "--replicas", "2", "-n", namespace)
    wait_until(lambda: settled(kubectl, namespace, 1, 2), WAIT_S, "two decodes, linked and gated")
    assert kubectl.json("get", "dc", "llm", "-n", namespace)["spec"]["decode"]["replicas"] == 1, "left as it was"
    table = kubectl("get", "dr", "-n", namespace).stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "OWNER", "DESIRED", "REPLICAS", "READY"], table
    assert table[1].split()[:5] == ["llm-decode", "external", "2", "2", "2"], table

    # A static role: the operator sets the child back, and says so; no pod is made.
    kubectl("scale", "dr/llm-prefill", "--replicas", "3", "-n", namespace)
    wait_until(lambda: "ScaleOverridden" in event_reasons(kubectl, namespace) or None, WAIT_S,
               "the ScaleOverridden Event")
    wait_until(lambda: kubectl.json("get", "dr", "llm-prefill", "-n", namespace)["spec"]["replicas"] == 1 or None,
               WAIT_S, "the static role's count set back")
    assert len(serving(kubectl, namespace, "prefill")) == 1

    # A scale-down through /scale, under load, drains and unlinks as a manual one does: no request lost.
    before = set(serving(kubectl, namespace, "decode"))
    (prefill,) = kubectl.json("get", "pods", "-n", namespace, "-l",
                              f"{m.CLUSTER_LABEL}=llm,{m.ROLE_LABEL}=prefill")["items"]
    load = ChatLoad(prefill["status"]["podIP"])
    try:
        wait_until(lambda: load.done >= 3 or None, WAIT_S, "requests served before the scale-down")
        kubectl("patch", "dr", "llm-decode", "-n", namespace, "--subresource", "scale", "--type", "merge", "-p",
                json.dumps({"spec": {"replicas": 1}}))
        wait_until(lambda: settled(kubectl, namespace, 1, 1), WAIT_S, "back to one decode")
        served = load.done
        wait_until(lambda: load.done >= served + 3 or None, WAIT_S, "requests served by the decode left")
    finally:
        load.finish()
    assert load.failures == [], load.failures[:3]
    assert len(before - set(serving(kubectl, namespace, "decode"))) == 1
    assert "Drained" in event_reasons(kubectl, namespace)

    # Handing the role back to the cluster's count: static again, at spec.decode.replicas.
    kubectl("patch", "dc", "llm", "-n", namespace, "--type", "merge", "-p",
            json.dumps({"spec": {"decode": {"scaling": "static", "replicas": 2}}}))
    wait_until(lambda: settled(kubectl, namespace, 1, 2), WAIT_S, "two decodes, static")
    assert kubectl.json("get", "dr", "llm-decode", "-n", namespace)["status"]["owner"] == "static"
    assert "ScalingOwnerChanged" in event_reasons(kubectl, namespace)

    # The P:D ratio band clamps whoever's counts: one prefill per decode grows prefill to 2.
    kubectl("patch", "dc", "llm", "-n", namespace, "--type", "merge", "-p",
            json.dumps({"spec": {"scaling": {"ratio": {"minPrefillPerDecode": "1", "maxPrefillPerDecode": "1"}}}}))
    wait_until(lambda: settled(kubectl, namespace, 2, 2), WAIT_S, "two prefills, as the band asks")
    status = kubectl.json("get", "dc", "llm", "-n", namespace)["status"]
    assert "prefill 1->2" in status["scaling"]["ratio"] and status["scaling"]["prefill"]["desired"] == 2
    prefill = kubectl.json("get", "dr", "llm-prefill", "-n", namespace)
    assert (prefill["spec"]["replicas"], prefill["status"]["desired"]) == (1, 2), "the owner's count is kept as asked"
    assert "RatioBand" in event_reasons(kubectl, namespace)
    assert operator.metric("disagg_operator_ratio_band_adjustment_replicas", namespace=namespace, cluster="llm",
                           role="prefill") == 1


def _autoscaled(model: Path) -> dict[str, Any]:
    """The decode role on the built-in autoscaler: one sequence per pod is its capacity, so a few
    concurrent streams ask for a second pod; once they stop, 8 s of quiet take it away again."""
    body = external_decode_cluster(model)
    body["spec"]["decode"] = {"replicas": 1}
    body["spec"]["scaling"] = {"autoscaler": {
        "prefill": {"minReplicas": 1, "maxReplicas": 1},
        "decode": {"minReplicas": 1, "maxReplicas": 2, "sequencesPerPod": 1},
        "targets": {"ttftP90Ms": 600000, "tpotP90Ms": 60000},
        "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 8, "maxStep": 1,
        "metricsMaxAgeSeconds": 30}}
    return body


def test_the_builtin_autoscaler_scales_on_real_load_and_back_through_drain(
        operator: OperatorProcess, custom: client.CustomObjectsApi, kubectl: Kubectl, namespace: str,
        tiny_model: Path) -> None:
    custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, _autoscaled(tiny_model),
                                           _request_timeout=10)
    # Before any pod serves there is nothing to read: it holds, and says why.
    wait_until(lambda: "AutoscalerHolding" in event_reasons(kubectl, namespace) or None, WAIT_S,
               "the autoscaler saying it holds on missing metrics")
    wait_until(lambda: settled(kubectl, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    status = kubectl.json("get", "dc", "llm", "-n", namespace)["status"]
    assert status["scaling"]["decode"]["owner"] == "autoscaler"
    assert {c["type"]: c["status"] for c in status["conditions"]}.get("MetricsAvailable") is not None

    (prefill,) = kubectl.json("get", "pods", "-n", namespace, "-l",
                              f"{m.CLUSTER_LABEL}=llm,{m.ROLE_LABEL}=prefill")["items"]
    def scaled_up() -> None:
        decode = kubectl.json("get", "dc", "llm", "-n", namespace)["status"]["scaling"]["decode"]
        assert (decode["outcome"], decode["desired"]) in (("scale-up", 2), ("hold", 2)), decode
        assert decode["lastScaleTime"], decode

    load_until_second_decode(kubectl, namespace, prefill["status"]["podIP"], scaled_up, WAIT_S)

    # The load stopped: after the scale-down window, back to one decode through a drain.
    wait_until(lambda: settled(kubectl, namespace, 1, 1), WAIT_S, "back to one decode")
    reasons = event_reasons(kubectl, namespace)
    assert "Drained" in reasons and reasons.count("AutoscalerScaled") >= 2, reasons
    assert operator.metric("disagg_operator_autoscaler_desired_replicas", namespace=namespace, cluster="llm",
                           role="decode") == 1
    assert operator.metric("disagg_operator_autoscaler_decisions_total", namespace=namespace, cluster="llm",
                           role="decode", outcome="scale-up", hold="none") >= 1


def test_a_scaling_spec_the_schema_cannot_refuse_is_reported_not_crash_looped(
        operator: OperatorProcess, custom: client.CustomObjectsApi, kubectl: Kubectl, namespace: str,
        tiny_model: Path) -> None:
    """A ratio band no counts within the autoscaler's bounds satisfy passes the schema: the operator
    says so (condition and one Event) and acts on nothing, keeps running, and takes the fixed spec."""
    body = _autoscaled(tiny_model)
    body["spec"]["scaling"]["ratio"] = {"minPrefillPerDecode": "3", "maxPrefillPerDecode": "4"}
    custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, body, _request_timeout=10)

    def invalid() -> dict[str, Any] | None:
        conditions = (kubectl.json("get", "dc", "llm", "-n", namespace).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "SpecValid" and c["status"] == "False"), None)

    condition = wait_until(invalid, WAIT_S, "the SpecValid condition")
    assert "spec.scaling.ratio: no counts satisfy the band" in condition["message"], condition
    assert event_reasons(kubectl, namespace).count("InvalidSpec") == 1
    assert not kubectl.json("get", "pods", "-n", namespace)["items"], "nothing is made from an invalid spec"
    assert operator.proc is not None and operator.proc.poll() is None, "the operator keeps running"

    kubectl("patch", "dc", "llm", "-n", namespace, "--type", "merge", "-p", json.dumps(
        {"spec": {"scaling": {"ratio": None}}}))
    wait_until(lambda: settled(kubectl, namespace, 1, 1), WAIT_S, "the fixed spec served")
    assert invalid() is None
