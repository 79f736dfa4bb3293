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
from disagg.testing.kubectl import Kubectl
from disagg.testing.operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

WAIT_S = 180.0


def _cluster(model: Path) -> dict[str, Any]:
    """One prefill (static) and one decode (external), on the tiny model."""
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": "llm"},
            "spec": {"model": {"source": str(model)}, "image": "local",
                     "prefill": {"replicas": 1}, "decode": {"replicas": 1, "scaling": "external"},
                     "engine": {"device": "cpu", "dtype": "float32", "blockSize": 4, "numKvBlocks": 128,
                                "maxNumSeqs": 4},
                     "drain": {"timeoutSeconds": 20}}}


def _serving(kubectl: Kubectl, namespace: str, role: str) -> list[str]:
    """The role's pods that are not going away, if every one of them is Ready and gated in; else []."""
    found = kubectl.json("get", "pods", "-n", namespace, "-l", f"{m.CLUSTER_LABEL}=llm,{m.ROLE_LABEL}={role}")
    live = [p for p in found["items"] if not p["metadata"].get("deletionTimestamp")]
    conditions = [{c["type"]: c["status"] for c in p["status"].get("conditions") or []} for p in live]
    if not all(c.get("Ready") == "True" and c.get(m.LINKED_GATE) == "True" for c in conditions):
        return []
    return [p["metadata"]["name"] for p in live]


def _settled(kubectl: Kubectl, namespace: str, prefill: int, decode: int) -> bool:
    status = kubectl.json("get", "dc", "llm", "-n", namespace).get("status") or {}
    serving = {role: len(_serving(kubectl, namespace, role)) for role in ("prefill", "decode")}
    return (serving == {"prefill": prefill, "decode": decode}
            and status.get("links", {}).get("established") == prefill * decode
            and status.get("decodeReady") == f"{decode}/{decode}")


def _reasons(kubectl: Kubectl, namespace: str) -> list[str]:
    return [e["reason"] for e in kubectl.json("get", "events", "-n", namespace)["items"]]


def test_roles_scale_through_their_scale_subresource(operator: OperatorProcess, custom: client.CustomObjectsApi,
                                                     kubectl: Kubectl, namespace: str, tiny_model: Path) -> None:
    created = custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL,
                                                     _cluster(tiny_model), _request_timeout=10)

    def children() -> list[dict[str, Any]] | None:
        found = kubectl.json("get", "dr", "-n", namespace)["items"]
        return found if len(found) == 2 and all((c.get("status") or {}).get("selector") for c in found) else None

    for child in wait_until(children, WAIT_S, "the two DisaggRoles with their status"):
        role = child["metadata"]["name"].removeprefix("llm-")
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (crd.KIND, created["metadata"]["uid"], True)
        assert child["status"]["selector"] == f"{m.CLUSTER_LABEL}=llm,{m.ROLE_LABEL}={role}"
        assert child["status"]["owner"] == ("external" if role == "decode" else "static")
    wait_until(lambda: _settled(kubectl, namespace, 1, 1), WAIT_S, "one prefill and one decode, linked")
    status = kubectl.json("get", "dc", "llm", "-n", namespace)["status"]
    assert status["scaling"] == {"prefill": {"owner": "static", "desired": 1},
                                 "decode": {"owner": "external", "desired": 1}, "ratio": ""}

    # What an HPA reads: the scale subresource, with the pods' selector.
    scale = kubectl.json("get", "dr", "llm-decode", "-n", namespace, "--subresource", "scale")
    assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["replicas"]) == ("Scale", 1, 1)
    assert scale["status"]["selector"] == f"{m.CLUSTER_LABEL}=llm,{m.ROLE_LABEL}=decode"

    # An external role: kubectl scale (through /scale) makes the pod, linked and gated.
    kubectl("scale", "dr/llm-decode", "--replicas", "2", "-n", namespace)
    wait_until(lambda: _settled(kubectl, namespace, 1, 2), WAIT_S, "two decodes, linked and gated")
    assert kubectl.json("get", "dc", "llm", "-n", namespace)["spec"]["decode"]["replicas"] == 1, "left as it was"
    table = kubectl("get", "dr", "-n", namespace).stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "OWNER", "DESIRED", "REPLICAS", "READY"], table
    assert table[1].split()[:5] == ["llm-decode", "external", "2", "2", "2"], table

    # A static role: the operator sets the child back, and says so; no pod is made.
    kubectl("scale", "dr/llm-prefill", "--replicas", "3", "-n", namespace)
    wait_until(lambda: "ScaleOverridden" in _reasons(kubectl, namespace) or None, WAIT_S, "the ScaleOverridden Event")
    wait_until(lambda: kubectl.json("get", "dr", "llm-prefill", "-n", namespace)["spec"]["replicas"] == 1 or None,
               WAIT_S, "the static role's count set back")
    assert len(_serving(kubectl, namespace, "prefill")) == 1

    # A scale-down through /scale drains and unlinks, as a manual one does.
    before = set(_serving(kubectl, namespace, "decode"))
    kubectl("patch", "dr", "llm-decode", "-n", namespace, "--subresource", "scale", "--type", "merge", "-p",
            json.dumps({"spec": {"replicas": 1}}))
    wait_until(lambda: _settled(kubectl, namespace, 1, 1), WAIT_S, "back to one decode")
    assert len(before - set(_serving(kubectl, namespace, "decode"))) == 1
    assert "Drained" in _reasons(kubectl, namespace)

    # Handing the role back to the cluster's count: static again, at spec.decode.replicas.
    kubectl("patch", "dc", "llm", "-n", namespace, "--type", "merge", "-p",
            json.dumps({"spec": {"decode": {"scaling": "static", "replicas": 2}}}))
    wait_until(lambda: _settled(kubectl, namespace, 1, 2), WAIT_S, "two decodes, static")
    assert kubectl.json("get", "dr", "llm-decode", "-n", namespace)["status"]["owner"] == "static"
    assert "ScalingOwnerChanged" in _reasons(kubectl, namespace)

    # The P:D ratio band clamps whoever's counts: one prefill per decode grows prefill to 2.
    kubectl("patch", "dc", "llm", "-n", namespace, "--type", "merge", "-p",
            json.dumps({"spec": {"scaling": {"ratio": {"minPrefillPerDecode": "1", "maxPrefillPerDecode": "1"}}}}))
    wait_until(lambda: _settled(kubectl, namespace, 2, 2), WAIT_S, "two prefills, as the band asks")
    status = kubectl.json("get", "dc", "llm", "-n", namespace)["status"]
    assert "prefill 1->2" in status["scaling"]["ratio"] and status["scaling"]["prefill"]["desired"] == 2
    prefill = kubectl.json("get", "dr", "llm-prefill", "-n", namespace)
    assert (prefill["spec"]["replicas"], prefill["status"]["desired"]) == (1, 2), "the owner's count is kept as asked"
    assert "RatioBand" in _reasons(kubectl, namespace)
