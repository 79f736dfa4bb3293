"""The controller's autoscaler step without a cluster: where a fresh controller starts from, and that
its decision already holds the ratio band (what it reports is what the pass does)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, cast

import httpx
import kopf
import pytest

from disagg.operator.controller import ClusterController, Deps
from disagg.operator.kube import KubeApi, NotOurs
from disagg.operator.link_client import LinkClient
from disagg.operator.metrics import OperatorMetrics
from disagg.operator.scaling import parse_scaling
from disagg.operator.settings import OperatorSettings
from disagg.operator.spec import ClusterSpec

AUTOSCALER = {"prefill": {"minReplicas": 1, "maxReplicas": 10}, "decode": {"minReplicas": 1, "maxReplicas": 10},
              "targets": {"ttftP90Ms": 500, "tpotP90Ms": 50}}


class Roles:
    """The two DisaggRoles as the API server holds them (all the step reads)."""

    def __init__(self, replicas: Mapping[str, int], controller_uid: str) -> None:
        self.replicas = replicas
        self.controller_uid = controller_uid

    async def read_object(self, namespace: str, plural: str, name: str) -> dict[str, Any] | None:
        role = name.removeprefix("llm-")
        return {"metadata": {"name": name, "generation": 3, "ownerReferences": [{"uid": self.controller_uid, "controller": True}]},
                "spec": {"replicas": self.replicas[role]}}


async def _autoscaled_pass(body: dict[str, Any], spec: ClusterSpec, roles: Mapping[str, int],
                           roles_controller: str = "uid-1") -> tuple[ClusterController, list[str]]:
    """A fresh controller's autoscaler step (no pods: no metrics yet); the controller and its Events."""
    events: list[str] = []
    async with httpx.AsyncClient() as http:
        deps = Deps(OperatorSettings(), cast(KubeApi, Roles(roles, roles_controller)), LinkClient(timeout_s=1.0), http,
                    OperatorMetrics(), post_event=lambda _b, _k, reason, message: events.append(f"{reason}: {message}"))
        controller = ClusterController("ns", "llm", deps)
        await controller._autoscale(kopf.Body(cast(kopf.RawBody, body)), spec, [],
                                    {"prefill": False, "decode": False})
        await deps.links.close()
    return controller, events


def _autoscaled(spec: ClusterSpec, **scaling: Any) -> ClusterSpec:
    """`spec` (1 prefill, 1 decode) with the built-in autoscaler."""
    return replace(spec, scaling=parse_scaling({"autoscaler": AUTOSCALER, **scaling}))


async def test_a_fresh_controller_starts_from_the_roles_own_size_not_the_clusters(
        spec: ClusterSpec, owner: Callable[..., dict[str, Any]]) -> None:
    """A restarted operator: the roles run 2 and 6 pods (the autoscaler's last counts), the
    cluster's spec still says 1 and 1. Without metrics yet it holds them, instead of shrinking
    the roles to 1 at once, past the scale-down window."""
    body = {**owner(), "status": {"scaling": {"decode": {"owner": "autoscaler", "lastScaleTime": "2026-12-01T10:00:00Z"}}}}
    controller, events = await _autoscaled_pass(body, _autoscaled(spec), {"prefill": 2, "decode": 6})
    assert controller.recommended == {"prefill": 2, "decode": 6}
    assert not [e for e in events if e.startswith("AutoscalerScaled")]
    assert controller.scaler is not None  # and it keeps the last scale its predecessor reported
    assert controller.scaler.role_status("decode")["lastScaleTime"] == "2026-12-01T10:00:00Z"


async def test_the_decision_holds_the_ratio_band(spec: ClusterSpec, owner: Callable[..., dict[str, Any]]) -> None:
    """P:D 2:6 under a band of at least 1 prefill per 2 decodes: the autoscaler's own decision
    grows prefill to 3 and says so, as the pass will do."""
    band = {"minPrefillPerDecode": "0.5", "maxPrefillPerDecode": "2"}
    controller, events = await _autoscaled_pass(owner(), _autoscaled(spec, ratio=band), {"prefill": 2, "decode": 6})
    assert controller.recommended == {"prefill": 3, "decode": 6}
    assert any(e.startswith("AutoscalerScaled: prefill: 2 -> 3") and "ratio band" in e for e in events), events


async def test_a_disaggrole_another_owner_controls_is_not_read_as_the_roles(
        spec: ClusterSpec, owner: Callable[..., dict[str, Any]]) -> None:
    """A DisaggRole of the derived name that this cluster does not control: reported, not used."""
    with pytest.raises(NotOurs, match="DisaggRole llm-prefill exists and is not this DisaggCluster's"):
        await _autoscaled_pass(owner(), _autoscaled(spec), {"prefill": 2, "decode": 6}, roles_controller="uid-other")
