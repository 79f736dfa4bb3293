"""A small local kubelet: real processes for the pods of a real API server.

It registers one Ready node, labelled `kubernetes.io/hostname: <node name>`,
binds unscheduled pods to it as a scheduler would by `spec.nodeSelector` (a pod
whose selector matches the node's labels; a pod with no selector only when this
kubelet is the default one, `bind_unselected`), and runs each pod's first container command as a local process
on an address of its own, reported as `status.podIP` (and given to the
process as `POD_IP`, since it binds the address itself): by default from a
random /16 of 127.0.0.0/8, which every Linux loopback accepts as it is. It runs
readiness probes, computes `Ready` as the kubelet does (containers ready and
every readiness gate True), reports container states and restarts per
`restartPolicy`, and on deletion SIGTERMs the process group, waits the grace
period, SIGKILLs and removes the pod object.

A pod that mounts its service account's token (`automountServiceAccountToken`
not false on the pod or its ServiceAccount) gets, instead of the files under
/var/run/secrets, a kubeconfig with a bound token of that account, named by
`KUBECONFIG`: the Kubernetes clients read it where in-cluster config is absent,
so an operator pod acts with its own account's rights, never the user's.
Secret volumes are files under the work folder, kept in step with their
Secrets, at paths that replace the mount paths (testing/volumes.py).

Threads: one reconcile loop (lists pods every `resync_s`, or at once when a
probe result changes something, and acts), a small pool for probes, one
thread per terminating pod. The shared state (`_runtimes`, the address pool)
is guarded by `_lock`.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from disagg.testing.controlplane import write_kubeconfig
from disagg.testing.pki import Identity
from disagg.testing.podenv import Obj, PodConfigError, command_line, container_env
from disagg.testing.probes import ProbeTracker, parse_probe
from disagg.testing.processes import ManagedProcess
from disagg.testing.rest import Kube, pod_path
from disagg.testing.volumes import SecretVolume, mount_paths, remap, secret_volumes, sync_volume

log = logging.getLogger(__name__)

HOST_IP = "127.0.0.1"
DEFAULT_NODE = "disagg-local-node"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# How often a running pod's Secret volumes are brought up to date (a kubelet: about a minute).
VOLUME_SYNC_S = 2.0


def _key(pod: Obj) -> str:
    return f"{pod['metadata'].get('namespace')}/{pod['metadata'].get('name')}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def selects(node_selector: dict[str, str], node_labels: dict[str, str]) -> bool:
    """Whether a pod's (non-empty) `spec.nodeSelector` matches a node's labels:
    every selected key present with the same value, as the scheduler requires."""
    assert node_selector, "an empty selector selects every node; the caller decides who takes such pods"
    return all(node_labels.get(k) == v for k, v in node_selector.items())


def default_address_pool() -> ipaddress.IPv4Network:
    """A random /16 inside 127.0.0.0/8, so that two kubelets on one machine
    (two test sessions) rarely hand out the same pod address."""
    return ipaddress.IPv4Network(f"127.{random.randint(16, 250)}.0.0/16")


@dataclass
class PodRuntime:
    """What the kubelet knows about one pod it runs."""

    uid: str
    namespace: str
    name: str
    ip: str
    log_path: Path
    grace_s: float  # terminationGracePeriodSeconds, for when the pod object is gone
    process: ManagedProcess | None = None
    started_at: str = ""  # RFC 3339, the current run's start
    started_mono: float = 0.0
    ever_started: bool = False
    restart_count: int = 0
    restart_at: float = 0.0  # monotonic time the next (re)start may happen
    backoff_s: float = 0.0
    waiting: tuple[str, str] = ("ContainerCreating", "")
    last_terminated: dict[str, Any] | None = None
    final: dict[str, Any] | None = None  # the terminated state once it will not run again
    tracker: ProbeTracker | None = None
    probe_in_flight: bool = False
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type -> (status, time)
    reported: dict[str, Any] | None = None
    volumes: list[SecretVolume] = field(default_factory=list)
    volumes_synced: float = 0.0  # monotonic

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class LocalKubelet:
    """Runs the pods bound to `node_name`; `start()` registers the node and returns at once."""

    def __init__(
        self,
        kubeconfig: Path,
        workdir: Path,
        node_name: str = DEFAULT_NODE,
        address_pool: ipaddress.IPv4Network | None = None,
        default_cwd: Path | None = None,
        resync_s: float = 0.5,
        backoff_s: tuple[float, float] = (1.0, 20.0),
        bind_unselected: bool = True,
    ) -> None:
        self.node_name = node_name
        self.node_labels = {HOSTNAME_LABEL: node_name}
        # With two kubelets on one API server only one may take the pods that
        # select no node; pods that select a node go to the kubelet that matches.
        self.bind_unselected = bind_unselected
        self.workdir = workdir
        self.default_cwd = str(default_cwd or Path.cwd())
        self.resync_s = resync_s
        self.backoff_s = backoff_s
        pool = address_pool or default_address_pool()
        # hosts() skips the network address; 127.0.0.1 is the control plane's.
        self._free_ips = [str(ip) for ip in pool.hosts() if str(ip) != HOST_IP]
        self.kube = Kube(kubeconfig)
        self._node_path = f"/api/v1/nodes/{node_name}"
        self._lock = threading.Lock()
        self._runtimes: dict[str, PodRuntime] = {}
        self._terminating: set[str] = set()  # uids whose stop has begun (once per pod)
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._probes = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet-probe")
        self._threads: list[threading.Thread] = []
        self._last_heartbeat = 0.0

    # ---- lifecycle --------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._register_node()
        t = threading.Thread(target=self._loop, name="kubelet-sync", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """Stop the loops and every pod process (the API objects stay)."""
        self._stopping.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=30)
        self._probes.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            procs = [rt.process for rt in self._runtimes.values() if rt.process is not None]
            self._runtimes.clear()
        # All at once: tens of pods must not take tens of grace periods.
        for proc in procs:
            proc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in procs:
            proc.stop(grace_s=deadline - time.monotonic())
        self.kube.close()

    def pod_log(self, namespace: str, name: str) -> Path:
        """Where the process of pod namespace/name writes its output."""
        return self.workdir / "pods" / f"{namespace}_{name}.log"

    def pod_pid(self, namespace: str, name: str) -> int | None:
        """The current process id of a pod's container, or None."""
        with self._lock:
            for rt in self._runtimes.values():
                if (rt.namespace, rt.name) == (namespace, name) and rt.process is not None:
                    return rt.process.pid
        return None

    def take_address(self) -> str:
        """An address of this node's pool that no pod will get: for a process on the host that a
        Service must reach (an EndpointSlice names it), such as an extension API server."""
        with self._lock:
            if not self._free_ips:
                raise RuntimeError(f"{self.node_name}: the pod address pool is exhausted")
            return self._free_ips.pop()

    # ---- node -------------------------------------------------------------

    def _node_status(self) -> dict[str, Any]:
        now = _now()
        return {
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "disagg local kubelet is posting ready status",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
            "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": self.node_name}],
            "capacity": {"cpu": str(os.cpu_count() or 1), "memory": "64Gi", "pods": "1000"},
            "allocatable": {"cpu": str(os.cpu_count() or 1), "memory": "64Gi", "pods": "1000"},
            "nodeInfo": {
                "kubeletVersion": "disagg-local", "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": "amd64", "containerRuntimeVersion": "local://process", "osImage": "",
                "kernelVersion": os.uname().release, "machineID": "", "systemUUID": "", "bootID": "",
            },
        }

    def _register_node(self) -> None:
        body = {"metadata": {"name": self.node_name, "labels": self.node_labels}}
        try:
            self.kube.post("/api/v1/nodes", body)
        except ApiException as e:
            if e.status != 409:
                raise
        # The API drops a new node's status, and TaintNodesByCondition gave it a
        # not-ready taint that only the (absent) node-lifecycle controller lifts.
        # The labels are patched too, for a node left over from an earlier run.
        self.kube.patch(self._node_path, {"metadata": {"labels": self.node_labels}, "spec": {"taints": None}})
        self.kube.patch(self._node_path + "/status", {"status": self._node_status()})
        self._last_heartbeat = time.monotonic()

    # ---- loops ------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(timeout=self.resync_s)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self._sync(self.kube.get("/api/v1/pods")["items"])
                if time.monotonic() - self._last_heartbeat > 20:
                    self.kube.patch(self._node_path + "/status", {"status": self._node_status()})
                    self._last_heartbeat = time.monotonic()
            except (ApiException, HTTPError, OSError) as e:
                # The API server may be restarting; the next round retries.
                log.warning("kubelet sync failed: %s", e)
            except Exception:
                # A bug here must not silently end the loop every pod depends on.
                log.exception("kubelet sync crashed; retrying")

    # ---- reconcile --------------------------------------------------------

    def _sync(self, pods: list[Obj]) -> None:
        seen: set[str] = set()
        for pod in pods:
            node = pod["spec"].get("nodeName")
            if node and node != self.node_name:
                continue
            seen.add(pod["metadata"]["uid"])
            try:
                self._sync_pod(pod)
            except ApiException as e:
                # One bad pod must not starve the others.
                log.warning("pod %s: %s", _key(pod), e)
        with self._lock:
            gone = [rt for uid, rt in self._runtimes.items() if uid not in seen and uid not in self._terminating]
            self._terminating &= seen | {rt.uid for rt in self._runtimes.values()}
        for rt in gone:
            # Force-deleted (grace 0) or its namespace vanished: nothing to report to.
            self._begin_termination(None, rt)

    def _sync_pod(self, pod: Obj) -> None:
        meta = pod["metadata"]
        if not pod["spec"].get("nodeName"):
            if "deletionTimestamp" not in meta and self._takes(pod):
                self._bind(pod)
            return
        with self._lock:
            rt = self._runtimes.get(meta["uid"])
        if "deletionTimestamp" in meta:
            self._begin_termination(pod, rt)
            return
        if rt is None:
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return  # finished before this kubelet started
            rt = self._admit(pod)
        self._advance(rt, pod)
        self._sync_volumes(rt)
        self._report(rt, pod)

    def _takes(self, pod: Obj) -> bool:
        """Whether this kubelet, standing in for the scheduler, binds an unscheduled pod.
        A pod whose selector matches several kubelets' nodes goes to whichever
        binds first; the others' bindings are refused (409)."""
        node_selector = pod["spec"].get("nodeSelector") or {}
        return selects(node_selector, self.node_labels) if node_selector else self.bind_unselected

    def _bind(self, pod: Obj) -> None:
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": meta["name"], "uid": meta["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
        }
        try:
            self.kube.post(pod_path(meta["namespace"], meta["name"], "binding"), body)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def _admit(self, pod: Obj) -> PodRuntime:
        meta = pod["metadata"]
        with self._lock:
            assert self._free_ips, "the pod address pool is exhausted"
            ip = self._free_ips.pop(0)
            rt = PodRuntime(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], ip=ip,
                            log_path=self.pod_log(meta["namespace"], meta["name"]),
                            grace_s=float(pod["spec"].get("terminationGracePeriodSeconds", 30)))
            self._runtimes[meta["uid"]] = rt
        others = [c["name"] for c in pod["spec"]["containers"][1:]]
        if others:
            log.warning("pod %s: only the first container runs here, not %s", _key(pod), others)
        return rt

    def _lookup(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        resource = "configmaps" if kind == "ConfigMap" else "secrets"
        try:
            obj = self.kube.get(f"/api/v1/namespaces/{namespace}/{resource}/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        data: dict[str, str] = obj.get("data", {})
        return data

    def _automounts_token(self, pod: Obj) -> bool:
        spec = pod["spec"]
        if "automountServiceAccountToken" in spec:
            return bool(spec["automountServiceAccountToken"])
        account = self._service_account(pod)
        return account is not None and account.get("automountServiceAccountToken", True) is not False

    def _service_account(self, pod: Obj) -> Obj | None:
        name = pod["spec"].get("serviceAccountName") or "default"
        try:
            return self.kube.get(f"/api/v1/namespaces/{pod['metadata']['namespace']}/serviceaccounts/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _token_kubeconfig(self, rt: PodRuntime, pod: Obj) -> Path:
        """A kubeconfig with a token of the pod's ServiceAccount, bound to the pod (it dies with it)."""
        account = pod["spec"].get("serviceAccountName") or "default"
        try:
            answer = self.kube.post(
                f"/api/v1/namespaces/{rt.namespace}/serviceaccounts/{account}/token",
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                 "spec": {"expirationSeconds": 24 * 3600,
                          "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": rt.name, "uid": rt.uid}}})
        except ApiException as e:
            raise PodConfigError(f"a token for service account {account!r}: {e.status} {e.reason}") from e
        path = self.workdir / "tokens" / f"{rt.namespace}_{rt.name}.kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        api = self.kube.api.configuration
        write_kubeconfig(path, api.host, Path(api.ssl_ca_cert),
                         Identity(f"system:serviceaccount:{rt.namespace}:{account}", answer["status"]["token"]))
        return path

    def _start_container(self, rt: PodRuntime, pod: Obj) -> None:
        container = pod["spec"]["containers"][0]
        injected = {"POD_IP": rt.ip, "POD_NAME": rt.name, "POD_NAMESPACE": rt.namespace}
        try:
            if self._automounts_token(pod):
                injected["KUBECONFIG"] = str(self._token_kubeconfig(rt, pod))
            volumes = secret_volumes(pod, self.workdir / "volumes" / f"{rt.namespace}_{rt.name}")
            for volume in volumes:
                sync_volume(volume, rt.namespace, self._lookup)
            mounts = mount_paths(container, volumes)
            env = {k: remap(v, mounts) for k, v in
                   {**injected, **container_env(pod, container, rt.ip, HOST_IP, self._lookup)}.items()}
            argv = [remap(a, mounts) for a in command_line(container, env)]
            cwd = container.get("workingDir") or self.default_cwd
            if not Path(cwd).is_dir():
                raise PodConfigError(f"workingDir {cwd!r} does not exist")
            tracker = None
            if "readinessProbe" in container:
                tracker = ProbeTracker(parse_probe(container["readinessProbe"], container, rt.ip), time.monotonic())
        except PodConfigError as e:
            rt.waiting = ("CreateContainerConfigError", str(e))
            rt.restart_at = time.monotonic() + self.backoff_s[0]
            return
        # The process sees this machine's environment under the pod's own
        # variables; this Python environment stands in for the image, so its
        # scripts (`disagg`) come first on PATH even when it is not activated.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
        # The user's own KUBECONFIG is no pod's business (a pod gets its account's, above).
        inherited = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        full_env = {**inherited, "PATH": path, **env}
        rt.log_path.parent.mkdir(parents=True, exist_ok=True)
        with rt.log_path.open("ab") as f:
            f.write(f"--- {_now()} starting {argv}\n".encode())
        try:
            rt.process = ManagedProcess(f"{rt.namespace}/{rt.name}", argv, rt.log_path, env=full_env, cwd=cwd)
        except OSError as e:  # e.g. the command does not exist
            rt.waiting = ("RunContainerError", f"starting {argv[0]!r}: {e}")
            rt.restart_at = time.monotonic() + self.backoff_s[1]
            return
        if rt.ever_started:
            rt.restart_count += 1
        rt.ever_started = True
        rt.env, rt.cwd, rt.tracker = full_env, cwd, tracker
        rt.volumes, rt.volumes_synced = volumes, time.monotonic()
        rt.started_at, rt.started_mono = _now(), time.monotonic()

    def _advance(self, rt: PodRuntime, pod: Obj) -> None:
        """Notice an exit, restart per policy, start probes that are due."""
        now = time.monotonic()
        if rt.process is not None and (code := rt.process.poll()) is not None:
            rt.process.reap()
            rt.process, rt.tracker = None, None
            # A signal death is reported as 128 + the signal number, as by runtimes.
            exit_code = code if code >= 0 else 128 - code
            term = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": rt.started_at, "finishedAt": _now()}
            policy = pod["spec"].get("restartPolicy", "Always")
            if policy == "Always" or (policy == "OnFailure" and exit_code != 0):
                lo, hi = self.backoff_s
                # A run that lasted well past the longest back-off resets it.
                rt.backoff_s = lo if now - rt.started_mono > 2 * hi else min(max(rt.backoff_s * 2, lo), hi)
                rt.last_terminated = term
                rt.waiting = ("CrashLoopBackOff", f"back-off {rt.backoff_s:.0f}s restarting failed container")
                rt.restart_at = now + rt.backoff_s
            else:
                rt.final = term
        if rt.process is None and rt.final is None and now >= rt.restart_at:
            self._start_container(rt, pod)
        if rt.tracker is not None and rt.running and not rt.probe_in_flight and rt.tracker.due(now):
            rt.probe_in_flight = True
            self._probes.submit(self._probe, rt, rt.tracker)

    def _sync_volumes(self, rt: PodRuntime) -> None:
        """Keep a running pod's Secret files in step with their Secrets."""
        if not rt.volumes or not rt.running or time.monotonic() - rt.volumes_synced < VOLUME_SYNC_S:
            return
        rt.volumes_synced = time.monotonic()
        for volume in rt.volumes:
            sync_volume(volume, rt.namespace, self._lookup)  # a vanished Secret keeps its last files

    def _probe(self, rt: PodRuntime, tracker: ProbeTracker) -> None:
        ok = tracker.probe.run(rt.env, rt.cwd)
        with self._lock:
            rt.probe_in_flight = False
            changed = tracker.record(ok, time.monotonic())
        if changed:
            self._wake.set()

    # ---- status -----------------------------------------------------------

    def _container_ready(self, rt: PodRuntime) -> bool:
        if not rt.running:
            return False
        return rt.tracker.ready if rt.tracker is not None else True

    def _condition(self, rt: PodRuntime, type_: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        status = "True" if ok else "False"
        previous = rt.transitions.get(type_)
        if previous is None or previous[0] != status:
            rt.transitions[type_] = (status, _now())
        cond = {"type": type_, "status": status, "lastProbeTime": None,
                "lastTransitionTime": rt.transitions[type_][1]}
        if reason:
            cond.update(reason=reason, message=message)
        else:
            cond.update(reason=None, message=None)
        return cond

    def _status(self, rt: PodRuntime, pod: Obj) -> dict[str, Any]:
        container = pod["spec"]["containers"][0]
        ready = self._container_ready(rt)
        state: dict[str, Any]
        if rt.running:
            state = {"running": {"startedAt": rt.started_at}}
        elif rt.final is not None:
            state = {"terminated": rt.final}
        else:
            reason, message = rt.waiting
            state = {"waiting": {"reason": reason, "message": message or None}}
        container_status = {
            "name": container["name"], "image": container.get("image", ""), "imageID": "",
            "containerID": f"local://{rt.process.pid}" if rt.running and rt.process else None,
            "ready": ready, "started": rt.running, "restartCount": rt.restart_count,
            "state": state,
            "lastState": {"terminated": rt.last_terminated} if rt.last_terminated else {},
        }
        if rt.final is not None:
            phase = "Succeeded" if rt.final["exitCode"] == 0 else "Failed"
        elif rt.ever_started:
            phase = "Running"
        else:
            phase = "Pending"
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates", [])]
        status = pod.get("status", {})
        current = {c["type"]: c["status"] for c in status.get("conditions", [])}
        missing = [g for g in gates if current.get(g) != "True"]
        if not ready:
            why = ("ContainersNotReady", f"containers with unready status: [{container['name']}]")
        elif missing:
            why = ("ReadinessGatesNotReady",
                   f"corresponding condition of pod readiness gate {missing} does not exist or is False")
        else:
            why = ("", "")
        conditions = [
            self._condition(rt, "PodReadyToStartContainers", True),
            self._condition(rt, "Initialized", True),
            self._condition(rt, "ContainersReady", ready, *(why if not ready else ("", ""))),
            self._condition(rt, "Ready", ready and not missing, *why),
            self._condition(rt, "PodScheduled", True),
        ]
        return {
            "phase": phase,
            "hostIP": HOST_IP, "hostIPs": [{"ip": HOST_IP}],
            "podIP": rt.ip, "podIPs": [{"ip": rt.ip}],
            "startTime": status.get("startTime") or _now(),
            "conditions": conditions,
            "containerStatuses": [container_status],
        }

    def _report(self, rt: PodRuntime, pod: Obj) -> None:
        with self._lock:
            status = self._status(rt, pod)
        if status == rt.reported:
            return
        try:
            # Strategic merge: conditions merge by type, so the gate conditions
            # that others (the operator) write are left alone.
            self.kube.patch(pod_path(rt.namespace, rt.name, "status"), {"metadata": {"uid": rt.uid}, "status": status})
            rt.reported = status
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    # ---- termination ------------------------------------------------------

    def _begin_termination(self, pod: Obj | None, rt: PodRuntime | None) -> None:
        uid = rt.uid if rt is not None else pod["metadata"]["uid"] if pod is not None else ""
        assert uid, "a termination needs a pod or a runtime"
        with self._lock:
            if uid in self._terminating:
                return
            self._terminating.add(uid)
        if pod is not None:
            grace = float(pod["metadata"].get("deletionGracePeriodSeconds",
                                              pod["spec"].get("terminationGracePeriodSeconds", 30)))
        else:
            assert rt is not None, "checked above"
            grace = rt.grace_s
        t = threading.Thread(target=self._terminate, args=(pod, rt, grace), daemon=True, name=f"kubelet-stop-{uid}")
        t.start()
        self._threads.append(t)

    def _terminate(self, pod: Obj | None, rt: PodRuntime | None, grace_s: float) -> None:
        """SIGTERM, wait the grace period, SIGKILL; then delete the pod object for good."""
        if rt is not None and rt.process is not None:
            code = rt.process.stop(grace_s=grace_s)
            log.info("pod %s/%s stopped (exit %s)", rt.namespace, rt.name, code)
        if pod is not None:
            meta = pod["metadata"]
            try:
                self.kube.delete(pod_path(meta["namespace"], meta["name"]),
                                 {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
            except ApiException as e:
                if e.status not in (404, 409):
                    log.warning("deleting pod %s failed: %s", _key(pod), e)
        if rt is not None:
            with self._lock:
                self._runtimes.pop(rt.uid, None)
                self._free_ips.append(rt.ip)
        self._wake.set()
