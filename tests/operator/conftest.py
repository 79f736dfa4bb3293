"""Shared builders for the operator's offline tests: specs, owners and pod dicts as the API serves them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from disagg.operator import manifests as m
from disagg.operator.spec import ClusterSpec, parse_spec

MODEL = "builtin:smollm2-135m"


def make_spec(prefill: int = 1, decode: int = 1, **engine: Any) -> ClusterSpec:
    return parse_spec({"model": {"source": MODEL}, "prefill": {"replicas": prefill},
                       "decode": {"replicas": decode}, "engine": engine})


def owner(name: str = "llm", namespace: str = "ns", uid: str = "uid-1") -> dict[str, Any]:
    return {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggCluster",
            "metadata": {"name": name, "namespace": namespace, "uid": uid}}


def served_pod(role: str, name: str, ip: str, spec: ClusterSpec, *, ready: bool = True, gate: bool = False,
               restarts: int = 0, deleting: bool = False, draining: str | None = None,
               created: str = "2025-01-01T00:00:00Z", uid: str | None = None) -> dict[str, Any]:
    """A worker pod built by manifests.py, with the status a kubelet would report."""
    pod = m.worker_pod(owner(), role, name, spec)
    meta = pod["metadata"]
    meta.update(uid=uid or f"uid-{name}", creationTimestamp=created)
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:10:00Z"
    if draining:
        meta["annotations"] = {m.DRAINING_ANNOTATION: draining}
    pod["status"] = {
        "phase": "Running", "podIP": ip,
        "conditions": [{"type": "Ready", "status": "True" if ready and gate else "False"},
                       {"type": m.LINKED_GATE, "status": "True" if gate else "False"}],
        "containerStatuses": [{"name": m.CONTAINER, "ready": ready, "restartCount": restarts,
                               "state": {"running": {"startedAt": created}}}],
    }
    return pod


# Test files cannot import this module (pytest's importlib mode): the builders
# reach them as fixtures.


@pytest.fixture
def spec() -> ClusterSpec:
    return make_spec()


@pytest.fixture(name="make_spec")
def make_spec_fixture() -> Callable[..., ClusterSpec]:
    return make_spec


@pytest.fixture(name="owner")
def owner_fixture() -> Callable[..., dict[str, Any]]:
    return owner


@pytest.fixture(name="served_pod")
def served_pod_fixture() -> Callable[..., dict[str, Any]]:
    return served_pod
