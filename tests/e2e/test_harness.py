"""The test harness itself: the real control plane and the local kubelet.

The first tests need no cluster (the kubelet's pure helpers); the rest run
against the session's control plane.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg.testing.cluster import LocalCluster, wait_until
from disagg.testing.podenv import PodConfigError, command_line, container_env, expand
from disagg.testing.probes import Probe, ProbeTracker

GATE = "disagg.dev/linked"
WAIT_S = 60.0


# ---- pure helpers ------------------------------------------------------------


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$$(A)", env) == "$(A)"  # escaped
    assert expand("$(MISSING) $A", env) == "$(MISSING) $A"  # left as written


def test_container_env_resolves_field_refs_and_sources() -> None:
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="p", namespace="ns", uid="u1", labels={"role": "decode"}),
        spec=client.V1PodSpec(node_name="n", containers=[]),
    )
    container = client.V1Container(
        name="c",
        command=["serve", "--host", "$(MY_IP)", "$(GREETING)"],
        env_from=[client.V1EnvFromSource(config_map_ref=client.V1ConfigMapEnvSource(name="cm"), prefix="CM_")],
        env=[
            client.V1EnvVar(name="MY_IP", value_from=client.V1EnvVarSource(
                field_ref=client.V1ObjectFieldSelector(field_path="status.podIP"))),
            client.V1EnvVar(name="NAME", value_from=client.V1EnvVarSource(
                field_ref=client.V1ObjectFieldSelector(field_path="metadata.name"))),
            client.V1EnvVar(name="ROLE", value_from=client.V1EnvVarSource(
                field_ref=client.V1ObjectFieldSelector(field_path="metadata.labels['role']"))),
            client.V1EnvVar(name="GREETING", value="hi-$(NAME)"),
            client.V1EnvVar(name="PASSWORD", value_from=client.V1EnvVarSource(
                secret_key_ref=client.V1SecretKeySelector(name="s", key="pw"))),
        ],
    )
    sources = {("ConfigMap", "cm"): {"x": "1"}, ("Secret", "s"): {"pw": "aHVudGVyMg=="}}
    env = container_env(pod, container, "127.0.0.9", "127.0.0.1",
                        lambda kind, ns, name: sources.get((kind, name)) if ns == "ns" else None)
    assert env == {"CM_x": "1", "MY_IP": "127.0.0.9", "NAME": "p", "ROLE": "decode",
                   "GREETING": "hi-p", "PASSWORD": "hunter2"}
    assert command_line(container, env) == ["serve", "--host", "127.0.0.9", "hi-p"]
    with pytest.raises(PodConfigError, match="not found"):
        container_env(pod, container, "127.0.0.9", "127.0.0.1", lambda kind, ns, name: None)


def test_probe_tracker_applies_thresholds() -> None:
    tracker = ProbeTracker(Probe(kind="tcp", success_threshold=2, failure_threshold=2, period_s=1), started_at=0.0)
    assert tracker.due(0.0)
    assert not tracker.record(True, 0.0) and not tracker.ready  # 1 of 2 successes
    assert tracker.record(True, 1.0) and tracker.ready
    assert not tracker.record(False, 2.0) and tracker.ready  # 1 of 2 failures
    assert tracker.record(False, 3.0) and not tracker.ready
    assert not tracker.due(3.5) and tracker.due(4.0)


# ---- against the control plane ----------------------------------------------


def http_server_pod(name: str, directory: Path, labels: dict[str, str] | None = None,
                    gates: list[str] | None = None, probe_path: str = "/ready.txt") -> dict[str, Any]:
    """A pod serving `directory` with `python -m http.server` on its own address."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "readinessGates": [{"conditionType": g} for g in gates or []],
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "web",
                "image": "python:3.11",  # informational: the kubelet runs the command locally
                "command": [sys.executable, "-m", "http.server", "--bind", "$(MY_IP)", "8080"],
                "workingDir": str(directory),
                "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": probe_path, "port": "http"}, "periodSeconds": 1},
            }],
        },
    }


def command_pod(name: str, command: list[str], restart_policy: str = "Always", grace_s: int = 5) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": grace_s,
            "containers": [{"name": "main", "image": "local", "command": command}],
        },
    }


def condition(pod: client.V1Pod, type_: str) -> str | None:
    for c in pod.status.conditions or []:
        if c.type == type_:
            return str(c.status)
    return None


def read(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod:
    return core.read_namespaced_pod(name, namespace, _request_timeout=10)


def wait_condition(core: client.CoreV1Api, namespace: str, name: str, type_: str, status: str = "True") -> client.V1Pod:
    def check() -> client.V1Pod | None:
        pod = read(core, namespace, name)
        return pod if condition(pod, type_) == status else None

    return wait_until(check, WAIT_S, f"pod {namespace}/{name} condition {type_}={status}")


def wait_gone(core: client.CoreV1Api, namespace: str, name: str) -> None:
    def gone() -> bool:
        try:
            read(core, namespace, name)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        return False

    wait_until(gone, WAIT_S, f"pod {namespace}/{name} to be removed")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.e2e
def test_http_server_pod_becomes_ready_on_its_own_loopback_address(
    core: client.CoreV1Api, namespace: str, tmp_path: Path
) -> None:
    (tmp_path / "ready.txt").write_text("served from the working directory")
    core.create_namespaced_pod(namespace, http_server_pod("web", tmp_path))
    pod = wait_condition(core, namespace, "web", "Ready")
    ip = ipaddress.ip_address(pod.status.pod_ip)
    assert ip in ipaddress.ip_network("127.0.0.0/8") and str(ip) != "127.0.0.1"
    assert pod.spec.node_name and pod.status.phase == "Running"
    status = pod.status.container_statuses[0]
    assert status.ready and status.state.running is not None and status.restart_count == 0
    with urllib.request.urlopen(f"http://{ip}:8080/ready.txt", timeout=5) as r:
        assert r.read() == b"served from the working directory"


@pytest.mark.e2e
def test_readiness_gate_holds_ready_until_its_condition_is_true(
    core: client.CoreV1Api, namespace: str, tmp_path: Path
) -> None:
    (tmp_path / "ready.txt").write_text("ok")
    core.create_namespaced_pod(namespace, http_server_pod("gated", tmp_path, gates=[GATE]))
    pod = wait_condition(core, namespace, "gated", "ContainersReady")
    # The kubelet writes both conditions in one status update.
    assert condition(pod, "Ready") == "False"
    # As the operator will: patch the gate's condition into the pod status.
    core.patch_namespaced_pod_status("gated", namespace, {"status": {"conditions": [
        {"type": GATE, "status": "True", "reason": "Linked"}]}})
    pod = wait_condition(core, namespace, "gated", "Ready")
    assert condition(pod, GATE) == "True"
    core.patch_namespaced_pod_status("gated", namespace, {"status": {"conditions": [
        {"type": GATE, "status": "False", "reason": "Unlinked"}]}})
    wait_condition(core, namespace, "gated", "Ready", "False")


@pytest.mark.e2e
def test_endpoint_slice_lists_only_ready_pods(
    api: client.ApiClient, core: client.CoreV1Api, namespace: str, tmp_path: Path
) -> None:
    (tmp_path / "ready.txt").write_text("ok")
    labels = {"app": "web"}
    core.create_namespaced_pod(namespace, http_server_pod("ready", tmp_path, labels))
    # Same server, but its probe asks for a file that does not exist: never Ready.
    core.create_namespaced_pod(namespace, http_server_pod("unready", tmp_path, labels, probe_path="/absent"))
    core.create_namespaced_service(namespace, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    })
    ready_ip = wait_condition(core, namespace, "ready", "Ready").status.pod_ip
    unready = wait_condition(core, namespace, "unready", "PodScheduled")
    assert condition(unready, "Ready") != "True"
    discovery = client.DiscoveryV1Api(api)

    def slice_endpoints() -> dict[str, bool] | None:
        slices = discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=web", _request_timeout=10).items
        endpoints = {e.target_ref.name: bool(e.conditions.ready) for s in slices for e in s.endpoints or []}
        return endpoints if endpoints.get("ready") else None

    endpoints = wait_until(slice_endpoints, WAIT_S, "an EndpointSlice listing the ready pod")
    assert [name for name, ready in endpoints.items() if ready] == ["ready"]
    slices = discovery.list_namespaced_endpoint_slice(namespace, label_selector="kubernetes.io/service-name=web").items
    assert ready_ip in [a for s in slices for e in s.endpoints or [] if e.conditions.ready for a in e.addresses]


@pytest.mark.e2e
def test_deleting_a_pod_stops_its_process(
    cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    # It ignores SIGTERM after saying so: only the SIGKILL after the grace period ends it.
    stubborn = ("import signal, sys, time\n"
                "def term(*_):\n    print('got SIGTERM', flush=True)\n"
                "signal.signal(signal.SIGTERM, term)\n"
                "print('started', flush=True)\n"
                "while True:\n    time.sleep(1)\n")
    core.create_namespaced_pod(namespace, command_pod("stubborn", [sys.executable, "-c", stubborn], grace_s=2))
    wait_condition(core, namespace, "stubborn", "Ready")
    assert cluster.kubelet is not None
    pid = cluster.kubelet.pod_pid(namespace, "stubborn")
    assert pid is not None and pid_alive(pid)
    log = cluster.kubelet.pod_log(namespace, "stubborn")
    wait_until(lambda: "started" in log.read_text(), WAIT_S, "the process to start")
    core.delete_namespaced_pod("stubborn", namespace)
    wait_gone(core, namespace, "stubborn")
    assert not pid_alive(pid)
    assert "got SIGTERM" in log.read_text()


@pytest.mark.e2e
def test_restart_policy_decides_restarts(core: client.CoreV1Api, namespace: str) -> None:
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    core.create_namespaced_pod(namespace, command_pod("crasher", crash, "Always"))
    core.create_namespaced_pod(namespace, command_pod("once", [sys.executable, "-c", "pass"], "Never"))

    def restarted() -> client.V1ContainerStatus | None:
        statuses = read(core, namespace, "crasher").status.container_statuses or []
        return statuses[0] if statuses and statuses[0].restart_count >= 1 and statuses[0].last_state.terminated else None

    status = wait_until(restarted, WAIT_S, "the crashing container to be restarted")
    assert status.last_state.terminated.exit_code == 3
    done = wait_until(lambda: (p := read(core, namespace, "once")).status.phase == "Succeeded" and p,
                      WAIT_S, "the run-once pod to succeed")
    status = done.status.container_statuses[0]
    assert status.restart_count == 0 and status.state.terminated.exit_code == 0


@pytest.mark.e2e
def test_tens_of_pods_run_on_distinct_addresses(
    cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    names = [f"sleeper-{i}" for i in range(24)]
    for name in names:
        core.create_namespaced_pod(namespace, command_pod(name, ["sleep", "600"], grace_s=1))

    def all_ready() -> list[client.V1Pod] | None:
        pods = core.list_namespaced_pod(namespace, _request_timeout=10).items
        return pods if len(pods) == len(names) and all(condition(p, "Ready") == "True" for p in pods) else None

    pods = wait_until(all_ready, 2 * WAIT_S, f"{len(names)} pods Ready")
    assert len({p.status.pod_ip for p in pods}) == len(names)
    assert cluster.kubelet is not None
    pids = [cluster.kubelet.pod_pid(namespace, n) for n in names]
    assert all(pid is not None and pid_alive(pid) for pid in pids)
    core.delete_collection_namespaced_pod(namespace)
    wait_until(lambda: not core.list_namespaced_pod(namespace).items, 2 * WAIT_S, "all pods removed")
    assert not any(pid_alive(pid) for pid in pids if pid is not None)


@pytest.mark.e2e
def test_garbage_collector_deletes_dependents(core: client.CoreV1Api, namespace: str) -> None:
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "dependent", "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}]}})
    core.delete_namespaced_config_map("owner", namespace)

    def dependent_gone() -> bool:
        return "dependent" not in [c.metadata.name for c in core.list_namespaced_config_map(namespace).items]

    wait_until(dependent_gone, WAIT_S, "the garbage collector to delete the dependent")


@pytest.mark.e2e
def test_invalid_object_is_rejected_by_the_api_server(core: client.CoreV1Api, namespace: str) -> None:
    bad = command_pod("Not_A_DNS_Name", ["true"])
    with pytest.raises(ApiException) as caught:
        core.create_namespaced_pod(namespace, bad)
    assert caught.value.status == 422 and "Not_A_DNS_Name" in caught.value.body
    no_command = command_pod("no-image", ["true"])
    del no_command["spec"]["containers"][0]["image"]
    with pytest.raises(ApiException) as caught:
        core.create_namespaced_pod(namespace, no_command)
    assert caught.value.status == 422 and "image" in caught.value.body


@pytest.mark.e2e
def test_non_admin_identity_is_refused_by_rbac(cluster: LocalCluster, namespace: str) -> None:
    with cluster.api_client(admin=False) as user:
        with pytest.raises(ApiException) as caught:
            client.CoreV1Api(user).list_namespaced_pod(namespace)
    # 403, not 401: the token authenticated, RBAC refused.
    assert caught.value.status == 403
    assert "disagg-user" in caught.value.body and "forbidden" in caught.value.body
