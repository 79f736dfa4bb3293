"""The test harness itself: the real control plane and the local kubelet.

The first tests need no cluster (the kubelet's pure helpers); the rest run
against the session's control plane.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from disagg.testing.cluster import LocalCluster, wait_until
from disagg.testing.kubelet import HOSTNAME_LABEL, LocalKubelet, selects
from disagg.testing.podenv import PodConfigError, command_line, container_env, expand
from disagg.testing.probes import Probe, ProbeTracker
from disagg.testing.processes import cpu_seconds, process_running, thread_cpu_seconds
from disagg.testing.rest import Kube, Obj, pod_path

GATE = "disagg.dev/linked"
WAIT_S = 60.0


# ---- pure helpers ------------------------------------------------------------


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$$(A)", env) == "$(A)"  # escaped
    assert expand("$(MISSING) $A", env) == "$(MISSING) $A"  # left as written


def test_container_env_resolves_field_refs_and_sources() -> None:
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"role": "decode"}},
           "spec": {"nodeName": "n"}}
    container = {
        "name": "c",
        "command": ["serve", "--host", "$(MY_IP)"],
        "args": ["$(GREETING)"],
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
            {"name": "GREETING", "value": "hi-$(NAME)"},
            {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
        ],
    }
    sources = {("ConfigMap", "cm"): {"x": "1"}, ("Secret", "s"): {"pw": "aHVudGVyMg=="}}
    env = container_env(pod, container, "127.0.0.9", "127.0.0.1",
                        lambda kind, ns, name: sources.get((kind, name)) if ns == "ns" else None)
    assert env == {"CM_x": "1", "MY_IP": "127.0.0.9", "NAME": "p", "ROLE": "decode",
                   "GREETING": "hi-p", "PASSWORD": "hunter2"}
    assert command_line(container, env) == ["serve", "--host", "127.0.0.9", "hi-p"]
    with pytest.raises(PodConfigError, match="not found"):
        container_env(pod, container, "127.0.0.9", "127.0.0.1", lambda kind, ns, name: None)
    with pytest.raises(PodConfigError, match="no command"):
        command_line({"name": "c", "args": ["x"]}, env)


def test_probe_tracker_applies_thresholds() -> None:
    tracker = ProbeTracker(Probe(kind="tcp", success_threshold=2, failure_threshold=2, period_s=1), started_at=0.0)
    assert tracker.due(0.0)
    assert not tracker.record(True, 0.0) and not tracker.ready  # 1 of 2 successes
    assert tracker.record(True, 1.0) and tracker.ready
    assert not tracker.record(False, 2.0) and tracker.ready  # 1 of 2 failures
    assert tracker.record(False, 3.0) and not tracker.ready
    assert not tracker.due(3.5) and tracker.due(4.0)


def test_thread_cpu_seconds_finds_the_busy_thread() -> None:
    """The per-thread CPU split the PD benchmark prints: a thread that spun shows its own time."""
    spun: list[str] = []
    release = threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.append(str(threading.get_native_id()))
        release.wait(timeout=30)

    before = thread_cpu_seconds(os.getpid())
    worker = threading.Thread(target=spin)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not spun and time.monotonic() < deadline:
            time.sleep(0.01)
        during = thread_cpu_seconds(os.getpid())
    finally:
        release.set()
        worker.join(timeout=30)
    assert spun and spun[0] not in before
    assert during[spun[0]] >= 0.25  # its own 0.3 s, not the process's
    assert sum(during.values()) <= cpu_seconds(os.getpid()) + 0.05
    assert cpu_seconds(f"{os.getpid()}/task/{spun[0]}") == 0.0  # it ended: gone, not an error


def test_node_selector_matches_like_the_scheduler() -> None:
    labels = {HOSTNAME_LABEL: "n1", "zone": "a"}
    assert selects({HOSTNAME_LABEL: "n1"}, labels)
    assert selects({HOSTNAME_LABEL: "n1", "zone": "a"}, labels)
    assert not selects({HOSTNAME_LABEL: "n2"}, labels)
    assert not selects({HOSTNAME_LABEL: "n1", "gpu": "h100"}, labels)  # every key must match


# ---- against the control plane ----------------------------------------------


def http_server_pod(name: str, directory: Path, labels: dict[str, str] | None = None,
                    gates: list[str] | None = None, probe_path: str = "/ready.txt", node: str = "") -> Obj:
    """A pod serving `directory` with `python -m http.server` on its own address."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            **({"nodeName": node} if node else {}),
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


def command_pod(name: str, command: list[str], restart_policy: str = "Always", grace_s: int = 5) -> Obj:
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


def condition(pod: Obj, type_: str) -> str | None:
    for c in pod.get("status", {}).get("conditions", []):
        if c["type"] == type_:
            return str(c["status"])
    return None


def wait_condition(kube: Kube, namespace: str, name: str, type_: str, status: str = "True") -> Obj:
    def check() -> Obj | None:
        pod = kube.get(pod_path(namespace, name))
        return pod if condition(pod, type_) == status else None

    return wait_until(check, WAIT_S, f"pod {namespace}/{name} condition {type_}={status}")


def wait_gone(kube: Kube, path: str) -> None:
    def gone() -> bool:
        try:
            kube.get(path)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        return False

    wait_until(gone, WAIT_S, f"{path} to be removed")


@pytest.mark.e2e
def test_http_server_pod_becomes_ready_on_its_own_loopback_address(kube: Kube, namespace: str, tmp_path: Path) -> None:
    (tmp_path / "ready.txt").write_text("served from the working directory")
    kube.post(pod_path(namespace), http_server_pod("web", tmp_path))
    pod = wait_condition(kube, namespace, "web", "Ready")
    ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert ip in ipaddress.ip_network("127.0.0.0/8") and str(ip) != "127.0.0.1"
    assert pod["spec"]["nodeName"] and pod["status"]["phase"] == "Running"
    # The ServiceAccount admission plugin ran: a projected API token volume was added.
    assert pod["spec"]["serviceAccountName"] == "default"
    assert any(v["name"].startswith("kube-api-access-") for v in pod["spec"]["volumes"])
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and "running" in status["state"] and status["restartCount"] == 0
    with urllib.request.urlopen(f"http://{ip}:8080/ready.txt", timeout=5) as r:
        assert r.read() == b"served from the working directory"


@pytest.mark.e2e
def test_readiness_gate_holds_ready_until_its_condition_is_true(kube: Kube, namespace: str, tmp_path: Path) -> None:
    (tmp_path / "ready.txt").write_text("ok")
    kube.post(pod_path(namespace), http_server_pod("gated", tmp_path, gates=[GATE]))
    pod = wait_condition(kube, namespace, "gated", "ContainersReady")
    # The kubelet writes both conditions in one status update.
    assert condition(pod, "Ready") == "False"
    # As the operator will: patch the gate's condition into the pod status.
    status_path = pod_path(namespace, "gated", "status")
    kube.patch(status_path, {"status": {"conditions": [{"type": GATE, "status": "True", "reason": "Linked"}]}})
    pod = wait_condition(kube, namespace, "gated", "Ready")
    assert condition(pod, GATE) == "True"
    kube.patch(status_path, {"status": {"conditions": [{"type": GATE, "status": "False", "reason": "Unlinked"}]}})
    wait_condition(kube, namespace, "gated", "Ready", "False")


@pytest.mark.e2e
def test_endpoint_slice_lists_only_ready_pods(
    kube: Kube, namespace: str, tmp_path: Path, routable_kubelet: LocalKubelet
) -> None:
    (tmp_path / "ready.txt").write_text("ok")
    labels, node = {"app": "web"}, routable_kubelet.node_name
    kube.post(pod_path(namespace), http_server_pod("ready", tmp_path, labels, node=node))
    # Same server, but its probe asks for a file that does not exist: never Ready.
    kube.post(pod_path(namespace), http_server_pod("unready", tmp_path, labels, probe_path="/absent", node=node))
    kube.post(f"/api/v1/namespaces/{namespace}/services", {
        "metadata": {"name": "web"},
        "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    })
    ready_ip = wait_condition(kube, namespace, "ready", "Ready")["status"]["podIP"]
    unready = wait_condition(kube, namespace, "unready", "ContainersReady", "False")
    assert condition(unready, "Ready") == "False"
    with urllib.request.urlopen(f"http://{ready_ip}:8080/ready.txt", timeout=5) as r:
        assert r.read() == b"ok"

    def ready_endpoints() -> dict[str, list[str]] | None:
        slices = kube.get(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                          labelSelector="kubernetes.io/service-name=web")["items"]
        endpoints = [e for s in slices for e in s.get("endpoints") or []]
        ready = {e["targetRef"]["name"]: e["addresses"] for e in endpoints if e["conditions"].get("ready")}
        return ready if len(endpoints) == 2 else None

    assert wait_until(ready_endpoints, WAIT_S, "an EndpointSlice with both pods") == {"ready": [ready_ip]}


@pytest.mark.e2e
def test_unscheduled_pods_bind_by_node_selector(
    cluster: LocalCluster, kube: Kube, namespace: str, routable_kubelet: LocalKubelet
) -> None:
    """The kubelets stand in for the scheduler: a pod selecting the routable
    node lands there, one selecting no node on the default node, and one
    selecting a node that does not exist stays unbound."""
    assert cluster.kubelet is not None
    selected = command_pod("selected", ["sleep", "600"], grace_s=1)
    selected["spec"]["nodeSelector"] = {HOSTNAME_LABEL: routable_kubelet.node_name}
    nowhere = command_pod("nowhere", ["sleep", "600"], grace_s=1)
    nowhere["spec"]["nodeSelector"] = {HOSTNAME_LABEL: "no-such-node"}
    for pod in (selected, command_pod("plain", ["sleep", "600"], grace_s=1), nowhere):
        kube.post(pod_path(namespace), pod)
    on_routable = wait_condition(kube, namespace, "selected", "Ready")
    assert on_routable["spec"]["nodeName"] == routable_kubelet.node_name
    assert ipaddress.ip_address(on_routable["status"]["podIP"]) not in ipaddress.ip_network("127.0.0.0/8")
    on_default = wait_condition(kube, namespace, "plain", "Ready")
    assert on_default["spec"]["nodeName"] == cluster.kubelet.node_name
    assert ipaddress.ip_address(on_default["status"]["podIP"]) in ipaddress.ip_network("127.0.0.0/8")
    # Both kubelets have passed over it several times by now (each resyncs every 0.5 s).
    assert not kube.get(pod_path(namespace, "nowhere"))["spec"].get("nodeName")


@pytest.mark.e2e
def test_endpoint_slices_refuse_loopback_addresses(kube: Kube, namespace: str) -> None:
    """Why the test above needs a second node: 127.0.0.N pods cannot be endpoints."""
    with pytest.raises(ApiException) as caught:
        kube.post(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", {
            "metadata": {"name": "loopback"}, "addressType": "IPv4",
            "endpoints": [{"addresses": ["127.0.0.2"]}],
        })
    assert caught.value.status == 422 and "loopback" in str(caught.value.body)


@pytest.mark.e2e
def test_deleting_a_pod_stops_its_process(cluster: LocalCluster, kube: Kube, namespace: str) -> None:
    # It ignores SIGTERM after saying so: only the SIGKILL after the grace period ends it.
    stubborn = ("import signal, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: print('got SIGTERM', flush=True))\n"
                "print('started', flush=True)\n"
                "while True:\n    time.sleep(1)\n")
    kube.post(pod_path(namespace), command_pod("stubborn", [sys.executable, "-c", stubborn], grace_s=2))
    wait_condition(kube, namespace, "stubborn", "Ready")
    assert cluster.kubelet is not None
    pid = cluster.kubelet.pod_pid(namespace, "stubborn")
    assert pid is not None and process_running(pid)
    log = cluster.kubelet.pod_log(namespace, "stubborn")
    wait_until(lambda: "started" in log.read_text(), WAIT_S, "the process to start")
    kube.delete(pod_path(namespace, "stubborn"))
    wait_gone(kube, pod_path(namespace, "stubborn"))
    assert not process_running(pid)
    assert "got SIGTERM" in log.read_text()


@pytest.mark.e2e
def test_restart_policy_decides_restarts(kube: Kube, namespace: str) -> None:
    kube.post(pod_path(namespace), command_pod("crasher", [sys.executable, "-c", "raise SystemExit(3)"], "Always"))
    kube.post(pod_path(namespace), command_pod("once", [sys.executable, "-c", "pass"], "Never"))

    def restarted() -> Obj | None:
        statuses = kube.get(pod_path(namespace, "crasher"))["status"].get("containerStatuses", [])
        return statuses[0] if statuses and statuses[0]["restartCount"] >= 1 else None

    status = wait_until(restarted, WAIT_S, "the crashing container to be restarted")
    assert status["lastState"]["terminated"]["exitCode"] == 3

    def succeeded() -> Obj | None:
        pod = kube.get(pod_path(namespace, "once"))
        return pod if pod["status"].get("phase") == "Succeeded" else None

    status = wait_until(succeeded, WAIT_S, "the run-once pod to succeed")["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and status["state"]["terminated"]["exitCode"] == 0


@pytest.mark.e2e
def test_tens_of_pods_run_on_distinct_addresses(cluster: LocalCluster, kube: Kube, namespace: str) -> None:
    names = [f"sleeper-{i}" for i in range(24)]
    for name in names:
        kube.post(pod_path(namespace), command_pod(name, ["sleep", "600"], grace_s=1))

    def all_ready() -> list[Obj] | None:
        pods = kube.get(pod_path(namespace))["items"]
        return pods if len(pods) == len(names) and all(condition(p, "Ready") == "True" for p in pods) else None

    pods = wait_until(all_ready, 2 * WAIT_S, f"{len(names)} pods Ready")
    assert len({p["status"]["podIP"] for p in pods}) == len(names)
    assert cluster.kubelet is not None
    pids = [cluster.kubelet.pod_pid(namespace, n) for n in names]
    assert all(pid is not None and process_running(pid) for pid in pids)
    kube.delete(pod_path(namespace))  # the whole collection
    wait_until(lambda: not kube.get(pod_path(namespace))["items"], 2 * WAIT_S, "all pods removed")
    assert not any(process_running(pid) for pid in pids if pid is not None)


@pytest.mark.e2e
def test_garbage_collector_deletes_dependents(kube: Kube, namespace: str) -> None:
    configmaps = f"/api/v1/namespaces/{namespace}/configmaps"
    owner = kube.post(configmaps, {"metadata": {"name": "owner"}})
    kube.post(configmaps, {"metadata": {"name": "dependent", "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}]}})
    kube.delete(f"{configmaps}/owner")
    wait_gone(kube, f"{configmaps}/dependent")


@pytest.mark.e2e
def test_invalid_object_is_rejected_by_the_api_server(kube: Kube, namespace: str) -> None:
    with pytest.raises(ApiException) as caught:
        kube.post(pod_path(namespace), command_pod("Not_A_DNS_Name", ["true"]))
    assert caught.value.status == 422 and "Not_A_DNS_Name" in str(caught.value.body)
    no_image = command_pod("no-image", ["true"])
    del no_image["spec"]["containers"][0]["image"]
    with pytest.raises(ApiException) as caught:
        kube.post(pod_path(namespace), no_image)
    assert caught.value.status == 422 and "spec.containers[0].image" in str(caught.value.body)


@pytest.mark.e2e
def test_non_admin_identity_is_refused_by_rbac(cluster: LocalCluster, namespace: str) -> None:
    user = cluster.kube(admin=False)
    try:
        with pytest.raises(ApiException) as caught:
            user.get(pod_path(namespace))
    finally:
        user.close()
    # 403, not 401: the token authenticated, RBAC refused.
    assert caught.value.status == 403
    assert "disagg-user" in str(caught.value.body) and "forbidden" in str(caught.value.body)


@pytest.mark.e2e
def test_up_and_down_commands(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    up = subprocess.run([sys.executable, "-m", "disagg.testing", "up", "--runtime-dir", str(runtime)],
                        capture_output=True, text=True, timeout=300, check=False)
    assert up.returncode == 0, up.stderr
    state = json.loads((runtime / "state.json").read_text())
    assert state["admin_kubeconfig"] in up.stdout and state["binaries"] in up.stdout
    kube = Kube(Path(state["admin_kubeconfig"]))
    try:
        nodes = kube.get("/api/v1/nodes")["items"]
    finally:
        kube.close()
    assert [n["metadata"]["name"] for n in nodes] == ["disagg-local-node"]
    down = subprocess.run([sys.executable, "-m", "disagg.testing", "down", "--runtime-dir", str(runtime)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert down.returncode == 0, down.stderr
    assert not process_running(state["pid"]) and not (runtime / "state.json").exists()
    # Nothing of that run is left: no process has the run folder on its command line.
    leftovers = subprocess.run(["pgrep", "-f", str(runtime)], capture_output=True, text=True, check=False)
    assert leftovers.stdout == ""


@pytest.mark.e2e
def test_pod_process_gets_its_environment(cluster: LocalCluster, kube: Kube, namespace: str, tmp_path: Path) -> None:
    show = "import os; print('|'.join([os.environ['NS'], os.environ['POD_IP'], os.getcwd()]), flush=True)"
    env_pod = command_pod("env", [sys.executable, "-c", show], "Never")
    env_pod["spec"]["containers"][0].update(
        workingDir=str(tmp_path),
        env=[{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
    )
    kube.post(pod_path(namespace), env_pod)
    # This Python environment stands in for the image: its `disagg` is on PATH.
    kube.post(pod_path(namespace), command_pod("cli", ["disagg", "--version"], "Never"))
    for name in ("env", "cli"):
        wait_until(lambda: kube.get(pod_path(namespace, name))["status"].get("phase") == "Succeeded",
                   WAIT_S, f"pod {name} to succeed")
    assert cluster.kubelet is not None
    ip = kube.get(pod_path(namespace, "env"))["status"]["podIP"]
    assert f"{namespace}|{ip}|{tmp_path}" in cluster.kubelet.pod_log(namespace, "env").read_text()
    assert "disagg" in cluster.kubelet.pod_log(namespace, "cli").read_text()


@pytest.mark.e2e
def test_force_deleted_pod_process_is_stopped(cluster: LocalCluster, kube: Kube, namespace: str) -> None:
    kube.post(pod_path(namespace), command_pod("forced", ["sleep", "600"], grace_s=1))
    wait_condition(kube, namespace, "forced", "Ready")
    assert cluster.kubelet is not None
    pid = cluster.kubelet.pod_pid(namespace, "forced")
    assert pid is not None and process_running(pid)
    # Grace 0: the object is gone at once, and the kubelet finds an orphan process.
    kube.delete(pod_path(namespace, "forced"), {"gracePeriodSeconds": 0})
    wait_until(lambda: not process_running(pid), WAIT_S, "the orphaned process to be stopped")


@pytest.mark.e2e
def test_a_secret_volume_is_mounted_and_follows_its_secret(cluster: LocalCluster, kube: Kube, namespace: str) -> None:
    secrets = f"/api/v1/namespaces/{namespace}/secrets"
    kube.post(secrets, {"metadata": {"name": "words"}, "stringData": {"word": "first"}})
    show = "import sys, time\nwhile True:\n    print(open(sys.argv[1]).read(), flush=True)\n    time.sleep(0.2)"
    pod = command_pod("reader", [sys.executable, "-c", show, "/etc/words/word"])
    pod["spec"]["volumes"] = [{"name": "words", "secret": {"secretName": "words", "defaultMode": 0o440}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "words", "mountPath": "/etc/words", "readOnly": True}]
    kube.post(pod_path(namespace), pod)
    assert cluster.kubelet is not None
    log = cluster.kubelet.pod_log(namespace, "reader")

    def shows(word: str) -> bool:
        return log.exists() and word in log.read_text()

    wait_until(lambda: shows("first"), WAIT_S, "the mounted Secret's value")
    kube.patch(f"{secrets}/words", {"stringData": {"word": "second"}})
    wait_until(lambda: shows("second"), WAIT_S, "the updated value, without a restart")
    assert kube.get(pod_path(namespace, "reader"))["status"]["containerStatuses"][0]["restartCount"] == 0
    # A pod whose Secret does not exist cannot start, and says why.
    missing = command_pod("orphan", ["sleep", "60"])
    missing["spec"]["volumes"] = [{"name": "gone", "secret": {"secretName": "nothing-here"}}]
    kube.post(pod_path(namespace), missing)

    def waiting_reason() -> str | None:
        statuses = kube.get(pod_path(namespace, "orphan")).get("status", {}).get("containerStatuses") or []
        state = statuses[0]["state"].get("waiting", {}) if statuses else {}
        return state.get("message") if state.get("reason") == "CreateContainerConfigError" else None

    assert "nothing-here" in wait_until(waiting_reason, WAIT_S, "a config error naming the Secret")
